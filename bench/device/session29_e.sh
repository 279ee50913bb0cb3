#!/usr/bin/env bash
# The FP8 dispatch that quantizes, tokens per step (quantize_tokens_per_step) against comm SMs. session29_d.sh:
# 8 tokens a step at 32 SMs 109.2 us started together against 124.0-126.1 at 16 (the default), but 141.8 at 20
# against 114.5: the best step may depend on the SMs. 4 / 8 / 16 tokens at 20-48 SMs, then 8 and 16 again.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
run() {  # tag, tokens per step
  timeout -s KILL 120 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 28 32 40 48 --reps 30 \
    --copy-shares 1.0 --concurrent-sms --quantize-step $2 8 > "$OUT/ep_fp8_step_$1_session29.log" 2>&1
  echo "ep $1 (step $2 8) rc $?"
  grep "CUDA graph" "$OUT/ep_fp8_step_$1_session29.log" | sed 's/.*stage 4 FP8 rows by sm//; s/ dispatch bf16 .*fp8 \+\([0-9.]*\) us (FP8 input \([0-9.]*\)).*round trip equal: \({[^}]*}\).*queued: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*together: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*/ fp8 \1 queued \4 together \5 (input \2) equal \3/' | cut -c1-200
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
}
run 16a 16
run 8a 8
run 4 4
run 8b 8
run 16b 16
