#!/usr/bin/env bash
# The whole GPU suite after Buffer learned to be captured in a CUDA graph (nvlink backend, num_worst_tokens).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py -k "buffer_dispatch_and_combine_replay" 2>&1 | tee "$OUT/pytest_buffer_graph.log" | tail -25
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider --deselect "tests/test_ep_nvlink.py::test_buffer_dispatch_and_combine_replay_in_a_cuda_graph" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -8
