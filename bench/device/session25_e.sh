#!/usr/bin/env bash
# Session 25 (2 H200), final main: the nvlink GPU tests that session25_a.sh did not run (all but the Buffer, kernel
# timeout and pooled-stream ones).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "not (buffer or kernel_timeout or pooled_stream)" > "$OUT/pytest_nvlink_rest_session25.log" 2>&1
echo "nvlink rest rc $?"; grep -E "passed|failed" "$OUT/pytest_nvlink_rest_session25.log" | tail -3
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
