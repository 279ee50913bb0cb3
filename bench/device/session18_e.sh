#!/usr/bin/env bash
# Session 18 (2 H200), main: the full EP run with the concurrent GEMM measured in 4 interleaved rounds (GEMM alone,
# comm alone, both; odd rounds reversed; the gate's sleep long enough to queue every eager call first), ep.json back
# under $OUT; then sm_split.py's interleaved mode once (interleaved_rounds moved to bench/common.py).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 300 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 50 --chunks 4 --copy-shares 1.0 \
  > "$OUT/ep_full_session18.log" 2>&1
echo "ep.py rc $?"; cp bench/results/ep.json "$OUT/ep.json"
grep "graph, P=\|Error\|NCCL all\|concurrent" "$OUT/ep_full_session18.log" | cut -c1-420
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
timeout -s KILL 200 python3 bench/sm_split.py --comm-sms 24 --modes green --interleave 2 > "$OUT/sm_split_check_session18.log" 2>&1
echo "sm_split rc $?"; tail -5 "$OUT/sm_split_check_session18.log" | cut -c1-300
