#!/usr/bin/env bash
# Session 19 (2 H200), wip/buffer-overhead: an eager Buffer call's header exchange as one NCCL all-gather (was a
# batch of point-to-point messages) polled without sleeping for its first 2 ms (was a sleep of 100 us between
# polls), and _agree on Python ints. (1) bench/ep_buffer.py, main (variants/main) and the branch alternating, two
# rounds; (2) the GPU tests of the Buffer on NCCL (reference backend cases, the device backends against the
# reference, the MoE block).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
for round in 1 2; do
  for v in main branch; do
    src=src; [ $v = main ] && src=variants/main/src
    PYTHONPATH=$src timeout -s KILL 120 python3 bench/ep_buffer.py --comm-sms 20 --profile-top 15 \
      > "$OUT/ep_buffer_${v}_${round}_session19.log" 2>&1
    echo "$v round $round rc $?"; cp bench/results/ep_buffer.json "$OUT/ep_buffer_${v}_${round}_session19.json"
    grep " P=20: " "$OUT/ep_buffer_${v}_${round}_session19.log" | cut -c1-420; reap
  done
done
PYTHONPATH=src timeout -s KILL 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_dispatch.py \
  tests/test_ep_nvlink.py tests/test_ep_copy_engine.py tests/test_moe.py -k "nccl or buffer or moe" \
  > "$OUT/pytest_buffer_overhead_session19.log" 2>&1
echo "pytest rc $?"; tail -4 "$OUT/pytest_buffer_overhead_session19.log" | cut -c1-300
