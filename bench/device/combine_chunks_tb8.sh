#!/usr/bin/env bash
# The combine's copy chunks again, now that the sum takes 8 tokens per step (the chunk sweep of session 8 ran at 4):
# nvlink_copy_engine, replayed (one call and 5 queued), 16 / 20 / 24 / 32 SMs, each case checks a round trip first.
# With the 2-chunk profile (copies 155 us + flags, then the last chunk's sum) and the faster sum, 3-4 chunks whose
# last is small should now keep the sum behind the copies: 0.4,0.75,1 and 0.35,0.7,0.9,1 by that estimate.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 bench/ep.py --comm-sms 16 20 24 32 --reps 20 --transports nvlink_copy_engine --copy-shares 1.0 \
  --concurrent-sms --combine-chunks 0.6,1 0.4,0.75,1 0.4,0.7,0.9,1 0.35,0.7,0.9,1 0.5,0.8,1 0.3,0.6,0.85,1 2>&1 \
  | grep -v -i "warn\|symm_mem" > "$OUT/ep_chunks_tb8.log"; grep "graph" "$OUT/ep_chunks_tb8.log"
cp bench/results/ep.json "$OUT/ep_chunks_tb8.json" 2>/dev/null
