#!/usr/bin/env bash
# Session 20 (2 H200), wip/connect-cleanup: host_headers.connect removes its file whatever fails. A short check on
# NCCL: the reference backend's NCCL tests and the nvlink Buffer against the reference (hidden 2048).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTHONPATH=src timeout -s KILL 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_dispatch.py \
  "tests/test_ep_nvlink.py::test_buffer_nvlink_backend_equals_reference_backend[2048]" -k "nccl or buffer" \
  > "$OUT/pytest_connect_session20.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_connect_session20.log" | cut -c1-300; ls /dev/shm | grep -c smsplit-ep
