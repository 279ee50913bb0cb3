#!/usr/bin/env bash
# Session 13, first lease (2 H200): what a combine's copy chain costs beyond its bytes (bench/copy_chain.py: flags
# as 4-byte copies or stream memory writes, the start's wait and reset, the bump kernel); the BF16 replay profile
# (combine at 20 SMs); and the two benches session 12's review changed, re-run once (one GPU).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
timeout 120 python3 bench/copy_chain.py 2>&1 | clean | tee "$OUT/copy_chain_session13.log"
cp bench/results/copy_chain.json "$OUT/" 2>/dev/null
timeout 150 python3 bench/ep_profile.py --transport nvlink_copy_engine --graph --sms 20 --out "$OUT/prof_bf16" 2>&1 \
  | clean | tee "$OUT/ep_profile_bf16_session13.log"
timeout 100 python3 bench/sm_bandwidth.py --programs 20 --reps 3 2>&1 | clean | tee "$OUT/sm_bandwidth_review_session13.log"
timeout 100 python3 bench/fp8_tma_stage.py --programs 20 --words-only --reps 3 2>&1 | clean \
  | tee "$OUT/fp8_tma_stage_review_session13.log"
