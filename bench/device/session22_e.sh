#!/usr/bin/env bash
# Session 22 (2 H200), wip/landing-poll after session22_d.sh (correct, but the combine polling whole rows took
# 417-424 us against 202-210 with chunk flags): the sum now polls the last 16 bytes of each row with a 256 ns
# back-off first, then the whole rows. (1) ep.py at 20 SMs, rows and chunks in one process, twice in opposite
# order; (2) the GPU tests of the sum and of late copies.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
for order in "rows chunks" "chunks rows"; do
  PYTHONPATH=src timeout -s KILL 100 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 \
    --copy-shares 1.0 --combine-waits $order --concurrent-sms > /tmp/ep_run.log 2>&1
  echo "ep ($order) rc $?"; cat /tmp/ep_run.log >> "$OUT/ep_landing_probe_session22.log"
  grep -E "graph, P=|Error|error" /tmp/ep_run.log | cut -c1-420; grep -o "combine [0-9.]* us$" /tmp/ep_run.log; reap
done
PYTHONPATH=src timeout -s KILL 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "sum_equals or no_row_before or (combines_in_a_row and copy_engine)" > "$OUT/pytest_landing_probe_session22.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed|Error|differs|assert" "$OUT/pytest_landing_probe_session22.log" | tail -8 | cut -c1-300; reap
