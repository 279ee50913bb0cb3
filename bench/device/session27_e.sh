#!/usr/bin/env bash
# Session 27 (2 H200), main: combine chunks re-swept. Model (BENCHMARKS §2, session 27): the sum of a chunk's tokens
# (2 rows read, 1 written per token, on the comm SMs) runs only after the chunk lands, so with 0.4/0.7/0.9/1 the
# last 30% of the sum runs after the copies end; smaller early and late chunks should end it sooner, unless each
# chunk's flag costs more than it saves. Default against 6- and 8-chunk cuts, 20 and 24 SMs, both orders.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
A=0.4,0.7,0.9,1.0; B=0.15,0.35,0.55,0.75,0.9,1.0; C=0.2,0.35,0.5,0.65,0.8,0.9,0.96,1.0
D=0.25,0.5,0.7,0.85,0.95,1.0; E=0.1,0.25,0.4,0.55,0.7,0.82,0.92,1.0
for order in "$A $B $C $D $E" "$E $D $C $B $A"; do
  log="$OUT/ep_combine_chunks_session27_$SECONDS.log"
  timeout -s KILL 280 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 --reps 30 \
    --copy-shares 1.0 --concurrent-sms --combine-chunks $order > "$log" 2>&1
  echo "rc $?"; grep -o "chunks ([0-9., ]*)\|P=[ 0-9]*: dispatch\|together: .*" "$log" | grep -o "chunks .*\|P=[ 0-9]*\|combine [0-9.]*" | tr '\n' ' ' | sed 's/chunks/\nchunks/g'; echo
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
done
