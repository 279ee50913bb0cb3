#!/usr/bin/env bash
# Second run of session 18 (after session18_b.sh): the pooled-copy-stream control with the test's guard assertion
# replaced by a print (session18_b.sh's control stopped at that guard, before any dispatch), and the three GPU test
# files with a longer limit (240 s was too short for them).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
t=tests/test_ep_nvlink.py::test_calls_on_any_pooled_stream_never_wait_for_their_own_copies
(cd variants/pooled && PYTHONPATH=src timeout -s KILL 150 python3 -m pytest -m gpu "$t" -q --tb=short -s) \
  > "$OUT/pooled_test_pooled_variant_no_guard.log" 2>&1
echo "pooled variant (guard removed) rc $? (expected to fail)"; grep -o "copy stream pooled.*\|EPTimeoutError.*" "$OUT/pooled_test_pooled_variant_no_guard.log" | head -4; reap
timeout -s KILL 440 python3 -m pytest -m gpu tests/test_ep_nvlink.py tests/test_ep_copy_engine.py tests/test_ep_errors.py \
  -q --tb=short > "$OUT/pytest_own_stream_session18.log" 2>&1
echo "tests rc $?"; tail -4 "$OUT/pytest_own_stream_session18.log"
