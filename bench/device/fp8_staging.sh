#!/usr/bin/env bash
# First GPU run of the FP8 staging path (wip/fp8-staging): the nvlink tests (the FP8 rounds of the
# nvlink_copy_engine worker stage in 4/1/7 launches; the graph replay test dispatches FP8 too), then the EP
# benchmark at 20 and 24 SMs (nvlink_copy_engine's FP8 column is the staged path) and the per-step sweep.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_ep_nvlink.py 2>&1 | tee "$OUT/pytest_nvlink.log" | tail -15
timeout 200 python3 bench/ep.py --comm-sms 20 24 --reps 20 --chunks 4 --transports nvlink nvlink_copy_engine --copy-shares 1.0 0.7 \
  --concurrent-sms 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -14
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
