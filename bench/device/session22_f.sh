#!/usr/bin/env bash
# Session 22 (2 H200), wip/landing-poll, third try: each thread polls its own words (inline PTX, no barrier,
# `ptx.wait_landed_b32`), 4 tokens per step (8 spill at 16 warps). ep.py rows and chunks in one process; the GPU
# tests of the sum and of late copies.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 90 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 \
  --copy-shares 1.0 --combine-waits rows chunks --concurrent-sms > "$OUT/ep_landing_thread_session22.log" 2>&1
echo "ep rc $?"; grep -E "graph, P=|Error|error" "$OUT/ep_landing_thread_session22.log" | sed 's/round trip equal.*5 queued/5 queued/' | cut -c1-300
grep -o "combine [0-9.]* us$" "$OUT/ep_landing_thread_session22.log"; reap
PYTHONPATH=src timeout -s KILL 70 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "sum_equals or (no_row_before and rows)" > "$OUT/pytest_landing_thread_session22.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed|Error|differs|assert" "$OUT/pytest_landing_thread_session22.log" | tail -6 | cut -c1-300; reap
