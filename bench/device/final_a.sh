#!/usr/bin/env bash
# Device call A (2 GPUs): every GPU test, the sm_split and EP benchmarks, `smsplit trace` and `smsplit demo`.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
timeout 120 python3 bench/sm_split.py > "$OUT/sm_split.log" 2>&1; tail -9 "$OUT/sm_split.log"
timeout 100 python3 bench/ep.py > "$OUT/ep.log" 2>&1; grep -v Warning "$OUT/ep.log" | tail -14
timeout 60 python3 -m smsplit trace --out /tmp/demo/trace > "$OUT/trace.log" 2>&1; tail -2 "$OUT/trace.log"
timeout 200 python3 -m smsplit demo --out /tmp/demo/moe > "$OUT/demo.log" 2>&1; tail -4 "$OUT/demo.log"
tar czf "$OUT/results.tgz" bench/results bench/figures -C /tmp demo 2>/dev/null
