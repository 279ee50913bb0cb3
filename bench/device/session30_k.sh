#!/usr/bin/env bash
# 2 GPUs, short (for a lease with little device time left): session30_split_unroll.patch's split FP8 dispatch, the
# graph-replay GPU test of the split and the FP8 oracle test, then ep.py at 20 and 24 SMs: pushed (0) against
# shares 0.36 and 0.45 copied, each with main's loop (0) and the unrolled one (2 ahead).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! grep -q quantized_copy_share src/smsplit/ep/nvlink.py; then
  patch -p1 --forward --no-backup-if-mismatch < bench/device/session30_split_unroll.patch > "$OUT/patch_split_unroll.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_split_unroll.log"; exit 1; }
fi
timeout -s KILL 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "replay_in_a_cuda_graph and split or match_reference_on_two" > "$OUT/pytest_split_short.log" 2>&1
echo "pytest rc $?"; grep -E "passed|failed|Error" "$OUT/pytest_split_short.log" | head -6
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
timeout -s KILL 240 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 --reps 20 --copy-shares 1.0 \
  --concurrent-sms --quantized-copy-splits 0 0.36 0.45 --unroll-quantize 0 2 > "$OUT/ep_split_short.log" 2>&1
echo "ep rc $?"
grep "CUDA graph" "$OUT/ep_split_short.log" | sed 's/nvlink_copy_engine share 1.0 chunks ([0-9., ]*) (default) stage 4 FP8 rows by sm//; s/ dispatch bf16 .*fp8 \+\([0-9.]*\) us (FP8 input \([0-9.]*\)).*round trip equal: \({[^}]*}\).*queued: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*together: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*/ fp8 \1 queued \4 together \5 equal \3/' | cut -c1-230
grep -m3 "Error\|Traceback" "$OUT/ep_split_short.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
