#!/usr/bin/env bash
# Graph-capture test, EP benchmark (both transports + nvlink graph replays), sm_split interleaved rounds.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 100 python3 -m pytest -q -m gpu tests/test_ep_nvlink.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_nvlink.log" | tail -3
timeout 200 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 20 --chunks 4 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -24
cp bench/results/ep.json "$OUT/ep.json"
timeout 170 python3 bench/sm_split.py --copy-method tma ldst --interleave 5 2>&1 | tee "$OUT/sm_split_interleaved.log" | grep -E "kept|wrote" | tail -20
cp bench/results/sm_split_tma_ldst_interleaved.json "$OUT/" 2>/dev/null
