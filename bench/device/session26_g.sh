#!/usr/bin/env bash
# (Ran on commit 35ed53b, which holds the opt-in `quantize_token_split`; reverted after this run: no faster.)
# Session 26 (2 H200): the FP8 dispatch's time follows its rounds of 16-token steps (20 / 21 SMs: 13 rounds, 116.3-
# 116.8 us; 22 / 23: 12, 110.7-113.3; session 26's sweep), so the last round's idle programs cost time if an SM's
# remote stores bound it. Opt-in `quantize_token_split = "blocks"`: each program a contiguous block of tokens (its
# last step partial) instead of rounds. GPU reference test (cases 3 and 5 in blocks), then ep.py at 20, 22 and 24
# SMs, rounds vs blocks, both orders.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
timeout -s KILL 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "match_reference_on_two" > "$OUT/pytest_token_blocks_session26.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed|Error" "$OUT/pytest_token_blocks_session26.log" | tail -5; reap
for order in "rounds blocks" "blocks rounds"; do
  tag=${order// /_}
  timeout -s KILL 150 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 22 24 --reps 50 \
    --copy-shares 1.0 --concurrent-sms --quantize-token-split $order > "$OUT/ep_token_split_${tag}_session26.log" 2>&1
  echo "ep $order rc $?"; grep -o "FP8 tokens in blocks\|P=[ 0-9]*: dispatch bf16\|queued: dispatch_bf16 [0-9.]*, dispatch_fp8 [0-9.]*\|together: dispatch_bf16 [0-9.]*, dispatch_fp8 [0-9.]*" \
    "$OUT/ep_token_split_${tag}_session26.log" | tr '\n' ' ' | sed 's/FP8 tokens/\nFP8 tokens/g; s/ P=/\nP=/g'; echo
  reap
done
