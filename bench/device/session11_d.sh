#!/usr/bin/env bash
# Session 11, last lease: the full EP benchmark on main (copy chains with no kernel before their first copy), then
# the whole GPU suite.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
timeout 280 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 50 --chunks 4 --copy-shares 1.0 2>&1 | clean \
  > "$OUT/ep_full.log"
cp bench/results/ep.json "$OUT/" 2>/dev/null
grep "CUDA graph\|NCCL all\|concurrent" "$OUT/ep_full.log" | cut -c1-330
timeout 290 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests 2>&1 | clean > "$OUT/pytest_gpu.log"
tail -4 "$OUT/pytest_gpu.log" | cut -c1-400
