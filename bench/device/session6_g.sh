#!/usr/bin/env bash
# Session 6, run G: the staged FP8 dispatch stages its hole fillers in its first launch (no wait for its own copies
# in the last one): the nvlink_copy_engine GPU tests, then the EP benchmark at 20 SMs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "match_reference or (replay_in_a_cuda_graph and copy_engine) or nvlink_copy_engine" 2>&1 \
  | grep -v -i "warn\|symm_mem" > "$OUT/pytest_nvlink.log"
tail -4 "$OUT/pytest_nvlink.log"
timeout 60 python3 bench/ep.py --comm-sms 20 --reps 20 --transports nvlink_copy_engine --copy-shares 1.0 \
  --concurrent-sms 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -4
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
