#!/usr/bin/env bash
# For the first 2-GPU lease after session 33: eager Buffer calls at two ranks after FastLaunch and the host-path trims
# (bench/ep_buffer.py: one call at a time and 10 queued, as DeepEP's benchmark times them; DeepEP's eager figures at 20
# SMs: BF16 dispatch 404 us, combine 442, FP8 input 285), twice; then the Buffer GPU tests at two ranks
# (session32_a.sh, its own device call since session 34: together they could pass a call's 600 s). Logs in one tar
# file, made after each round.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
for r in 1 2; do
  timeout -s KILL 200 python3 bench/ep_buffer.py --backends reference nvlink nvlink_copy_engine --comm-sms 20 \
    > "$L/ep_buffer_j${r}.log" 2>&1
  echo "ep_buffer round $r rc $?"; grep "P=20" "$L/ep_buffer_j${r}.log" | cut -c1-700
  cp bench/results/ep_buffer.json "$L/ep_buffer_j${r}.json" 2>/dev/null
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
  tar -C "$L" -cf "$OUT/session33_j_logs.tar" .
done
true
