#!/usr/bin/env bash
# (Ran on branch wip/s15 at the time: main plus the review mends, the start-together timing and, from _c on, the dispatch gate.)
# Session 15, second lease (2 H200): the dispatch gate (a cached dispatch writes into a peer only once the peer has
# started it; session15_b's failure: test_buffer_nvlink_copy_engine_replays_cached_calls_in_a_cuda_graph, "round 3:
# output 0 differs"). The new test on main's kernels (variants/main: expected to fail) and on the tree, the nvlink
# GPU tests on the tree, then the started-together timing with a 300 us hold, and the combine's timeline with it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
for v in main tree; do
  root=.; [ $v = main ] && root=variants/main
  echo "== cached dispatches in a row on $v's kernels"
  PYTHONPATH=$root/src timeout 100 python3 -m pytest -m gpu tests/test_ep_nvlink.py -q --tb=line \
    -k test_cached_dispatches_in_a_row 2>&1 | grep -i "passed\|failed\|Error:\|received other" | head -8
done 2>&1 | tee "$OUT/cached_dispatches_test_session15.log"
echo "== the nvlink GPU tests on the tree"
PYTHONPATH=src timeout 300 python3 -m pytest -m gpu tests/test_ep_nvlink.py -q --tb=line \
  -k "not test_cached_dispatches_in_a_row" 2>&1 | grep -i "passed\|failed\|Error:" | head -10 \
  | tee "$OUT/pytest_nvlink_gate_session15.log"
export PYTHONPATH=src
timeout 100 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 --reps 50 --copy-shares 1.0 \
  --concurrent-sms 2>&1 | clean | tee "$OUT/ep_start_together_hold_session15.log"
timeout 50 python3 bench/combine_timeline.py --comm-sms 20 --start-together 2>&1 | clean \
  | tee "$OUT/combine_timeline_start_together_hold_session15.log"
