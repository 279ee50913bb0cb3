#!/usr/bin/env bash
# Main after session 29's merges (the combine's overflow check in the last program): nvlink_copy_engine at 20 and 32
# SMs, median of 50, with top-k weights and the concurrent GEMM at 20; then 8 tokens a step at 32 and 20 SMs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 200 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 32 --reps 50 --copy-shares 1.0 \
  --concurrent-sms 20 --combine-weights > "$OUT/ep_main_session29.log" 2>&1
echo "ep main rc $?"; grep -E "CUDA graph|GEMM|slowdown" "$OUT/ep_main_session29.log" | cut -c1-400
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
timeout -s KILL 120 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 32 20 --reps 50 --copy-shares 1.0 \
  --concurrent-sms --combine-weights --quantize-step 8 8 > "$OUT/ep_main_step8_session29.log" 2>&1
echo "ep step 8 rc $?"; grep "CUDA graph" "$OUT/ep_main_step8_session29.log" | cut -c1-400
