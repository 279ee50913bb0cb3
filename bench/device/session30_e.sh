#!/usr/bin/env bash
# 2 GPUs: the FP8 dispatch with its quantize chunks unrolled and loaded 2 ahead (session30_unroll.patch, where it is
# the default), which on one GPU took the pushing launch from 98.9 / 86.9 / 68.9 us to 96.8 / 78.7 / 62.4 at 20 / 24 /
# 32 programs (session30_d.sh). The FP8 GPU tests first (against the reference, cached, replayed; hidden 2176 has a
# partial last chunk), then ep.py, main's loop (0) against unrolled 2 ahead (2), in both orders.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! grep -q quantize_chunks_ahead src/smsplit/ep/nvlink.py; then
  patch -p1 --forward --no-backup-if-mismatch < bench/device/session30_unroll.patch > "$OUT/patch_session30_unroll.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_session30_unroll.log"; exit 1; }
fi
timeout -s KILL 280 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "match_reference_on_two or equals_reference_backend or replay_in_a_cuda_graph or cached_dispatches_in_a_row" \
  > "$OUT/pytest_unroll_session30.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_unroll_session30.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
run() {  # tag, unroll values in order
  timeout -s KILL 120 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 32 --reps 30 \
    --copy-shares 1.0 --concurrent-sms --unroll-quantize $2 > "$OUT/ep_ahead_$1_session30.log" 2>&1
  echo "ep $1 rc $?"
  grep "CUDA graph" "$OUT/ep_ahead_$1_session30.log" | sed 's/.*stage 4 FP8 rows by sm//; s/ dispatch bf16 .*fp8 \+\([0-9.]*\) us (FP8 input \([0-9.]*\)).*round trip equal: \({[^}]*}\).*queued: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*together: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*/ fp8 \1 queued \4 together \5 equal \3/' | cut -c1-200
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
}
run ab "0 2"
run ba "2 0"
