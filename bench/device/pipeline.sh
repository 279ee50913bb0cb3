#!/usr/bin/env bash
# Device call (2 GPUs): the pipeline benchmark, then sm_split again (a second sample of the split).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 bench/pipeline.py > "$OUT/pipeline.log" 2>&1; tail -7 "$OUT/pipeline.log"
cp bench/results/sm_split.json /tmp/sm_split_previous.json
timeout 150 python3 bench/sm_split.py > "$OUT/sm_split.log" 2>&1; tail -9 "$OUT/sm_split.log"
tar czf "$OUT/results.tgz" bench/results bench/figures 2>/dev/null
