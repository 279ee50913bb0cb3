#!/usr/bin/env bash
# Session 21 (2 H200), wip/async-status: the new kernel-timeout test again, its worker now compiling every kernel
# and making every copy plan before rank 1's GPU sleeps (in session21_d.sh rank 1's host was held up by them past
# timeout_s=1 and rank 0's header exchange timed out instead).
# As run: the nvlink case passed; the nvlink_copy_engine case did not end within 150 s (killed; the log has one
# dot): most likely a copy stream waiting without bound (BENCHMARKS.md, session 21). The device budget was spent.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTHONPATH=src timeout -s KILL 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "kernel_timeout" --durations=0 > "$OUT/pytest_kernel_timeout_session21.log" 2>&1
echo "pytest rc $?"; grep -E "passed|failed|Error|assert" "$OUT/pytest_kernel_timeout_session21.log" | tail -6 | cut -c1-300
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; true
