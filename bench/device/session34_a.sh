#!/usr/bin/env bash
# Session 34 (one H200): the new rounds worker at one rank for the three device backends (session34_world1.py),
# then the one-GPU suite (transport.symmetric_buffer). Logs in one tar file.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
timeout -s KILL 300 python3 bench/device/session34_world1.py > "$L/world1_rounds_a.log" 2>&1
echo "rounds rc $?"; grep -E "PASSED|FAILED|passed|Error|error|assert" "$L/world1_rounds_a.log" | grep -v FutureWarning | head -30
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests > "$L/pytest_one_gpu_a.log" 2>&1
echo "one-GPU suite rc $?"; grep -E "FAILED|Error" "$L/pytest_one_gpu_a.log" | head; tail -n 1 "$L/pytest_one_gpu_a.log"
tar -C "$L" -cf "$OUT/session34_a_logs.tar" .
true
