#!/usr/bin/env bash
# One device call for the foundation: environment, GPU tests, sm_split benchmark, demo.
# Usage on the device machine: bash bench/device/foundation.sh   (writes under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  nvidia-smi; nvidia-smi topo -m
  python3 -c "import cuda.bindings, torch, triton; print('cuda-bindings', cuda.bindings.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
  python3 -m smsplit info
} > "$OUT/env.log" 2>&1
timeout 300 python3 -m pytest -q -m gpu tests/test_budget.py tests/test_trace.py tests/test_ptx.py -p no:cacheprovider -x 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
timeout 300 python3 bench/sm_split.py 2>&1 | tee "$OUT/sm_split.log"
timeout 120 python3 -m smsplit demo --out /tmp/demo > "$OUT/demo.log" 2>&1; cp -r /tmp/demo "$OUT/demo" 2>/dev/null
tar czf "$OUT/results.tgz" bench/results bench/figures 2>/dev/null
cat "$OUT/env.log" | head -60
