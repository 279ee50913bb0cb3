#!/usr/bin/env bash
# Session 31: where the copy stream waits for the peers' start words (session31_copy_start.patch, switch
# SMSPLIT_COPY_START): "beside" (main: the waits and resets on the reset stream, the copy stream waiting for an
# event after the waits), "here" (the copy stream waits for the words itself and resets them with fenced writes
# after its first copies, before its first flag), "here_event" (the copy stream waits itself, records an event the
# reset stream's resets follow, and waits for them before its first flag). Session 27 put the wait alone on the copy
# stream at 180.2 / 180.4 us (BF16 dispatch, 20 SMs, started together; unsafe there: no reset) against 184.7-187.6
# with the reset stream (session 28). Alternating, two rounds.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=bench/device/session31_copy_start.patch
grep -q SMSPLIT_COPY_START src/smsplit/ep/nvlink.py || patch -s --no-backup-if-mismatch -p1 < $P
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv > "$OUT/smi_session31_a.csv"
for round in 1 2; do
  for mode in beside here here_event; do
    log="$OUT/ep_copy_start_${mode}_${round}_session31.log"
    SMSPLIT_COPY_START=$mode timeout -s KILL 85 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 \
      --reps 30 --copy-shares 1.0 --concurrent-sms --combine-weights > "$log" 2>&1
    echo "$mode $round rc $? ${SECONDS}s $(grep -o 'together: .*' "$log" | grep -o 'dispatch_[a-z0-9_]* [0-9.]*\|combine[a-z_]* [0-9.]*' | tr '\n' ' ')"
    pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
  done
done
