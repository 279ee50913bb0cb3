#!/usr/bin/env bash
# (Ran on branch wip/s15 at the time: main plus the review mends, the start-together timing and, from _c on, the dispatch gate.)
# Session 15, third lease (2 H200): session15_c's tree runs were cut by their timeouts (every kernel compiled anew on
# a fresh machine). The dispatch gate's tests on the tree: the new test and session15_b's failure first, then the
# rest of the nvlink GPU tests, then nvlink_copy_engine at 20 SMs (the gate's cost), as far as the time goes.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
timeout 200 python3 -m pytest -m gpu tests/test_ep_nvlink.py -q --tb=short -rA \
  -k "test_cached_dispatches_in_a_row or test_buffer_nvlink_copy_engine_replays_cached" 2>&1 | clean | tail -25 \
  | tee "$OUT/pytest_gate_first_session15.log"
timeout 280 python3 -m pytest -m gpu tests/test_ep_nvlink.py -q --tb=short \
  -k "not test_cached_dispatches_in_a_row and not test_buffer_nvlink_copy_engine_replays_cached" 2>&1 | clean \
  | tail -25 | tee "$OUT/pytest_gate_rest_session15.log"
timeout 100 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 --copy-shares 1.0 \
  --concurrent-sms 2>&1 | clean | tee "$OUT/ep_gate_session15.log"
