#!/usr/bin/env bash
# Session 20 (2 H200), wip/fewer-syncs: an uncached Buffer dispatch reads its layout values in one copy to the
# host, and the reference transport's plan is made only where it moves data. (1) the Buffer GPU tests; (2)
# bench/ep_buffer.py before (variants/before = main) and after, one round each, nvlink and nvlink_copy_engine.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_dispatch.py \
  tests/test_ep_nvlink.py tests/test_ep_copy_engine.py tests/test_moe.py -k "nccl or buffer or moe" \
  > "$OUT/pytest_fewer_syncs_session20.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_fewer_syncs_session20.log" | cut -c1-300; reap
for v in before after; do
  src=src; [ $v = before ] && src=variants/before/src
  PYTHONPATH=$src timeout -s KILL 90 python3 bench/ep_buffer.py --comm-sms 20 --backends nvlink nvlink_copy_engine \
    --profile-top 12 > "$OUT/ep_buffer_fs_${v}_session20.log" 2>&1
  echo "$v rc $?"; cp bench/results/ep_buffer.json "$OUT/ep_buffer_fs_${v}_session20.json"
  grep " P=20: " "$OUT/ep_buffer_fs_${v}_session20.log" | cut -c1-420; reap
done
