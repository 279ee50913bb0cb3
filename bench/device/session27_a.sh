#!/usr/bin/env bash
# Next session (2 H200), main: the FP8 dispatch's other path with the 16-byte e4m3 stores of session 26. The pushed
# path (default) sits at the SM-store link ceiling from 22 SMs on (109.7-111.0 us started together at 22); the
# copy engines move bytes faster (~362 GB/s against ~290 for SM stores) but need the rows staged first. Staged
# (`quantized_rows_by="copy_engine"`, 4 or 8 launches, each followed by its copies) against pushed, at 22, 24 and 32
# SMs, both orders; last measured with the 8-byte halves (session 19: 139.5-166.8 us at 20-32 SMs).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for order in "sm copy_engine" "copy_engine sm"; do
  tag=${order// /_}
  timeout -s KILL 200 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 22 24 32 --reps 50 \
    --copy-shares 1.0 --concurrent-sms --quantized-rows-by $order --stage-chunks 4 8 \
    > "$OUT/ep_fp8_staged_${tag}_session27.log" 2>&1
  echo "ep $order rc $?"; grep -o "stage [0-9]* FP8 rows by [a-z_]*\|P=[ 0-9]*: dispatch bf16\|together: dispatch_bf16 [0-9.]*, dispatch_fp8 [0-9.]*" \
    "$OUT/ep_fp8_staged_${tag}_session27.log" | tr '\n' ' ' | sed 's/ stage/\nstage/g'; echo
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
done
