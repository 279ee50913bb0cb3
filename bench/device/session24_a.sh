#!/usr/bin/env bash
# Next session (2 H200), main after session 23: the whole GPU suite (FP8 dispatches of the copy-engine transport now
# push their rows from the kernel by default), in parts that fit a call's limit, then ep.py at 20 / 24 / 32 SMs with
# the pushed FP8 rows (does the FP8 target's 110 us fall with more SMs?).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 150 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 32 --reps 30 \
  --copy-shares 1.0 --quantized-rows-by sm --concurrent-sms > "$OUT/ep_fp8_push_sms_session24.log" 2>&1
echo "ep rc $?"; grep -E "graph, P=|Error" "$OUT/ep_fp8_push_sms_session24.log" | cut -c1-700; reap
PYTHONPATH=src timeout -s KILL 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests --ignore=tests/test_ep_nvlink.py \
  > "$OUT/pytest_rest_session24.log" 2>&1
echo "rest rc $?"; tail -3 "$OUT/pytest_rest_session24.log"; reap
