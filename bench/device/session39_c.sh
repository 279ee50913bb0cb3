#!/usr/bin/env bash
# Session 39, one H200: after two reviews' fixes (run_ranks_on_one_gpu's wait after a failure and its last barrier;
# examples/dualpipev.py's option checks; Buffer's argument checks: int bounds and numpy ints, expert counts of an
# empty or absent topk_idx, a combine's top-k width named topk_weights, get_dispatch_layout's previous_event): the
# one-GPU suite without the shared-GPU tests (the examples' GPU tests among it), then those at 3 ranks.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
save() { tar -C "$L" -cf "$OUT/session39_c_logs.tar" .; }
echo "device copy: HEAD $(git rev-parse --short HEAD 2>/dev/null), changed files:"; git status --short 2>/dev/null | head -40
timeout -s KILL 330 python3 -m pytest -q -rs -p no:cacheprovider -m "gpu and not multigpu" -k "not more_ranks_than_gpus" \
  tests > "$L/pytest_one_gpu.log" 2>&1
echo "one-GPU suite rc $?"; tail -n 2 "$L/pytest_one_gpu.log" | cut -c1-200; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
timeout -s KILL 120 python3 -m pytest -q -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "more_ranks_than_gpus and (nvlink-3 or copy_engine-3)" > "$L/pytest_ranks_on_one_gpu_3.log" 2>&1
echo "shared-GPU tests at 3 ranks rc $?"; tail -n 1 "$L/pytest_ranks_on_one_gpu_3.log" | cut -c1-200; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
true
