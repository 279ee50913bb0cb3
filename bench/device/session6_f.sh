#!/usr/bin/env bash
# Session 6, run F: the staged FP8 dispatch on the rows of the BF16 one (hole fillers stored after the copies), the
# Buffer backend "nvlink_copy_engine" (eager against the reference, cached calls replayed in a CUDA graph): the nvlink
# GPU tests, then the EP benchmark (nvlink_copy_engine, 20 and 24 SMs, round trips checked).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py 2>&1 | grep -v -i "warn\|symm_mem" > "$OUT/pytest_nvlink.log"
tail -4 "$OUT/pytest_nvlink.log"
timeout 150 python3 bench/ep.py --comm-sms 20 24 --reps 20 --transports nvlink_copy_engine --copy-shares 1.0 \
  --concurrent-sms 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -6
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
