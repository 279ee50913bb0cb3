#!/usr/bin/env bash
# (Ran on branch wip/s15 at the time: main plus the review mends, the start-together timing and, from _c on, the dispatch gate.)
# Session 15, first lease (2 H200), call 2: the nvlink GPU tests and the trace tests after the review mends.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 40 python3 -m pytest -m gpu tests/test_trace.py -q --tb=short 2>&1 | grep -v -i warn | tail -15 \
  | tee "$OUT/pytest_trace_session15.log"
timeout 330 python3 -m pytest -m gpu tests/test_ep_nvlink.py -q --tb=line 2>&1 | grep -i "passed\|failed\|Error:" \
  | head -10 | tee "$OUT/pytest_nvlink_session15.log"
