#!/usr/bin/env bash
# Session 28 (2 H200). (1) The SM-push combine (`nvlink`) at 4 tokens a step against the default 8 with 2 ranks:
# ptxas on the CPU spills 60 / 44 bytes (without / with weights) at 8 tokens, none at 4 (101 registers).
# (2) Why a GEMM beside nvlink_copy_engine's comm loses 4.1-6.6% (session28_d.sh) while its absolute time with comm
# (1.866-1.871 ms) matches session 26's (1.856, then +3.2%): a soak of 1500 GEMMs alone and with comm, per transport,
# with nvidia-smi sampling SM clock, power and the clock-event reasons every 100 ms (read only).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for tb in 4 8 4 8; do
  log="$OUT/ep_sm_combine_tb${tb}_$SECONDS.log"
  timeout -s KILL 100 python3 bench/ep.py --transports nvlink --comm-sms 20 --reps 30 --copy-shares 1.0 \
    --concurrent-sms --combine-weights --combine-tokens-per-step $tb > "$log" 2>&1
  echo "TB $tb rc $? $(grep -o 'together: .*' "$log" | grep -o 'combine[a-z_]* [0-9.]*' | tr '\n' ' ')"
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
done
Q=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active
nvidia-smi --query-gpu=$Q --format=csv -lms 100 > "$OUT/smi.csv" 2> "$OUT/smi.err" &
SMI=$!; sleep 2
if ! kill -0 $SMI 2>/dev/null; then  # an older name for the reasons
  nvidia-smi --query-gpu=${Q/clocks_event_reasons/clocks_throttle_reasons} --format=csv -lms 100 > "$OUT/smi.csv" 2>> "$OUT/smi.err" &
  SMI=$!; sleep 2
fi
timeout -s KILL 300 python3 bench/ep.py --transports nvlink nvlink_copy_engine copy_engine --comm-sms 20 --reps 5 \
  --copy-shares 1.0 --concurrent-sms 20 --concurrent-rounds 4 --soak-gemms 1500 > "$OUT/ep_soak_session28.log" 2>&1
echo "soak rc $?"; sleep 1; kill $SMI
grep "concurrent\|soak" "$OUT/ep_soak_session28.log" | cut -c1-400
wc -l "$OUT/smi.csv"; head -3 "$OUT/smi.csv"; cat "$OUT/smi.err"
