#!/usr/bin/env bash
# Session 33 (2 H200; session 32's never-run _b script with the patch regenerated on main after FastLaunch): the copy-engine transport's watchdog of the peers' ready flags (session33_watchdog.patch,
# ready_watch_kernel after pack_kernel; its one-GPU tests passed in session 31): its cost on the copy-engine dispatch
# and combine (bench/ep.py, main against the patch, alternating), then the two-GPU copy-engine tests with it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=bench/device/session33_watchdog.patch
for state in main watchdog main watchdog; do
  if [ $state = watchdog ]; then patch -s --no-backup-if-mismatch -p1 < $P; fi
  log="$OUT/ep_watchdog_${state}_$SECONDS.log"
  timeout -s KILL 90 python3 bench/ep.py --transports copy_engine --comm-sms 20 --reps 20 --concurrent-sms > "$log" 2>&1
  echo "$state rc $? $(grep -o 'P=20.*' "$log" | head -2 | tr '\n' ' ' | cut -c1-300)"
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
  if [ $state = watchdog ]; then patch -s -R --no-backup-if-mismatch -p1 < $P; fi
done
patch -s --no-backup-if-mismatch -p1 < $P
timeout -s KILL 200 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_ep_copy_engine.py \
  > "$OUT/pytest_copy_engine_watchdog_session33.log" 2>&1
echo "copy-engine tests rc $?"; tail -12 "$OUT/pytest_copy_engine_watchdog_session33.log"
patch -s -R --no-backup-if-mismatch -p1 < $P
