#!/usr/bin/env bash
# Session 19 (2 H200), main + FP8 input (x quantized before the call, DeepEP's (x_fp8, scales)): the GPU tests that
# now dispatch it (transport rounds of all three transports, the Buffer against the reference backend), then the
# full EP run with its FP8-input column; ep.json back under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 260 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py tests/test_ep_copy_engine.py \
  -k "match_reference or equals_reference" > "$OUT/pytest_fp8_input_session19.log" 2>&1
echo "pytest rc $?"; tail -4 "$OUT/pytest_fp8_input_session19.log" | cut -c1-400
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
timeout -s KILL 300 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 50 --chunks 4 --copy-shares 1.0 \
  > "$OUT/ep_full_session19.log" 2>&1
echo "ep.py rc $?"; cp bench/results/ep.json "$OUT/ep.json"
grep "graph, P=\|Error\|NCCL all\|concurrent" "$OUT/ep_full_session19.log" | cut -c1-460
