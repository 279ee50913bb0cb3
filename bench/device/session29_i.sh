#!/usr/bin/env bash
# FP8 peer rows by bulk copies, per warp (session29_bulk_warp.patch: session29_bulk_buffers.patch plus BULK_WARP /
# NvlinkTransport.bulk_warp / ep.py --bulk-warp). session29_d.sh: the CTA-wide bulk path costs ~1.9 us per chunk and
# SM whatever is in flight (two CTA barriers per chunk, one warp issuing every copy). Here each warp stages its own
# lanes' vectors (32 consecutive: 512 B of one token's chunk), syncs the warp, and its lane 0 issues one copy per
# destination; no CTA barrier in the chunk loop. Tests first (rows against the oracle, one-GPU copies), then ep.py
# at 20 / 24 / 32 SMs, stores (0) against per-warp bulk copies (1).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
patch -p1 --forward --no-backup-if-mismatch < bench/device/session29_bulk_warp.patch > "$OUT/patch_session29_i.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_session29_i.log"; exit 1; }
timeout -s KILL 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py tests/test_ptx.py \
  -k "warp_bulk or bulk_buffers5 or bulk_buffers6 or bulk_buffers7" > "$OUT/pytest_bulk_warp_session29.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_bulk_warp_session29.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
run() {  # tag, quantize step, buffers
  timeout -s KILL 80 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 32 --reps 30 \
    --copy-shares 1.0 --concurrent-sms --quantize-step $2 $3 --bulk-peer-rows 0 1 --bulk-warp --bulk-buffers $4 \
    > "$OUT/ep_bulk_warp_$1_session29.log" 2>&1
  echo "ep $1 rc $?"
  grep "CUDA graph" "$OUT/ep_bulk_warp_$1_session29.log" | sed 's/.*stage 4 FP8 rows by sm//; s/ dispatch bf16 .*fp8 \+\([0-9.]*\) us (FP8 input \([0-9.]*\)).*round trip equal: \({[^}]*}\).*queued: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*together: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*/ fp8 \1 queued \4 together \5 equal \3/' | cut -c1-200
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
}
run tb16 16 8 2
run tb16qg4 16 4 4
