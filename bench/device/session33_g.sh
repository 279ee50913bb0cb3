#!/usr/bin/env bash
# Session 33 (one H200): the host time of eager uncached Buffer dispatches, by function (cProfile).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 150 python3 bench/device/session33_uncached_profile.py > "$OUT/uncached_profile_session33.log" 2>&1
echo "rc $?"; grep "uncached dispatch:" "$OUT/uncached_profile_session33.log"
