#!/usr/bin/env bash
# Session 10: one replay of a CUDA-graph-captured dispatch + combine of `nvlink_copy_engine` at 20 SMs under the torch
# profiler (every kernel and copy with its stream, start and duration), FP8 then BF16 dispatch.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 bench/ep_profile.py --transport nvlink_copy_engine --fp8 --graph --sms 20 --out $OUT/prof_fp8 2>&1 \
  | grep -v -i "warn\|symm_mem"
timeout 200 python3 bench/ep_profile.py --transport nvlink_copy_engine --graph --sms 20 --out $OUT/prof_bf16 2>&1 \
  | grep -v -i "warn\|symm_mem"
