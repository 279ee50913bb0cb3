#!/usr/bin/env bash
# Session 13, third lease (2 H200): with the two-rank combine sum in 16-byte vectors, the combine's chunks swept at
# 20 and 24 SMs (a smaller last chunk now that the sum is faster), then the full EP benchmark. Ran on the tree with
# the vector sum (reverted after: `ep_full_session13_v4sum.log`); session13_d.sh ran the full benchmark on main.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
timeout 150 python3 bench/ep.py --comm-sms 20 24 --reps 50 --transports nvlink_copy_engine --copy-shares 1.0 \
  --concurrent-sms --combine-chunks 0.5,0.8,1 0.5,0.8,0.92,1 0.45,0.75,0.92,1 0.4,0.7,0.88,1 2>&1 | clean \
  > "$OUT/ep_combine_chunks_session13.log"
grep "CUDA graph" "$OUT/ep_combine_chunks_session13.log" | cut -c1-330
timeout 330 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 50 --chunks 4 --copy-shares 1.0 2>&1 | clean \
  | tee "$OUT/ep_full_session13.log" | tail -25
cp bench/results/ep.json "$OUT/"
