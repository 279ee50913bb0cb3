#!/usr/bin/env bash
# Session 6, run B: the nvlink GPU tests again (graph test: clones of every received tensor), then the whole GPU suite.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 | grep -v -i "warn\|symm_mem" > "$OUT/pytest_gpu.log"
tail -5 "$OUT/pytest_gpu.log"
# where the time of the staged FP8 dispatch and of the prefix-copy BF16 dispatch goes (one graph replay, 20 SMs)
for fp8 in --fp8 ""; do
  timeout 120 python3 bench/ep_profile.py --transport nvlink_copy_engine --sms 20 $fp8 --graph --out "$OUT/prof$fp8" 2>&1 \
    | grep -v -i "warn\|symm_mem" > "$OUT/ep_profile_graph$fp8.log"
  grep -c stream "$OUT/ep_profile_graph$fp8.log"
done
