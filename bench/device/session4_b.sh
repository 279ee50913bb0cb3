#!/usr/bin/env bash
# NVLink transport: FP8 rows in 16-byte stores, vectorized combine loads, copy-engine bulk option. Tests, then bench.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py tests/test_fp8.py 2>&1 | tee "$OUT/pytest_nvlink.log" | tail -15
timeout 300 python3 bench/ep.py --comm-sms 16 20 24 32 --reps 20 --chunks 4 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -30
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
