#!/usr/bin/env bash
# 2 GPUs: timings of session30_split_unroll.patch (after session30_h.sh's tests): the FP8 dispatch that quantizes
# at 20 and 24 SMs, pushed (split 0) against shares 0.3 / 0.36 / 0.45 copied (staging programs 1.15 x share x
# SMs), each with main's quantize loop (unroll 0) and the unrolled one (2 chunks ahead). Estimate before the run
# (BENCHMARKS.md §2, session 30): about 107 us at 20 SMs and 90-95 at 24 with the split.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! grep -q quantized_copy_share src/smsplit/ep/nvlink.py; then
  patch -p1 --forward --no-backup-if-mismatch < bench/device/session30_split_unroll.patch > "$OUT/patch_split_unroll.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_split_unroll.log"; exit 1; }
fi
timeout -s KILL 400 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 --reps 30 --copy-shares 1.0 \
  --concurrent-sms --quantized-copy-splits 0 0.3 0.36 0.45 --unroll-quantize 0 2 > "$OUT/ep_split_unroll_session31.log" 2>&1
echo "ep rc $?"
grep "CUDA graph" "$OUT/ep_split_unroll_session31.log" | sed 's/nvlink_copy_engine share 1.0 chunks ([0-9., ]*) (default) stage 4 FP8 rows by sm//; s/ dispatch bf16 .*fp8 \+\([0-9.]*\) us (FP8 input \([0-9.]*\)).*round trip equal: \({[^}]*}\).*queued: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*together: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*/ fp8 \1 queued \4 together \5 equal \3/' | cut -c1-230
grep -m3 "Error\|Traceback" "$OUT/ep_split_unroll_session31.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
