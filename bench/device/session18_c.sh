#!/usr/bin/env bash
# Next session (2 H200), on main after wip/own-stream is merged: the full EP run with the combine in 3 chunks (the
# default) and in 4 (0.4, 0.7, 0.9, 1: 4-8 us faster at 20-24 SMs in session 17, slower at 16, 32 not measured),
# to decide the default (perhaps by SM count). ep.json back under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 570 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 50 --chunks 4 --copy-shares 1.0 \
  --combine-chunks 0.5,0.8,1 0.4,0.7,0.9,1 > "$OUT/ep_full_session18.log" 2>&1
echo "rc $?"
cp bench/results/ep.json "$OUT/ep.json"
grep -v -i "warn\|symm_mem" "$OUT/ep_full_session18.log" | tail -45
