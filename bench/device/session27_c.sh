#!/usr/bin/env bash
# Next session (2 H200), main: a combine that sums top-k weights (what a model passes; DeepEP's benchmark and ours
# time it without) compiles with 76 bytes of register spills at the default 8 tokens a step on 2 ranks (none without
# weights; ptxas -v, session 26). Combine with and without weights at 8 and 4 tokens a step, 20 SMs, both orders.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for tb in 8 4 4 8; do
  timeout -s KILL 120 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 --copy-shares 1.0 \
    --concurrent-sms --combine-weights --combine-tokens-per-step $tb > "$OUT/ep_combine_weights_tb${tb}_$SECONDS.log" 2>&1
  echo "tb $tb rc $? $(grep -o 'together: .*' "$(ls -t $OUT/ep_combine_weights_tb${tb}_*.log | head -1)" | grep -o 'combine[a-z_]* [0-9.]*' | tr '\n' ' ')"
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
done
