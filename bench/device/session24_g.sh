#!/usr/bin/env bash
# Session 24 (2 H200), wip/next-lease with the 16-byte FP8 stores reverted: ep.py with the pushed FP8 rows at 16 / 20 /
# 24 / 32 SMs (the timeline had 24 slower than 20), then the GPU tests: every file but the nvlink one, and the nvlink
# tests session24_d.sh did not run.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 170 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 16 20 24 32 --reps 30 \
  --copy-shares 1.0 --quantized-rows-by sm --concurrent-sms > "$OUT/ep_fp8_push_sms_session24.log" 2>&1
echo "ep rc $?"; grep -E "graph, P=|Error" "$OUT/ep_fp8_push_sms_session24.log" | cut -c1-520; reap
PYTHONPATH=src timeout -s KILL 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests --ignore=tests/test_ep_nvlink.py \
  > "$OUT/pytest_rest_session24.log" 2>&1
echo "rest rc $?"; tail -2 "$OUT/pytest_rest_session24.log"; reap
PYTHONPATH=src timeout -s KILL 220 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "not (match_reference_on_two or cached_dispatches_in_a_row or replay_in_a_cuda_graph)" \
  > "$OUT/pytest_nvlink_rest_session24.log" 2>&1
echo "nvlink rc $?"; grep -E "passed|failed" "$OUT/pytest_nvlink_rest_session24.log" | tail -3; reap
