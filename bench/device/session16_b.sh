#!/usr/bin/env bash
# Session 16, second lease (2 H200), on wip/two-areas: two receive areas that consecutive dispatches alternate
# between. The nvlink GPU tests (the cached-dispatches test now also replays a one-dispatch graph back to back),
# the copy-engine FP8 case with CUDA_DEVICE_MAX_CONNECTIONS=1, then bench/ep.py at 20 and 24 SMs for this branch and
# for main's kernels (variants/gate: one receive area) in the same lease, then the rest of the GPU suite.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; pkill -9 -f "bench/ep[.]py" 2>/dev/null; sleep 1; }
timeout -s KILL 330 python3 -m pytest -m gpu tests/test_ep_nvlink.py -q --tb=short 2>&1 | clean | tail -30 \
  | tee "$OUT/pytest_nvlink_two_areas_session16.log"; reap
CUDA_DEVICE_MAX_CONNECTIONS=1 timeout -s KILL 60 python3 -m pytest -m gpu -q --tb=short \
  "tests/test_ep_nvlink.py::test_cached_dispatches_in_a_row_wait_for_each_peer_to_read_the_last[copy_engine-True]" \
  2>&1 | clean | tail -5 | tee "$OUT/two_areas_one_connection_session16.log"; reap
for v in two_areas gate two_areas gate; do
  echo "== $v"
  if [ $v = gate ]; then (cd variants/gate && PYTHONPATH=src timeout -s KILL 150 python3 bench/ep.py \
      --transports nvlink_copy_engine --comm-sms 20 24 --reps 50 --copy-shares 1.0 2>&1 | clean)
  else timeout -s KILL 150 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 --reps 50 \
      --copy-shares 1.0 2>&1 | clean; cp bench/results/ep.json "$OUT/ep_two_areas.json"; fi
  reap
done 2>&1 | tee "$OUT/ep_two_areas_vs_gate_session16.log"
timeout -s KILL 150 python3 -m pytest -m gpu tests --ignore=tests/test_ep_nvlink.py -q --tb=short 2>&1 | clean \
  | tail -15 | tee "$OUT/pytest_rest_two_areas_session16.log"
