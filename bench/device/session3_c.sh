#!/usr/bin/env bash
# EP after the fixes: kernels alone, GPU tests, the EP benchmark with both transports.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 100 python3 bench/ep_kernels.py 2>&1 | tee "$OUT/ep_kernels.log" | grep -E "P=|NC=1 |NC=8 warps=8 TB=4|NC=8 warps=16 TB=2" | head -20
timeout 200 python3 -m pytest -q -m gpu -x tests/test_ep_copy_engine.py tests/test_ep_nvlink.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_ep.log" | tail -3
timeout 240 python3 bench/ep.py ${EP_ARGS:---comm-sms 8 16 20 24 32 --reps 20} 2>&1 | tee "$OUT/ep.log" | grep -v -i warn | grep -v symm_mem | tail -20
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
