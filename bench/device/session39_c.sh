#!/usr/bin/env bash
# Session 39, one H200: after the review fixes (6053efc+: run_ranks_on_one_gpu's wait after a failure and its last
# barrier; examples/dualpipev.py's option checks): the shared-GPU transport tests at 3 ranks and the examples' GPU
# tests again.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
save() { tar -C "$L" -cf "$OUT/session39_c_logs.tar" .; }
echo "device copy: HEAD $(git rev-parse --short HEAD 2>/dev/null), changed files:"; git status --short 2>/dev/null | head -30
timeout -s KILL 120 python3 -m pytest -q -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "more_ranks_than_gpus and (nvlink-3 or copy_engine-3)" > "$L/pytest_ranks_on_one_gpu_3.log" 2>&1
echo "shared-GPU tests at 3 ranks rc $?"; tail -n 1 "$L/pytest_ranks_on_one_gpu_3.log" | cut -c1-200; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
timeout -s KILL 200 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_examples.py > "$L/pytest_examples_gpu.log" 2>&1
echo "examples on the GPU rc $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$L/pytest_examples_gpu.log" | cut -c1-200; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
true
