#!/usr/bin/env bash
# Next session (2 H200), the combine's last microseconds (200 us target: 200.1 started together in session 28's full
# run, 197.3-199.0 in its other runs). The tail after the last chunk's flag (17-19 us, session 23) is the sum of that
# chunk's tokens at the SMs' rate. (1) One GPU: is the sum faster with more bytes in flight? The sum in a
# software-pipelined loop (Triton's cp.async into shared memory, 1-3 steps ahead) against the 16-byte vector sum
# (`bench/combine_red.py --pipelined` from session29_combine_red_pipelined.patch, written in session 28, not run). (2) Chunk ends with a smaller last chunk
# (four chunks; session 23 priced five), started together, both orders.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
patch -p1 --forward < bench/device/session29_combine_red_pipelined.patch > "$OUT/patch_session29_b.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_session29_b.log"; exit 1; }
timeout -s KILL 150 python3 bench/combine_red.py --pipelined --programs 20 24 > "$OUT/combine_red_pipelined_session29.log" 2>&1
echo "combine_red rc $?"; grep "pipelined" "$OUT/combine_red_pipelined_session29.log"; cp bench/results/combine_red_pipelined.json "$OUT/" 2>/dev/null
for chunks in "0.4,0.7,0.9,1 0.45,0.75,0.93,1 0.5,0.8,0.95,1 0.42,0.72,0.92,1" "0.42,0.72,0.92,1 0.5,0.8,0.95,1 0.45,0.75,0.93,1 0.4,0.7,0.9,1"; do
  log="$OUT/ep_combine_chunk_ends_$SECONDS.log"
  timeout -s KILL 150 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 --copy-shares 1.0 \
    --concurrent-sms --combine-chunks $chunks > "$log" 2>&1
  echo "ep rc $?"; grep -o "chunks ([0-9., ]*)\|together: .*" "$log" | grep -o "chunks ([0-9., ]*)\|combine [0-9.]*" | paste - - 
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
done
