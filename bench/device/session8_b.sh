#!/usr/bin/env bash
# Session 8, second run: main + wip/combine-packed-sum (the two-rank combine sum on packed bf16 pairs). The combine
# chunks swept at 20 and 24 SMs (nvlink_copy_engine, replayed from CUDA graphs, each case checks a round trip
# first) beside main (base/, git archive of main) in the same run, then the whole GPU test suite.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
PYTHONPATH=base/src timeout 70 python3 base/bench/ep.py --comm-sms 20 24 --reps 20 --transports nvlink_copy_engine \
  --copy-shares 1.0 --concurrent-sms 2>&1 | clean > "$OUT/ep_main.log"; grep "graph" "$OUT/ep_main.log"
cp base/bench/results/ep.json "$OUT/ep_main.json" 2>/dev/null
export PYTHONPATH=src
timeout 150 python3 bench/ep.py --comm-sms 20 24 --reps 20 --transports nvlink_copy_engine --copy-shares 1.0 \
  --concurrent-sms --combine-chunks 0.4,0.7,0.9,1 0.6,1 0.5,1 0.7,1 1 0.3,0.6,1 2>&1 | clean > "$OUT/ep_chunks.log"
grep "graph" "$OUT/ep_chunks.log"; cp bench/results/ep.json "$OUT/ep_chunks.json" 2>/dev/null
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rf 2>&1 | clean > "$OUT/pytest_all.log"; tail -15 "$OUT/pytest_all.log"
