#!/usr/bin/env bash
# bulk="copy_engine" sharing the rows between copy engines and SMs (copy_share). Tests, then the EP benchmark.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py 2>&1 | tee "$OUT/pytest_nvlink.log" | tail -15
timeout 340 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 20 --chunks 4 --copy-shares 1.0 0.8 0.7 0.6 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -60
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
