#!/usr/bin/env bash
# Session 24 (2 H200), final main (with the free helper): the GPU tests outside the nvlink file, then the nvlink
# tests that session24_i.sh did not run (graph replays, Buffer backends against the reference, pooled streams).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests --ignore=tests/test_ep_nvlink.py \
  > "$OUT/pytest_rest_final_session24.log" 2>&1
echo "rest rc $?"; tail -1 "$OUT/pytest_rest_final_session24.log"; reap
PYTHONPATH=src timeout -s KILL 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "not (timed_out_wait or kernel_timeout or cached_dispatches_in_a_row or combines_in_a_row or match_reference_on_two or combine_sums_no_row)" \
  > "$OUT/pytest_nvlink_final_session24.log" 2>&1
echo "nvlink rc $?"; grep -E "passed|failed" "$OUT/pytest_nvlink_final_session24.log" | tail -2; reap
