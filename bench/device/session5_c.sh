#!/usr/bin/env bash
# Own rows by the copy engine in the bulk dispatch; the combine's local sum shapes (bench/combine_sum.py).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_ep_nvlink.py 2>&1 | tee "$OUT/pytest_nvlink.log" | tail -15
timeout 150 python3 bench/combine_sum.py --programs 20 2>&1 | tee "$OUT/combine_sum.log" | tail -40
cp bench/results/combine_sum.json "$OUT/" 2>/dev/null
timeout 200 python3 bench/ep.py --comm-sms 20 --reps 20 --chunks 4 --transports nvlink nvlink_copy_engine --copy-shares 1.0 0.7 0.5 0.4 \
  --concurrent-sms 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -14
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
