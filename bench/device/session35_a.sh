#!/usr/bin/env bash
# For the first 2-GPU lease after session 35 (session 34's prefix patch merged in 6453d80, so session34_c.sh no longer
# applies): on main, the Buffer tests whose 2-rank run is owed: the rounds test (one Buffer through rounds of other
# shapes, compares rank_prefix_matrix with the reference), the Buffer graph tests (the captured rank_prefix_matrix),
# the copy-engine replays; the two-GPU fp8 test (the Triton quantizer on its tensors' device, session 35); then the
# rest of test_ep_nvlink.py's GPU tests. Logs in one tar file, made after each step.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
K="rounds or buffer_dispatch_and_combine_replay or copy_engine_replays"
timeout -s KILL 240 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_ep_nvlink.py -k "$K" \
  > "$L/pytest_owed_2gpu_session35.log" 2>&1
echo "owed 2-GPU tests rc $?"; grep -E "PASSED|FAILED|ERROR" "$L/pytest_owed_2gpu_session35.log" | cut -c1-160
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
tar -C "$L" -cf "$OUT/session35_a_logs.tar" .
timeout -s KILL 60 python3 -m pytest -v -p no:cacheprovider -m multigpu tests/test_fp8.py > "$L/pytest_fp8_multigpu_session35.log" 2>&1
echo "fp8 multigpu tests rc $?"; grep -E "PASSED|FAILED|ERROR" "$L/pytest_fp8_multigpu_session35.log" | cut -c1-160
timeout -s KILL 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ep_nvlink.py -k "not ($K)" \
  > "$L/pytest_nvlink_rest_2gpu_session35.log" 2>&1
echo "rest of test_ep_nvlink rc $?"; tail -n 2 "$L/pytest_nvlink_rest_2gpu_session35.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
tar -C "$L" -cf "$OUT/session35_a_logs.tar" .
true
