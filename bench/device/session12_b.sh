#!/usr/bin/env bash
# Not yet run as a whole. Session 12 ran its FP8 profile (`bench/results/ep_profile_fp8_session12.log`) and a combine
# chunk sweep at 20 SMs (`ep_combine_chunks_session12.log`); what is left: the BF16 replay's profile and the combine
# chunks at 24 SMs. (The torch profiler over one CUDA-graph replay of nvlink_copy_engine at 20 SMs, FP8 then BF16
# dispatch, each with a combine, then the combine's chunks swept at 20 and 24 SMs.)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
timeout 150 python3 bench/ep_profile.py --transport nvlink_copy_engine --fp8 --graph --sms 20 --out "$OUT/prof_fp8" \
  2>&1 | clean
timeout 150 python3 bench/ep_profile.py --transport nvlink_copy_engine --graph --sms 20 --out "$OUT/prof_bf16" 2>&1 \
  | clean
timeout 200 python3 bench/ep.py --comm-sms 20 24 --reps 50 --transports nvlink_copy_engine --copy-shares 1.0 \
  --concurrent-sms --combine-chunks 0.5,0.8,1 0.4,0.75,1 0.5,0.85,1 0.4,0.7,0.9,1 0.3,0.6,0.85,1 2>&1 | clean \
  > "$OUT/ep_combine_chunks.log"
grep "CUDA graph" "$OUT/ep_combine_chunks.log" | cut -c1-330
