#!/usr/bin/env bash
# Session 20 (2 H200), wip/review-mends: the status event of a Buffer's NVLink dispatch is recorded before the copies
# out of the transport's buffer (one call), and the coalesced wait has one home. (1) the Buffer GPU tests and the
# error tests; (2) bench/ep_buffer.py, two rounds, nvlink and nvlink_copy_engine at 20 SMs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_dispatch.py \
  tests/test_ep_nvlink.py tests/test_ep_copy_engine.py tests/test_moe.py tests/test_ep_errors.py \
  -k "nccl or buffer or moe or error or timeout" > "$OUT/pytest_review_mends_session20.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_review_mends_session20.log" | cut -c1-300; reap
for round in 1 2; do
  echo "=== round $round" >> "$OUT/ep_buffer_mends_session20.log"
  PYTHONPATH=src timeout -s KILL 90 python3 bench/ep_buffer.py --comm-sms 20 --backends nvlink nvlink_copy_engine \
    --profile-top 12 > /tmp/ep_buffer_run.log 2>&1
  echo "round $round rc $?"; cat /tmp/ep_buffer_run.log >> "$OUT/ep_buffer_mends_session20.log"
  cp bench/results/ep_buffer.json "$OUT/ep_buffer_mends_r${round}_session20.json"
  grep " P=20: " /tmp/ep_buffer_run.log | cut -c1-420; reap
done
