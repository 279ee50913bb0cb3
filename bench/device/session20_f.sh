#!/usr/bin/env bash
# Session 20 (2 H200), wip/bounded-layout: one host poll for the NCCL waits; the copy-engine transport's layout
# all-gather waits against its deadline. The copy-engine GPU tests and the reference backend's NCCL tests.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTHONPATH=src timeout -s KILL 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_copy_engine.py \
  tests/test_ep_dispatch.py -k "copy_engine or nccl" > "$OUT/pytest_bounded_layout_session20.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_bounded_layout_session20.log" | cut -c1-300
