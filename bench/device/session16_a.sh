#!/usr/bin/env bash
# Next session, first lease (2 H200), on wip/dispatch-gate: whether a pending stream wait holds back a kernel queued
# after it on another stream (bench/stream_wait_block.py), then the dispatch gate with the staged path's copy-stream
# wait queued after its first launch. Each param of the cached-dispatches test alone (verbose, killed with its children on
# timeout so that no orphan holds the GPUs), then the whole nvlink GPU file, then nvlink_copy_engine at 20 and 24 SMs
# (the gate's cost against session 15's 183.9 / 153.7 / 212.9 us at 20).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
reap() { pkill -9 -f "multiprocessing.spawn" 2>/dev/null; pkill -9 -f "bench/ep.py" 2>/dev/null; sleep 1; }
for c in unset 1 8 32; do  # does a pending stream wait hold back a kernel queued after it on another stream?
  if [ $c = unset ]; then timeout -s KILL 30 python3 bench/stream_wait_block.py 2>&1 | clean | grep -v wrote
  else CUDA_DEVICE_MAX_CONNECTIONS=$c timeout -s KILL 30 python3 bench/stream_wait_block.py 2>&1 | clean | grep -v wrote; fi
done 2>&1 | tee "$OUT/stream_wait_block_session16.log"
for p in "sm-False" "sm-True" "copy_engine-False" "copy_engine-True"; do
  echo "== $p"; timeout -s KILL 90 python3 -m pytest -m gpu -q --tb=short \
    "tests/test_ep_nvlink.py::test_cached_dispatches_in_a_row_wait_for_each_peer_to_read_the_last[$p]" 2>&1 | clean \
    | tail -12; echo "rc ${PIPESTATUS[0]}"; reap
done 2>&1 | tee "$OUT/gate_params_session16.log"
timeout -s KILL 330 python3 -m pytest -m gpu tests/test_ep_nvlink.py -q --tb=line 2>&1 | clean \
  | grep -i "passed\|failed\|error" | head -12 | tee "$OUT/pytest_nvlink_gate_session16.log"; reap
timeout -s KILL 120 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 --reps 50 --copy-shares 1.0 \
  --concurrent-sms 2>&1 | clean | tee "$OUT/ep_gate_session16.log"
