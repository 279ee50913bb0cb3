#!/usr/bin/env bash
# Session 8, third run (main + the packed combine sum, combine chunks default 0.6,1): where the combine's time goes
# (torch profiler over one CUDA-graph replay, 2 and 4 chunks), then the full ep.py run, each graph timed one call
# at a time and 5 queued, with the old and the new combine chunks at every SM count.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
for chunks in 0.6,1 0.4,0.7,0.9,1; do
  timeout 70 python3 bench/ep_profile.py --transport nvlink_copy_engine --sms 20 --graph --combine-chunks $chunks \
    --out "$OUT/prof_$chunks" 2>&1 | clean > "$OUT/ep_profile_$chunks.log"
  grep -A3 -B1 "combine_kernel" "$OUT/ep_profile_$chunks.log" | head -12; tail -12 "$OUT/ep_profile_$chunks.log"
  rm -f "$OUT"/prof_$chunks/trace_*.json
done
timeout 420 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 20 --chunks 4 --copy-shares 1.0 \
  --combine-chunks 0.6,1 0.4,0.7,0.9,1 2>&1 | clean > "$OUT/ep.log"; tail -25 "$OUT/ep.log"
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
