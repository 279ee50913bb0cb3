#!/usr/bin/env bash
# Next session (2 H200), wip/timeline-pushed: the pushed FP8 dispatch on the GPU clock (its first row's arrival and
# its kernel, no copy flag), and its quantize step swept (tokens x groups per step) at 20 SMs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 120 python3 bench/ep_timeline.py --comm-sms 20 24 --calls dispatch_fp8 dispatch_fp8_input \
  --reps 30 > "$OUT/ep_timeline_pushed_session24.log" 2>&1
echo "timeline rc $?"; grep -E "^P=|Error" "$OUT/ep_timeline_pushed_session24.log" | cut -c1-300; reap
for step in "16 8" "8 8" "32 8" "16 16"; do
  PYTHONPATH=src timeout -s KILL 90 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 \
    --copy-shares 1.0 --quantized-rows-by sm --quantize-step $step --concurrent-sms > /tmp/ep_run.log 2>&1
  echo "step $step rc $?"; cat /tmp/ep_run.log >> "$OUT/ep_fp8_push_steps_session24.log"
  grep -E "graph, P=|Error" /tmp/ep_run.log | grep -o "fp8 *[0-9.]* us\|dispatch_fp8 [0-9.]*" | tr '\n' ' '; echo; reap
done
