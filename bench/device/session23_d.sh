#!/usr/bin/env bash
# Session 23 (2 H200): where a dispatch's and a combine's time goes on the GPU clock (bench/ep_timeline.py, new):
# the peer's copy's first bytes and its flag against the kernels, started together, at 20 and 24 SMs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTHONPATH=src timeout -s KILL 240 python3 bench/ep_timeline.py --comm-sms 20 24 --reps 30 > "$OUT/ep_timeline_session23.log" 2>&1
echo "rc $?"; grep -E "^P=|Error|error" "$OUT/ep_timeline_session23.log" | cut -c1-300
cp bench/results/ep_timeline.json "$OUT/" 2>/dev/null
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; true
