#!/usr/bin/env bash
# Session 12 (2 H200). Before the run, here: rm -rf variants && mkdir -p variants/evict &&
#   git archive wip/evict-first src bench | tar -x -C variants/evict   (variants/ is untracked: it travels; delete after)
# 1. wip/evict-first (l2_evict_first: the FP8 staging's and the combine sum's streamed lines evict-first in L2) without /
#    with --evict-first, ROUNDS rounds alternating: nvlink_copy_engine at 20 SMs (graph rows) and the concurrent GEMM
#    (green, 20 asked). Merge only if the GEMM loss drops and the comm times do not rise.
# 2. main: the combine's chunks at 20 SMs with a small last chunk (the sum of the last chunk's tokens is the tail).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in plain evict; do
    flag=""; [ $v = evict ] && flag="--evict-first"
    PYTHONPATH=variants/evict/src timeout 90 python3 variants/evict/bench/ep.py --comm-sms 20 --reps 20 \
      --transports nvlink_copy_engine --copy-shares 1.0 $flag 2>&1 | clean > "$OUT/evict_${v}_$r.log"
    grep "CUDA graph\|concurrent" "$OUT/evict_${v}_$r.log" | sed "s/^/$v r$r /" | cut -c1-300
  done
done
PYTHONPATH=src timeout 200 python3 bench/ep.py --comm-sms 20 --reps 50 --transports nvlink_copy_engine --copy-shares 1.0 \
  --concurrent-sms --combine-chunks 0.5,0.8,1 0.5,0.8,0.92,1 0.5,0.85,0.95,1 0.45,0.75,0.9,1 0.6,0.9,1 2>&1 | clean \
  > "$OUT/ep_combine_chunks_session12.log"
grep "CUDA graph" "$OUT/ep_combine_chunks_session12.log" | cut -c1-330
