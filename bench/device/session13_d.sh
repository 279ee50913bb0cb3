#!/usr/bin/env bash
# Session 13, fourth lease (2 H200): main with the input realignment (`buffer._dense`; the combine sum in 16-byte
# vectors reverted): the nvlink GPU tests (their Buffer cases now pass misaligned x), then the full EP benchmark.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
timeout 330 python3 -m pytest -m gpu tests/test_ep_nvlink.py -x -q 2>&1 | tail -6 | tee "$OUT/pytest_nvlink_session13_final.log"
timeout 200 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 50 --chunks 4 --copy-shares 1.0 2>&1 | clean \
  | tee "$OUT/ep_full_session13.log" | tail -25
cp bench/results/ep.json "$OUT/"
