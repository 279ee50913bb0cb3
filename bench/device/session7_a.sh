#!/usr/bin/env bash
# Session 7, first run: the whole GPU suite on main merged with the chunked FP8 quantization (wip/dispatch-unrolled),
# then the FP8 staging launch alone (tokens per step x groups per chunk) against the unquantized launch.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rf 2>&1 | grep -v -i "warn\|symm_mem" > "$OUT/pytest_gpu.log"
tail -15 "$OUT/pytest_gpu.log"
timeout 120 python3 bench/fp8_stage.py --programs 20 --steps 4 8 --groups 4 8 16 --warps 16 2>&1 | tee "$OUT/fp8_stage.log" | tail -14
cp bench/results/fp8_stage.json "$OUT/" 2>/dev/null
