#!/usr/bin/env bash
# Session 8, first run: main + wip/combine-packed-sum + wip/fp8-quads (merged, never GPU-run before). ep.py at 20
# SMs for main (base/, git archive of main) and the merge in the same run (each graph case checks a round trip
# first), the staging launch alone, then the whole GPU test suite on the merge.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
PYTHONPATH=base/src timeout 80 python3 base/bench/ep.py --comm-sms 20 --reps 20 --transports nvlink nvlink_copy_engine \
  --copy-shares 1.0 --concurrent-sms 2>&1 | clean > "$OUT/ep_main.log"; grep "graph" "$OUT/ep_main.log"
cp base/bench/results/ep.json "$OUT/ep_main.json" 2>/dev/null
export PYTHONPATH=src
timeout 110 python3 bench/ep.py --comm-sms 20 --reps 20 --transports nvlink nvlink_copy_engine --copy-shares 1.0 \
  --concurrent-sms --combine-chunks 0.4,0.7,0.9,1 0.6,1 0.8,1 2>&1 | clean > "$OUT/ep_merge.log"; grep "graph" "$OUT/ep_merge.log"
cp bench/results/ep.json "$OUT/ep_merge.json" 2>/dev/null
timeout 40 python3 bench/fp8_stage.py --programs 20 --steps 16 32 --groups 4 8 --warps 16 2>&1 | grep fp8
cp bench/results/fp8_stage.json "$OUT/" 2>/dev/null
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rf 2>&1 | clean > "$OUT/pytest_all.log"; tail -15 "$OUT/pytest_all.log"
