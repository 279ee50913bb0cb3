#!/usr/bin/env bash
# Session 11: the concurrent GEMM beside nvlink_copy_engine's eager FP8 dispatch + combine on a green comm budget of
# 20 (24 granted) SMs, before (variants/old: `git archive 5006274 src bench tests`) and after the copy-chain change.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for v in old new; do
  root=.; [ $v = old ] && root=variants/old
  PYTHONPATH=$root/src timeout 70 python3 $root/bench/ep.py --comm-sms 20 --reps 20 --transports nvlink_copy_engine \
    --copy-shares 1.0 2>&1 | grep -v -i "warn\|symm_mem" > "$OUT/ep_concurrent_$v.log"
  grep "concurrent" "$OUT/ep_concurrent_$v.log" | sed "s/^/$v /" | cut -c1-300
done
