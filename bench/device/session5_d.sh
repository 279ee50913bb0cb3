#!/usr/bin/env bash
# The combine with 4 tokens per step and chunkings whose first chunk lands sooner; tests of both sums.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_ep_nvlink.py tests/test_ep_copy_engine.py 2>&1 | tee "$OUT/pytest_nvlink.log" | tail -5
timeout 300 python3 bench/ep.py --comm-sms 20 24 --reps 20 --chunks 4 --transports nvlink nvlink_copy_engine --copy-shares 1.0 0.7 \
  --combine-chunks 0.4,0.7,0.9,1 0.15,0.4,0.65,0.85,1 0.1,0.3,0.5,0.7,0.85,0.95,1 0.25,0.5,0.75,0.9,1 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -30
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
