#!/usr/bin/env bash
# Next session (2 H200), on wip/own-stream: the copy streams made with cuStreamCreate instead of taken from torch's
# pool (session 17's intermittent timeout: a caller's pooled stream was the copy stream, and a cached dispatch on it
# waited for its own copies queued behind it). (1) The new regression test on the branch; (2) the same test with
# the copy stream taken from the pool again (variants/pooled, made here by make_variants_session18.sh): expected
# to fail with "dispatch: waiting for this rank's copies to land on rank ..."; (3) session 17's failing ep.py
# command on the branch (it also runs StartTogether.graph, now common.capture_graph); (4) the nvlink, copy-engine
# and error GPU tests on the branch.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
t=tests/test_ep_nvlink.py::test_calls_on_any_pooled_stream_never_wait_for_their_own_copies
timeout -s KILL 120 python3 -m pytest -m gpu "$t" -q --tb=short > "$OUT/pooled_test_branch.log" 2>&1
echo "branch rc $?"; tail -3 "$OUT/pooled_test_branch.log"; reap
(cd variants/pooled && PYTHONPATH=src timeout -s KILL 120 python3 -m pytest -m gpu "$t" -q --tb=short) \
  > "$OUT/pooled_test_pooled_variant.log" 2>&1
echo "pooled variant rc $? (expected to fail)"; grep -o "EPTimeoutError.*" "$OUT/pooled_test_pooled_variant.log" | head -3; reap
timeout -s KILL 200 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 8 16 32 --reps 20 --copy-shares 1.0 \
  --concurrent-sms --combine-chunks 0.5,0.8,1 0.4,0.7,0.9,1 > "$OUT/ep_own_stream_session18.log" 2>&1
echo "ep.py rc $?"; grep "graph, P=\|Error" "$OUT/ep_own_stream_session18.log" | cut -c1-330; reap
timeout -s KILL 240 python3 -m pytest -m gpu tests/test_ep_nvlink.py tests/test_ep_copy_engine.py tests/test_ep_errors.py \
  -q --tb=short -x > "$OUT/pytest_own_stream_session18.log" 2>&1
echo "tests rc $?"; tail -4 "$OUT/pytest_own_stream_session18.log"
