#!/usr/bin/env bash
# Session 32 (2 H200): with the tests merged in session 32, the reference backend on NCCL: a missing peer (headers through
# host shared memory and through the group) raises EPTimeoutError naming it within timeout_s; buffer reuse across
# rounds with the buffer's own outputs poisoned (test_ep_dispatch.py, case_reuse_and_cached).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_ep_errors.py tests/test_ep_dispatch.py \
  -k "nccl" > "$OUT/pytest_reference_nccl_session32.log" 2>&1  # the reference backend on NCCL: missing peer, reuse
echo "reference-on-NCCL tests rc $?"; grep -E "PASSED|FAILED|ERROR" "$OUT/pytest_reference_nccl_session32.log" | cut -c1-160
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
