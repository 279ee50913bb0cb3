#!/usr/bin/env bash
# Next session (2 H200), main: session 26's DeepEP SM API (`Buffer.set_num_sms`, `Config`, `config=` honoured per call)
# on the device backends. The transports have run with their SM count changed between calls before (every
# bench/ep.py sweep does), through `Buffer` not yet: the new GPU test (both NVLink backends: counts 20, 12, 16, 8,
# 24 in turn, each call's results equal to the reference backend's, the transport's count checked after each), then
# the other Buffer GPU tests (the per-call count now flows through every device call).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "buffer or sm_count" > "$OUT/pytest_buffer_sms_session27.log" 2>&1
echo "rc $?"; grep -E "passed|failed|Error" "$OUT/pytest_buffer_sms_session27.log" | tail -5
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
