#!/usr/bin/env bash
# 2 GPUs: why the split FP8 dispatch is slower (session30_k.sh: +20-30 us at 20-24 SMs): at 20 SMs, shares 0.1 /
# 0.2 / 0.36 copied against pushed (0), each with the staging programs' rows in 1 range (one wait, one copy) or 4;
# main's quantize loop. A fixed cost would show at 0.1 already; one that grows with the share would not.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! grep -q quantized_copy_share src/smsplit/ep/nvlink.py; then
  patch -p1 --forward --no-backup-if-mismatch < bench/device/session30_split_unroll.patch > "$OUT/patch_split_unroll.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_split_unroll.log"; exit 1; }
fi
timeout -s KILL 240 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 20 --copy-shares 1.0 \
  --concurrent-sms --quantized-copy-splits 0 0.1 0.2 0.36 --stage-chunks 1 4 --unroll-quantize 0 > "$OUT/ep_split_why.log" 2>&1
echo "ep rc $?"
grep "CUDA graph" "$OUT/ep_split_why.log" | sed 's/nvlink_copy_engine share 1.0 chunks ([0-9., ]*) (default)//; s/FP8 rows by sm//; s/ dispatch bf16 .*fp8 \+\([0-9.]*\) us (FP8 input \([0-9.]*\)).*round trip equal: \({[^}]*}\).*queued: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*together: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*/ fp8 \1 queued \4 together \5 equal \3/' | cut -c1-230
grep -m3 "Error\|Traceback" "$OUT/ep_split_why.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
