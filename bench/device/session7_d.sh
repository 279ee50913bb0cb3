#!/usr/bin/env bash
# Session 7: the whole GPU suite on main (packed-word FP8 quantization), then the staging launch at 16 and 32 warps.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 360 python3 -m pytest -q -m gpu -p no:cacheprovider -rf 2>&1 | grep -v -i "warn\|symm_mem" > "$OUT/pytest_gpu.log"
tail -6 "$OUT/pytest_gpu.log"
timeout 100 python3 bench/fp8_stage.py --programs 20 --steps 8 16 32 --groups 8 --warps 16 32 2>&1 | tee "$OUT/fp8_stage.log" | tail -10
cp bench/results/fp8_stage.json "$OUT/" 2>/dev/null
