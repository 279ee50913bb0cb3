#!/usr/bin/env bash
# Session 8, fifth run: the combine's tokens per step and warps with the packed sum (replayed, 5 queued per event
# pair, 20 SMs, nvlink_copy_engine), then the whole GPU test suite on the combine guard.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
timeout 100 python3 bench/ep_steps.py --kernels combine --steps 2 4 8 --warps 8 16 32 --comm-sms 20 --queued 5 2>&1 \
  | clean > "$OUT/ep_steps_combine.log"; grep "P=" "$OUT/ep_steps_combine.log"
cp bench/results/ep_steps.json "$OUT/ep_steps_combine.json" 2>/dev/null
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider -rf 2>&1 | clean > "$OUT/pytest_all.log"; tail -6 "$OUT/pytest_all.log"
