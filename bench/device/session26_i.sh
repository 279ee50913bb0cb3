#!/usr/bin/env bash
# Session 26 (2 H200), main: the FP8 dispatch is bound by its SMs' own work at 20 SMs (session26_h.sh), and the
# lean quantize loop alone ran faster at 32 warps than at 16 (bench/fp8_rows.py: 121.9 against 131.7 us). The
# dispatch at 32 warps (64 registers: 72 bytes of spills at 16 x 8, CPU-compiled) against 16, at 20 and 22 SMs, both
# orders (--num-warps applies to every kernel of the run; the FP8 figures are the point).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for w in 16 32 32 16; do
  timeout -s KILL 90 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 22 --reps 50 --copy-shares 1.0 \
    --concurrent-sms --num-warps $w > "$OUT/ep_fp8_warps${w}_session26_$SECONDS.log" 2>&1
  echo "warps $w rc $? $(grep -o 'P=[ 0-9]*: dispatch bf16\|queued: dispatch_bf16 [0-9.]*, dispatch_fp8 [0-9.]*\|together: dispatch_bf16 [0-9.]*, dispatch_fp8 [0-9.]*.*combine [0-9.]*' "$(ls -t $OUT/ep_fp8_warps${w}_session26_*.log | head -1)" | grep -v '^P' | tr '\n' ' ')"
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
done
