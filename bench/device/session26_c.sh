#!/usr/bin/env bash
# Next session (2 H200), main with bench/device/session26_c.patch applied first (session 25's wip/vector-sum, made on
# the CPU and never run on a GPU; the branch does not outlive the session, the patch does): the combine's sum in
# explicit 16-byte vectors (`NvlinkTransport.combine_vector_sum`: this rank's rows ld.global.nc, the returned rows
# ld.global.cg, both with a 256-byte L2 prefetch; session 13 measured this sum alone at 92.9 us on 20 programs
# against the combine's 110.7, but under the older combine design it did not help). The combine is sum-bound from its
# second chunk (session 25's model: 123 + 0.6 x 126 us), so a faster sum should end it earlier. GPU reference test
# with it in every other case first, then ep.py at 20 SMs: main's sum, vector sums of 4 and 8 tokens a step, both
# orders.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
patch -p1 --forward < bench/device/session26_c.patch > "$OUT/patch_session26_c.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_session26_c.log"; exit 1; }
timeout -s KILL 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "match_reference_on_two" > "$OUT/pytest_vector_sum_session26.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed|Error" "$OUT/pytest_vector_sum_session26.log" | tail -5; reap
for order in "0 4 8" "8 4 0"; do
  tag=${order// /_}
  timeout -s KILL 150 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 \
    --copy-shares 1.0 --concurrent-sms --combine-vector-sum $order > "$OUT/ep_vector_sum_${tag}_session26.log" 2>&1
  echo "ep $order rc $?"; grep -E "graph, P=" "$OUT/ep_vector_sum_${tag}_session26.log" | \
    grep -o "vector sum of [0-9] tokens a step in\|5 queued: .*combine [0-9.]* us; started together: .*combine [0-9.]*" | \
    sed 's/dispatch_[a-z0-9_]* [0-9.]*, //g'
  reap
done
