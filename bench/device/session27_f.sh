#!/usr/bin/env bash
# Session 27 (2 H200), measurement only (session27_skip_wait.patch applied in the tree): what the copy stream's
# start costs a dispatch/combine -- the stream memory operations that wait for each peer's "free" word
# (SMSPLIT_SKIP_COPY_WAIT=1 leaves them out: unsafe in general, safe here where every timed call starts after a
# barrier) -- alternating, 20 and 22 SMs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for run in 1 2 3 4 5 6; do
  skip=$((run % 2))
  log="$OUT/ep_skip_wait${skip}_run${run}.log"
  SMSPLIT_SKIP_COPY_WAIT=$skip timeout -s KILL 120 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 22 \
    --reps 30 --copy-shares 1.0 --concurrent-sms > "$log" 2>&1
  echo "skip $skip rc $? $(grep -o 'P=[ 0-9]*: dispatch\|together: .*' "$log" | grep -o 'P=[ 0-9]*\|dispatch_bf16 [0-9.]*\|dispatch_fp8 [0-9.]*\|combine [0-9.]*' | tr '\n' ' ')"
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
done
