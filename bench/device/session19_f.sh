#!/usr/bin/env bash
# Session 19 (2 H200), wip/header-stream: a Buffer call waits for this rank's previous transport kernels (an event)
# instead of the whole stream, and exchanges its header on a stream of its own. (1) the new test (a combine called
# while a 0.5 s sleep queued after its dispatch runs must return before the sleep ends) on the branch, then on main
# (variants/main) as the control: expected to fail there; (2) the Buffer GPU tests on the branch; (3)
# bench/ep_buffer.py on main and the branch.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
t="tests/test_ep_nvlink.py::test_a_buffer_combine_does_not_wait_for_work_queued_after_its_dispatch"
PYTHONPATH=src timeout -s KILL 120 python3 -m pytest -q -m gpu -p no:cacheprovider "$t" > "$OUT/runs_ahead_branch_session19.log" 2>&1
echo "branch rc $?"; tail -3 "$OUT/runs_ahead_branch_session19.log" | cut -c1-300; reap
PYTHONPATH=variants/main/src timeout -s KILL 120 python3 -m pytest -q -m gpu -p no:cacheprovider "$t" > "$OUT/runs_ahead_main_session19.log" 2>&1
echo "main (control) rc $? (expected to fail)"; grep -o "AssertionError: rank.*" "$OUT/runs_ahead_main_session19.log" | head -2 | cut -c1-200; reap
PYTHONPATH=src timeout -s KILL 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_dispatch.py \
  tests/test_ep_nvlink.py tests/test_ep_copy_engine.py tests/test_moe.py -k "nccl or buffer or moe" \
  > "$OUT/pytest_header_stream_session19.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_header_stream_session19.log" | cut -c1-300; reap
for v in main branch; do
  src=src; [ $v = main ] && src=variants/main/src
  PYTHONPATH=$src timeout -s KILL 120 python3 bench/ep_buffer.py --comm-sms 20 --profile-top 15 > "$OUT/ep_buffer_hs_${v}_session19.log" 2>&1
  echo "$v ep_buffer rc $?"; cp bench/results/ep_buffer.json "$OUT/ep_buffer_hs_${v}_session19.json"
  grep " P=20: " "$OUT/ep_buffer_hs_${v}_session19.log" | cut -c1-420; reap
done
