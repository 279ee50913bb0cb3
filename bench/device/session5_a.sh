#!/usr/bin/env bash
# Session 5 start: the whole GPU suite (commits since the last GPU run), then the EP benchmark at 20 SMs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 260 python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
timeout 300 python3 bench/ep.py --comm-sms 20 24 --reps 20 --chunks 4 --copy-shares 1.0 0.7 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -40
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
