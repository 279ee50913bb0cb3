#!/usr/bin/env bash
# Next session (2 H200), wip/filler-range: a dispatch's hole fillers were found by loading (and with FP8 quantizing)
# every token from the first filler on (with copy_share < 1 most tokens, twice); now only the tokens up to the last
# filler. ep.py at 20 SMs: copy shares 1.0 / 0.5 / 0.3 with FP8 staged in 1 or 2 launches and pushed (share < 1 with
# staging: the copy engines move the staged prefix while the last launch pushes the rest); then the GPU tests of
# dispatches with copied prefixes.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
# BF16 with part of each peer's rows pushed by the SMs beside the copy (its hole fill loaded the rest twice before)
PYTHONPATH=src timeout -s KILL 200 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 \
  --copy-shares 1.0 0.9 0.8 0.7 --quantized-rows-by sm --concurrent-sms > "$OUT/ep_filler_range_bf16_session24.log" 2>&1
echo "ep bf16 rc $?"; grep -E "graph, P=|Error" "$OUT/ep_filler_range_bf16_session24.log" | cut -c1-420; reap
# FP8 staged for part of the rows (copy engines) while the last launch pushes the rest
PYTHONPATH=src timeout -s KILL 200 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 \
  --copy-shares 0.5 0.3 --stage-chunks 1 2 --quantized-rows-by copy_engine --concurrent-sms \
  > "$OUT/ep_filler_range_fp8_session24.log" 2>&1
echo "ep fp8 rc $?"; grep -E "graph, P=|Error" "$OUT/ep_filler_range_fp8_session24.log" | cut -c1-420; reap
PYTHONPATH=src timeout -s KILL 250 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "match_reference_on_two or cached_dispatches_in_a_row or replay_in_a_cuda_graph" \
  > "$OUT/pytest_filler_range_session24.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed" "$OUT/pytest_filler_range_session24.log" | tail -3; reap
