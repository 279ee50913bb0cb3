#!/usr/bin/env bash
# TMA copy tests + sm_split with ldst and tma (GPU 0), copy-engine GPU tests, a short EP run.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 120 python3 -m pytest -q -m gpu -x tests/test_copy_tma.py tests/test_ep_copy_engine.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -3
timeout 150 python3 bench/ep.py --comm-sms 20 32 --reps 10 --concurrent-sms 20 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep_short.log" | tail -8
timeout 260 python3 bench/sm_split.py --copy-method ldst tma 2>&1 | tee "$OUT/sm_split_tma.log" | tail -30
cp bench/results/sm_split_ldst_tma.json "$OUT/" 2>/dev/null
