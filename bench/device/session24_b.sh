#!/usr/bin/env bash
# Next session (2 H200): the nvlink GPU test file on main in two parts (its whole takes longer than one call).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PART=${PART:-1}
if [ "$PART" = 1 ]; then K="match_reference_on_two or cached_dispatches_in_a_row or replay_in_a_cuda_graph or combines_in_a_row"
else K="not (match_reference_on_two or cached_dispatches_in_a_row or replay_in_a_cuda_graph or combines_in_a_row)"; fi
PYTHONPATH=src timeout -s KILL 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py -k "$K" --durations=0 \
  > "$OUT/pytest_nvlink_part${PART}_session24.log" 2>&1
echo "part $PART rc $?"; grep -E "passed|failed" "$OUT/pytest_nvlink_part${PART}_session24.log" | tail -3; reap
