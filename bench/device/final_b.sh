#!/usr/bin/env bash
# Device call B (2 GPUs): the pipeline and MoE-overlap benchmarks.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 bench/pipeline.py > "$OUT/pipeline.log" 2>&1; tail -12 "$OUT/pipeline.log"
timeout 300 python3 bench/moe_overlap.py --trace > "$OUT/moe_overlap.log" 2>&1; tail -20 "$OUT/moe_overlap.log"
tar czf "$OUT/results.tgz" bench/results bench/figures 2>/dev/null
