#!/usr/bin/env bash
# Session 23 (2 H200), wip/fp8-push: an FP8 dispatch that quantizes, with bulk="copy_engine", pushes its rows from
# the kernel (quantized_rows_by="sm", on the copy plan's rows) instead of staging them for the copy engines.
# ep.py both ways in one process, twice in opposite order; then the GPU tests that run such dispatches.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
for order in "sm copy_engine" "copy_engine sm"; do
  PYTHONPATH=src timeout -s KILL 100 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 \
    --copy-shares 1.0 --quantized-rows-by $order --concurrent-sms > /tmp/ep_run.log 2>&1
  echo "ep ($order) rc $?"; cat /tmp/ep_run.log >> "$OUT/ep_fp8_push_session23.log"
  grep -E "graph, P=|Error|error" /tmp/ep_run.log | cut -c1-700; reap
done
PYTHONPATH=src timeout -s KILL 280 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "match_reference_on_two or cached_dispatches_in_a_row or buffer_nvlink_copy_engine or replay_in_a_cuda_graph" \
  > "$OUT/pytest_fp8_push_session23.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed|Error|differs|assert" "$OUT/pytest_fp8_push_session23.log" | tail -8 | cut -c1-300; reap
