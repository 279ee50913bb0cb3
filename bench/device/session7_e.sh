#!/usr/bin/env bash
# Session 7, last run: the graph test that hit EADDRINUSE (free_port fixed), then the full EP benchmark for
# BENCHMARKS.md (DeepSeek-V3 shape, comm SMs 8-32, both NVLink transports and the copy-engine transport).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rf "tests/test_ep_nvlink.py::test_nvlink_dispatch_combine_replay_in_a_cuda_graph" 2>&1 | tail -1
timeout 480 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 20 --chunks 4 --copy-shares 1.0 \
  2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -30
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
