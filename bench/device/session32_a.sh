#!/usr/bin/env bash
# Session 32 (2 H200): the Buffer GPU tests with the tests merged in session 32 (the device buffer poisoned between seeds,
# num_worst_tokens varied, a combine with two differentiable biases, cached BF16 and FP8 dispatches compared, and a
# new parametrization: each device backend at top-k 9 / 1, every token to one rank, a rank that sends nothing) on
# main, which since session 31 also compares an fp32 combine and the weights-only gradients of a device layout; the
# Buffer graph test with every captured output poisoned and an FP8 dispatch quantized in the captured graph.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 560 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_ep_nvlink.py tests/test_ep_copy_engine.py \
  -k "buffer_nvlink or buffer_device_backends or buffer_copy_engine_backend or buffer_dispatch_and_combine_replay" > "$OUT/pytest_buffer_session32.log" 2>&1
echo "buffer tests rc $?"; grep -E "PASSED|FAILED|ERROR" "$OUT/pytest_buffer_session32.log" | cut -c1-160; tail -3 "$OUT/pytest_buffer_session32.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
