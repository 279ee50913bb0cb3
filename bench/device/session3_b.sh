#!/usr/bin/env bash
# Copy-engine transport on 2 GPUs: GPU tests, then the EP benchmark (both transports) and a chunk sweep.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -m gpu -x tests/test_ep_copy_engine.py tests/test_ep_nvlink.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_ce.log" | tail -30
timeout 200 python3 bench/ep.py ${EP_ARGS:---comm-sms 8 20 32 --reps 10} 2>&1 | tee "$OUT/ep.log" | grep -v Warning | tail -30
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
for c in ${SWEEP:-4 16}; do
  timeout 100 python3 bench/ep.py --transports copy_engine --comm-sms 20 --concurrent-sms 20 --reps 10 --chunks $c 2>&1 | grep -E "copy_engine" | tee -a "$OUT/ep_chunks.log"
done
