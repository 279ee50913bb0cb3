#!/usr/bin/env bash
# Session 12, first lease (2 H200): what a few SMs can read / write of HBM (bench/sm_bandwidth.py), then the nvlink
# GPU tests on main (the review commit 784bc3a had not run on a GPU).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 bench/sm_bandwidth.py --programs 1 8 20 24 32 2>&1 | grep -v -i warn | tee "$OUT/sm_bandwidth.log"
cp bench/results/sm_bandwidth.json "$OUT/" 2>/dev/null
timeout 330 python3 -m pytest -m gpu tests/test_ep_nvlink.py -x -q 2>&1 | tail -15 | tee "$OUT/pytest_nvlink_session12.log"
