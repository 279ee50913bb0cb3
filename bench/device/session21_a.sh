#!/usr/bin/env bash
# Next session (2 H200), main: the whole GPU suite after sessions 19-20's Buffer changes (headers through host
# shared memory, fewer host syncs, FP8-input rounds), in two parts like session 18's final run; then ep_buffer.py
# once (eager Buffer calls on the final main).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 290 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  > "$OUT/pytest_nvlink_session21.log" 2>&1
echo "nvlink tests rc $?"; tail -3 "$OUT/pytest_nvlink_session21.log" | cut -c1-300; reap
PYTHONPATH=src timeout -s KILL 290 python3 -m pytest -q -m gpu -p no:cacheprovider tests --ignore=tests/test_ep_nvlink.py \
  > "$OUT/pytest_rest_session21.log" 2>&1
echo "rest rc $?"; tail -3 "$OUT/pytest_rest_session21.log" | cut -c1-300; reap
ls /dev/shm | grep -c smsplit-ep
