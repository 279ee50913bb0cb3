#!/usr/bin/env bash
# After the shared token-load helper (nvlink.load_tokens) went into both dispatch kernels: the tests that dispatch.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_copy_engine.py tests/test_ep_nvlink.py -k "two_gpus or equals_reference" 2>&1 | tee "$OUT/pytest_load_tokens.log" | tail -6
