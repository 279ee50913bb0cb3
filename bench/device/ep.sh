#!/usr/bin/env bash
# One device call on 2 GPUs: EP GPU tests, the EP benchmark, then the sm_split benchmark on GPU 0.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi topo -m > "$OUT/topo.log" 2>&1
timeout 240 python3 -m pytest -q -m gpu tests/test_ep_nvlink.py tests/test_fp8.py tests/test_ep_dispatch.py tests/test_ep_autograd.py tests/test_ep_errors.py tests/test_ep_layout.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_ep.log" | tail -40
if [ "${SKIP_EP_BENCH:-0}" = 0 ]; then timeout 240 python3 bench/ep.py 2>&1 | tee "$OUT/ep.log" | tail -30; fi
if [ "${RUN_SM_SPLIT:-0}" = 1 ]; then timeout 200 python3 bench/sm_split.py 2>&1 | tee "$OUT/sm_split.log"; fi
tar czf "$OUT/results.tgz" bench/results bench/figures 2>/dev/null
