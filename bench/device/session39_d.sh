#!/usr/bin/env bash
# Session 39, one H200: after the pipeline review fixes (2971b42: complex activations' gradients, num_chunks bound,
# simulate's checks): the one-GPU tests of the pipeline, the MoE model and the EP errors.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "device copy: HEAD $(git rev-parse --short HEAD 2>/dev/null), changed files: $(git status --short 2>/dev/null | wc -l)"
timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/test_pipeline_runtime.py \
  tests/test_pipeline_schedule.py tests/test_moe.py tests/test_moe_demo.py tests/test_ep_errors.py > "$OUT/pytest_pipeline_moe_gpu.log" 2>&1
echo "one-GPU pipeline/MoE/EP-error tests rc $?"; tail -n 2 "$OUT/pytest_pipeline_moe_gpu.log" | cut -c1-200
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
true
