#!/usr/bin/env bash
# Next session (2 H200), main after session 24: the changes made without a GPU (Buffer: DeepEP's constructor
# keywords, config, static capture, destroy, tuple-style handles; previous_event waited for before the checks read
# the inputs; DualPipe's step checks; Linear under autocast; argument checks in budget, trace, fp8, moe, the demo):
# GPU tests outside the nvlink file (pipeline, MoE, budget, trace, fp8, copy engine, errors), then the nvlink file's
# Buffer tests and kernel timeouts; then the demo on 2 GPUs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests --ignore=tests/test_ep_nvlink.py \
  > "$OUT/pytest_rest_session25.log" 2>&1
echo "rest rc $?"; tail -1 "$OUT/pytest_rest_session25.log"; reap
PYTHONPATH=src timeout -s KILL 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "buffer or kernel_timeout or pooled_stream" > "$OUT/pytest_nvlink_buffer_session25.log" 2>&1
echo "nvlink buffer rc $?"; grep -E "passed|failed" "$OUT/pytest_nvlink_buffer_session25.log" | tail -2; reap
PYTHONPATH=src timeout -s KILL 200 python3 -m smsplit demo --steps 50 --out "$OUT/demo_session25" > "$OUT/demo_gpu_session25.log" 2>&1
echo "demo rc $?"; tail -3 "$OUT/demo_gpu_session25.log"; reap
