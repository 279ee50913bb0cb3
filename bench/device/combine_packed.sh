#!/usr/bin/env bash
# First GPU run of the two-rank combine sum on packed bf16 pairs (wip/combine-packed-sum): the single-GPU test of
# the sum against torch's fp32 sum (special values), the nvlink and copy-engine 2-GPU tests, then ep.py at 20 and
# 24 SMs (combine replayed from CUDA graphs, with fewer copy chunks now that the sum is cheaper; each graph case
# checks a round trip first). Merge only if all pass
# and the combine is faster.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_ep_nvlink.py -k combine_sum 2>&1 | tail -3
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_ep_nvlink.py tests/test_ep_copy_engine.py 2>&1 \
  | grep -v -i "warn\|symm_mem" > "$OUT/pytest_ep.log"; tail -3 "$OUT/pytest_ep.log"
timeout 150 python3 bench/ep.py --comm-sms 20 24 --reps 20 --transports nvlink nvlink_copy_engine copy_engine \
  --copy-shares 1.0 --concurrent-sms --combine-chunks 0.4,0.7,0.9,1 0.6,1 0.8,1 0.5,0.8,1 2>&1 | grep -v -i warn | grep -v symm_mem > "$OUT/ep.log"; grep "graph\|P=20\|P=24" "$OUT/ep.log"
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
