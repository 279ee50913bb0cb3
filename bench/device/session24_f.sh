#!/usr/bin/env bash
# Next session (2 H200), wip/fp8-wide-stores (after session24_e.sh says whether 16-byte stores move more across
# NVLink): the e4m3 rows quantized in the dispatch stored 16 bytes at a time (neighbouring lanes swap a half) against
# 8; ep.py both ways in one process, twice in opposite order (nvlink and nvlink_copy_engine, 20 SMs); then the GPU
# tests whose FP8 cases now use 16-byte stores (bit for bit against quantize_1x128).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
for order in "8 16" "16 8"; do
  PYTHONPATH=src timeout -s KILL 120 python3 bench/ep.py --transports nvlink nvlink_copy_engine --comm-sms 20 --reps 30 \
    --copy-shares 1.0 --fp8-store-bytes $order --concurrent-sms > /tmp/ep_run.log 2>&1
  echo "ep ($order) rc $?"; cat /tmp/ep_run.log >> "$OUT/ep_fp8_wide_stores_session24.log"
  grep -E "graph, P=|Error" /tmp/ep_run.log | cut -c1-600; reap
done
PYTHONPATH=src timeout -s KILL 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "match_reference_on_two" > "$OUT/pytest_fp8_wide_stores_session24.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed" "$OUT/pytest_fp8_wide_stores_session24.log" | tail -3; reap
