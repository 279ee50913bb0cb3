#!/usr/bin/env bash
# Session 31 (2 H200): (1) main's Buffer fallback fix: the nvlink and nvlink_copy_engine Buffer tests, now also
# combining fp32 rows and running the weights-only backward passes through the reference transport on a device
# layout (tests/test_ep_nvlink.py::_buffer_worker); (2) the copy-engine transport's watchdog of the peers' ready flags
# (session31_watchdog.patch: ready_watch_kernel after pack_kernel): its one-GPU tests passed
# (pytest_ready_watch_*_session31.log); here the two-GPU copy-engine tests with it, and its cost on the copy-engine
# dispatch (bench/ep.py, main against the patch, alternating).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=bench/device/session31_watchdog.patch
timeout -s KILL 200 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_ep_nvlink.py -k "buffer_nvlink" \
  > "$OUT/pytest_buffer_fallback_session31.log" 2>&1
echo "buffer tests rc $?"; tail -6 "$OUT/pytest_buffer_fallback_session31.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
for state in main watchdog main watchdog; do
  if [ $state = watchdog ]; then patch -s --no-backup-if-mismatch -p1 < $P; fi
  log="$OUT/ep_watchdog_${state}_$SECONDS.log"
  timeout -s KILL 90 python3 bench/ep.py --transports copy_engine --comm-sms 20 --reps 20 --concurrent-sms > "$log" 2>&1
  echo "$state rc $? $(grep -o 'P=20.*' "$log" | head -2 | tr '\n' ' ' | cut -c1-300)"
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
  if [ $state = watchdog ]; then patch -s -R -p1 < $P; fi
done
patch -s --no-backup-if-mismatch -p1 < $P
timeout -s KILL 240 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_ep_copy_engine.py \
  > "$OUT/pytest_copy_engine_watchdog_session31.log" 2>&1
echo "copy-engine tests rc $?"; tail -12 "$OUT/pytest_copy_engine_watchdog_session31.log"
