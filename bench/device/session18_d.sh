#!/usr/bin/env bash
# Session 18 (2 H200), on main with combine_chunks by SM count (default_combine_chunks: 4 chunks from 20 SMs on):
# (1) the full EP run with the defaults (ep.json back under $OUT); (2) more and smaller chunks at 16-24 SMs
# (ep.py, one call / 5 queued / started together); (3) the GPU tests that run copy-engine combines.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
timeout -s KILL 300 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 50 --chunks 4 --copy-shares 1.0 \
  > "$OUT/ep_default_chunks_session18.log" 2>&1
echo "ep.py (defaults) rc $?"; cp bench/results/ep.json "$OUT/ep.json"
grep "graph, P=\|Error\|NCCL all\|concurrent" "$OUT/ep_default_chunks_session18.log" | cut -c1-400; reap
timeout -s KILL 300 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 16 20 24 --reps 50 --copy-shares 1.0 \
  --combine-chunks 0.4,0.7,0.9,1 0.3,0.55,0.75,0.9,1 0.25,0.5,0.7,0.85,0.95,1 0.2,0.4,0.6,0.75,0.85,0.95,1 \
  > "$OUT/ep_more_chunks_session18.log" 2>&1
echo "ep.py (more chunks) rc $?"; grep "graph, P=\|Error" "$OUT/ep_more_chunks_session18.log" | sed 's/dispatch bf16.*combine  /combine /' | cut -c1-300; reap
timeout -s KILL 400 python3 -m pytest -m gpu tests/test_ep_nvlink.py tests/test_ep_copy_engine.py -k "copy_engine" \
  -q --tb=short > "$OUT/pytest_default_chunks_session18.log" 2>&1
echo "tests rc $?"; tail -3 "$OUT/pytest_default_chunks_session18.log"
