#!/usr/bin/env bash
# Session 25 (2 H200), main: the FP8 dispatch that quantizes (rows pushed by the kernel) at more comm SMs than 20 and
# with 8 tokens a step: plain pushes of its bytes take 98.9-104.8 us at 32 programs (nvlink_push_pull.py) against
# 110.0 at 20, while the dispatch measured 133-135 at 24 and 32 (session 24). Whatever it prints before the limit.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 120 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 32 40 28 24 --reps 20 \
  --copy-shares 1.0 --concurrent-sms > "$OUT/ep_fp8_sms_tb16_session25.log" 2>&1
echo "tb16 rc $?"; grep -E "graph, P=" "$OUT/ep_fp8_sms_tb16_session25.log" | grep -o "P=.*fp8 *[0-9.]* us\|started together.*" 
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
timeout -s KILL 80 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 40 32 --reps 20 --quantize-step 8 8 \
  --copy-shares 1.0 --concurrent-sms > "$OUT/ep_fp8_sms_tb8_session25.log" 2>&1
echo "tb8 rc $?"; grep -E "graph, P=" "$OUT/ep_fp8_sms_tb8_session25.log" | grep -o "P=.*fp8 *[0-9.]* us\|started together.*"
