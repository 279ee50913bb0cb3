#!/usr/bin/env bash
# Session 27 (2 H200): the combine kernel's push phase per source (only the rows past the copies; the top-k weights
# as one flat range per source) and the weights summed in a pass of their own (no register spills) -- the working
# tree -- against main (session27_combine_push.patch reversed), with and without weights, 20 SMs, alternating.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=bench/device/session27_combine_push.patch
state=new
for run in 1 2 3 4 5 6; do
  timeout -s KILL 150 python3 bench/ep.py --transports nvlink nvlink_copy_engine --comm-sms 20 --reps 30 \
    --copy-shares 1.0 --concurrent-sms --combine-weights > "$OUT/ep_combine_${state}_run${run}.log" 2>&1
  echo "$state run $run rc $?"; grep -o "together: .*" "$OUT/ep_combine_${state}_run${run}.log" | grep -o "combine[a-z_]* [0-9.]*" | tr "\n" " "; echo
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
  if [ $state = new ]; then (patch -s -R -p1 < $P || git apply -R $P) && state=main; else (patch -s -p1 < $P || git apply $P) && state=new; fi
done
