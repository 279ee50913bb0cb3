#!/usr/bin/env bash
# Session 22 (2 H200), wip/landing-poll: the copy-engine combine's sum polls each row until it lands (the combine
# area's words hold EMPTY until a copy overwrites them; the sum puts EMPTY back), one copy per source, no chunk
# flags to wait for. (1) ep.py at 20 SMs, combine waits rows and chunks in one process, twice in opposite order;
# (2) the GPU tests that run copy-engine combines.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
for order in "rows chunks" "chunks rows"; do
  PYTHONPATH=src timeout -s KILL 100 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 \
    --copy-shares 1.0 --combine-waits $order --concurrent-sms > /tmp/ep_run.log 2>&1
  echo "ep ($order) rc $?"; cat /tmp/ep_run.log >> "$OUT/ep_landing_poll_session22.log"
  grep -E "graph, P=|Error|error" /tmp/ep_run.log | cut -c1-420; reap
done
PYTHONPATH=src timeout -s KILL 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "sum_equals or no_row_before or combines_in_a_row or match_reference_on_two or buffer_nvlink_copy_engine or (timeout_is_raised and nvlink_copy_engine) or cuda_graph" \
  > "$OUT/pytest_landing_poll_session22.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed|Error|differs|assert" "$OUT/pytest_landing_poll_session22.log" | tail -8 | cut -c1-300; reap
