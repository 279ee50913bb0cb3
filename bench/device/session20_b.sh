#!/usr/bin/env bash
# Session 20 (2 H200), wip/host-headers: Buffer headers through host shared memory (/dev/shm) instead of an NCCL
# all-gather. (1) the Buffer GPU tests on the branch; (2) bench/ep_buffer.py, before (variants/before = main) and
# after, alternating, three rounds, nvlink and nvlink_copy_engine at 20 SMs; (3) smsplit demo on the branch.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_dispatch.py \
  tests/test_ep_nvlink.py tests/test_ep_copy_engine.py tests/test_moe.py -k "nccl or buffer or moe" \
  > "$OUT/pytest_host_headers_session20.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_host_headers_session20.log" | cut -c1-300; reap
for round in 1 2 3; do
  for v in before after; do
    src=src; [ $v = before ] && src=variants/before/src
    echo "=== round $round" >> "$OUT/ep_buffer_hh_${v}_session20.log"
    PYTHONPATH=$src timeout -s KILL 90 python3 bench/ep_buffer.py --comm-sms 20 --backends nvlink nvlink_copy_engine \
      --profile-top 12 > /tmp/ep_buffer_run.log 2>&1
    echo "$v round $round rc $?"; cat /tmp/ep_buffer_run.log >> "$OUT/ep_buffer_hh_${v}_session20.log"
    [ $v = after ] && cp bench/results/ep_buffer.json "$OUT/ep_buffer_hh_after_r${round}_session20.json"
    grep " P=20: " /tmp/ep_buffer_run.log | cut -c1-420; reap
  done
done
PYTHONPATH=src timeout -s KILL 150 python3 -m smsplit demo --out /tmp/demo_hh > "$OUT/demo_hh_session20.log" 2>&1
echo "demo rc $?"; grep -v "^ *$" "$OUT/demo_hh_session20.log" | tail -2 | cut -c1-200
cp /tmp/demo_hh/summary.json "$OUT/demo_hh_session20.json" 2>/dev/null; reap
