#!/usr/bin/env bash
# (Session 35: the patch regenerated on main after session 34's docs edits: bench/device/session35_streams.patch.)
# Session 33 (2 H200), regenerated on main after FastLaunch and with cheaper stream hops (one event each way, set_stream): DeepEP's stream contract (session35_streams.patch: every Buffer call's work on the
# communication stream, budget.comm_stream or the buffer's own; it waits for previous_event or the calling stream;
# async_finish lets the calling stream run ahead). Its one-GPU test passed (pytest_streams_one_gpu_session33.log);
# here its 2-GPU overlap test for the three device backends, then the Buffer GPU tests of test_ep_nvlink.py with it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=bench/device/session35_streams.patch
patch -s --no-backup-if-mismatch -p1 < $P
timeout -s KILL 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_ep_streams.py \
  > "$OUT/pytest_streams_session33.log" 2>&1
echo "streams tests rc $?"; grep -E "PASSED|FAILED|ERROR|assert" "$OUT/pytest_streams_session33.log" | cut -c1-200 | head -20
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
timeout -s KILL 420 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_ep_nvlink.py -k "buffer" \
  > "$OUT/pytest_streams_buffer_nvlink_session33.log" 2>&1
echo "nvlink buffer tests rc $?"; grep -E "PASSED|FAILED|ERROR" "$OUT/pytest_streams_buffer_nvlink_session33.log" | cut -c1-160
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
patch -s -R --no-backup-if-mismatch -p1 < $P
