#!/usr/bin/env bash
# Session 24 (2 H200): the NVLink kernels free their copy stream's FREE / X_FREE words through one helper
# (`_free_copy_stream`, release stores in all four places; the combine's two were plain stores): the GPU tests that
# time kernels out (both kernels' error paths) and those that run copy-engine dispatches and combines in a row.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "timed_out_wait or kernel_timeout or cached_dispatches_in_a_row or combines_in_a_row or match_reference_on_two or combine_sums_no_row" \
  > "$OUT/pytest_free_helper_session24.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed" "$OUT/pytest_free_helper_session24.log" | tail -3; reap
