#!/usr/bin/env bash
# Next session, on wip/start-together2 (not yet run): one call started together, timed on the GPU clock from a
# device-side barrier captured in the graph to a stamp after the call; the combine's timeline with the barrier in
# the graph (its observer then starts as the ranks meet: the flags should land at about the same time on both).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
timeout -s KILL 60 python3 bench/combine_timeline.py --comm-sms 20 --start-together 2>&1 | clean \
  | tee "$OUT/combine_timeline_in_graph_barrier_session17.log"
timeout -s KILL 200 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 --reps 50 --copy-shares 1.0 \
  --concurrent-sms 2>&1 | clean | tee "$OUT/ep_start_together_session17.log"
