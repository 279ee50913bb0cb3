#!/usr/bin/env bash
# Next session (2 H200), wip/inert-after-failure: the NVLink kernels do nothing once an earlier wait of their rank
# timed out (they only free their copy stream), so no Buffer backend waits for its last kernels any more (the
# copy-engine transport's flags carry call numbers). (1) the kernel-timeout test for all three device backends
# (nvlink_copy_engine hung in session 21 without inert kernels; copy_engine not yet run without the wait); (2) the whole nvlink GPU file in two parts. Also on the branch (GPU-only, not yet run):
# EPTimeoutError.on_device, the one home of the device transports' timeout message; the two Buffer workers of the
# nvlink file share their setup (_small_buffer_dispatched).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "kernel_timeout" --durations=0 > "$OUT/pytest_inert_timeout_session22.log" 2>&1
echo "timeout tests rc $?"; grep -E "passed|failed|Error|assert" "$OUT/pytest_inert_timeout_session22.log" | tail -4 | cut -c1-300; reap
PYTHONPATH=src timeout -s KILL 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "not kernel_timeout and not buffer and not replay and not sum_equals" > "$OUT/pytest_inert_nvlink1_session22.log" 2>&1
echo "nvlink part 1 rc $?"; tail -1 "$OUT/pytest_inert_nvlink1_session22.log" | cut -c1-300; reap
PYTHONPATH=src timeout -s KILL 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "not kernel_timeout and (buffer or replay or sum_equals)" > "$OUT/pytest_inert_nvlink2_session22.log" 2>&1
echo "nvlink part 2 rc $?"; tail -1 "$OUT/pytest_inert_nvlink2_session22.log" | cut -c1-300; reap
