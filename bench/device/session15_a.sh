#!/usr/bin/env bash
# (Ran on branch wip/s15 at the time: main plus the review mends, the start-together timing and, from _c on, the dispatch gate.)
# Session 15, first lease (2 H200), call 1: the started-together timing (a device-side barrier before each timed
# call, bench/start_together.py) on nvlink_copy_engine at 20 and 24 SMs; the combine's timeline started together;
# the review mends' benches (sum_beside_copy on call_times_ms, ep_steps on the shared setup).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
echo "== ep.py started together"
timeout 150 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 --reps 50 --copy-shares 1.0 \
  --concurrent-sms 2>&1 | clean | tee "$OUT/ep_start_together_session15.log"
echo "== combine timeline, started together and not"
timeout 80 python3 bench/combine_timeline.py --comm-sms 20 --start-together 2>&1 | clean \
  | tee "$OUT/combine_timeline_start_together_session15.log"
cp bench/results/combine_timeline.json "$OUT/combine_timeline_start_together.json" 2>/dev/null
timeout 60 python3 bench/combine_timeline.py --comm-sms 20 2>&1 | clean | tail -3
echo "== sum beside copy, ep_steps"
timeout 60 python3 bench/sum_beside_copy.py --programs 20 2>&1 | clean
timeout 60 python3 bench/ep_steps.py --steps 8 --kernels combine 2>&1 | clean
