#!/usr/bin/env bash
# For the next lease, one H200 or more (run first): session 33's last changes were CPU-tested only (FastLaunch's key
# after the review, its LRU bound, the layout kernels' top-k bound): the one-GPU suite, the Buffer workers at one rank,
# launch_overhead (JIT / FastLaunch / direct) and session 32's host probe on the final code. Logs in one tar file.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
timeout -s KILL 120 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests > "$L/pytest_one_gpu_i.log" 2>&1
echo "one-GPU suite rc $?"; grep -E "FAILED|Error" "$L/pytest_one_gpu_i.log" | head; tail -n 1 "$L/pytest_one_gpu_i.log"
timeout -s KILL 60 python3 bench/launch_overhead.py > "$L/launch_overhead_i.log" 2>&1; grep "per call" "$L/launch_overhead_i.log"
cp bench/results/launch_overhead.json "$L/launch_overhead_i.json"
timeout -s KILL 90 python3 bench/device/session32_host_probe.py > "$L/host_probe_i.log" 2>&1; grep -E "^nvlink" "$L/host_probe_i.log" | cut -c1-200
timeout -s KILL 260 python3 bench/device/session32_world1.py > "$L/world1_tests_i.log" 2>&1
echo "world1 rc $?"; grep -E "FAILED|passed" "$L/world1_tests_i.log" | cut -c1-200
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
tar -C "$L" -cf "$OUT/session33_i_logs.tar" .
true
