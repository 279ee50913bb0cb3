#!/usr/bin/env bash
# (Runs on branch wip/sum-prefetch; kept on main as the record of the run.)
# Session 25 (2 H200), wip/sum-prefetch: the combine's sum (two ranks) loads its next block of tokens before it adds
# and stores this one (4 tokens a step: 8 would spill), against the sum as on main (8 tokens a step). ep.py at 20 SMs,
# nvlink_copy_engine, off / on / off / on / on / off in separate processes; then the GPU tests that run combines with
# it on in every other case.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
for v in 0 1 0 1 1 0; do
  if [ $v = 1 ]; then opt="--combine-prefetch 1 --combine-tokens-per-step 4"; else opt=""; fi
  timeout -s KILL 80 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 --copy-shares 1.0 \
    --concurrent-sms $opt >> "$OUT/ep_sum_prefetch_${v}_session25.log" 2>&1
  echo "prefetch $v rc $?"; grep -E "graph, P=|Error" "$OUT/ep_sum_prefetch_${v}_session25.log" | tail -1 | cut -c1-600; reap
done
timeout -s KILL 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "match_reference_on_two" > "$OUT/pytest_sum_prefetch_session25.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed|Error" "$OUT/pytest_sum_prefetch_session25.log" | tail -5; reap
