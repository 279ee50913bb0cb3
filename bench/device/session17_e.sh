#!/usr/bin/env bash
# Session 17 (2 H200), main after the review mends (bench/common end_worker / run_and_write, ep_profile's two step
# functions): each changed benchmark once, short (their result files stay on the device), full output to logs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
run() { echo "== $*"; timeout -s KILL 100 python3 "$@" 2>&1 | grep -v -i "warn\|symm_mem" | tail -8; echo "rc ${PIPESTATUS[0]}"; reap; }
{
run bench/combine_timeline.py --comm-sms 20 --reps 5 --start-together
run bench/sum_beside_copy.py --programs 20 --reps 5
run bench/ep_steps.py --comm-sms 20 --steps 8 --reps 5 --kernels combine
run bench/copy_chain.py --reps 5
run bench/nvlink_link.py --programs 20 --reps 5 --only-pieces --pieces 4
run bench/ep_profile.py --transport nvlink_copy_engine --sms 20 --graph --combine-only --out /tmp/prof
run bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 5 --copy-shares 1.0 --concurrent-sms
} > "$OUT/bench_review_session17.log" 2>&1
grep -v "^ *$" "$OUT/bench_review_session17.log" | tail -80
