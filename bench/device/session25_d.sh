#!/usr/bin/env bash
# Session 25 (2 H200), final main: the full EP run (all three transports, comm SMs 8-32, NCCL and the
# copy-engine ceiling, the concurrent GEMM) on the code as it is now (FP8 rows pushed by the kernel since session
# 23, the filler range since session 24); the main ep.json back under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 420 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 50 --chunks 4 --copy-shares 1.0 \
  > "$OUT/ep_full_session25.log" 2>&1
echo "ep.py rc $?"; cp bench/results/ep.json "$OUT/ep.json"
grep "graph, P=\|Error\|NCCL all\|concurrent" "$OUT/ep_full_session25.log" | cut -c1-460
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
