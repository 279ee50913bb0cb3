#!/usr/bin/env bash
# Session 8, last run: 8 tokens per combine step (2 ranks) as the default. The combine at 4 and 8 tokens per step
# at the other SM counts (replayed, 5 queued), the full ep.py run for BENCHMARKS.md, then the nvlink tests.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
timeout 60 python3 bench/ep_steps.py --kernels combine --steps 4 8 --warps 16 --comm-sms 8 16 24 32 --queued 5 2>&1 \
  | clean > "$OUT/ep_steps_combine_sms.log"; grep "P=" "$OUT/ep_steps_combine_sms.log"
cp bench/results/ep_steps.json "$OUT/ep_steps_combine_sms.json" 2>/dev/null
timeout 130 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 20 --chunks 4 --copy-shares 1.0 2>&1 | clean \
  > "$OUT/ep.log"; grep "graph\|NCCL\|concurrent" "$OUT/ep.log"
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_ep_nvlink.py 2>&1 | clean \
  > "$OUT/pytest_nvlink.log"; tail -4 "$OUT/pytest_nvlink.log"
