#!/usr/bin/env bash
# Session 30 (2 H200), main after session 29's merges (the combine's overflow check in the last program): the issue's full EP run
# comm SMs 8-32, NCCL and the copy-engine ceiling, the concurrent GEMM), now also timing the combine with top-k
# weights (`--combine-weights`: a column of its own in `python bench/tables.py ep`). The main ep.json back under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 500 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 50 --chunks 4 --copy-shares 1.0 \
  --combine-weights > "$OUT/ep_full_session30.log" 2>&1
echo "ep.py rc $?"; cp bench/results/ep.json "$OUT/ep.json"
grep "graph, P=\|Error\|NCCL all\|concurrent" "$OUT/ep_full_session30.log" | cut -c1-460
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
