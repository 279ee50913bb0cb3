#!/usr/bin/env bash
# Session 23 (2 H200): ep_timeline.py and combine_timeline.py after their replay loop moved to
# common.replays_one_at_a_time (no figure is expected to change).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTHONPATH=src timeout -s KILL 200 python3 bench/ep_timeline.py --comm-sms 20 --reps 30 > "$OUT/ep_timeline_helper_session23.log" 2>&1
echo "rc $?"; grep -E "^P=|Error|error" "$OUT/ep_timeline_helper_session23.log" | cut -c1-300
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
PYTHONPATH=src timeout -s KILL 200 python3 bench/combine_timeline.py --comm-sms 20 --combine-chunks 0.4,0.7,0.9,1 --start-together --reps 30 \
  > "$OUT/combine_timeline_helper_session23.log" 2>&1
echo "rc $?"; grep -E "^P=|Error|error" "$OUT/combine_timeline_helper_session23.log" | cut -c1-300
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; true
