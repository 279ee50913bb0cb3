#!/usr/bin/env bash
# Next session (2 H200): the copy stream's start without the reset in its path (session28_reset_beside.patch): the
# waits for the peers' words and their fenced resets on a second stream of the transport's own, the copy stream
# waiting only for an event after the waits, and for the resets before its first flag. Session 27 measured, at 20
# SMs started together, BF16 dispatch 189.4 / 189.6 us with wait + reset (main) against 180.2 / 180.4 with the wait
# alone and 176.5 / 177.9 with neither (both unsafe; ep_copy_start_*_session27.log). Main against the patch,
# alternating, then (patch applied) every nvlink GPU test.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=bench/device/session28_reset_beside.patch
for state in main beside main beside main beside; do
  if [ $state = beside ]; then patch -s -p1 < $P; fi
  log="$OUT/ep_reset_beside_${state}_$SECONDS.log"
  timeout -s KILL 100 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 --copy-shares 1.0 \
    --concurrent-sms --combine-weights > "$log" 2>&1
  echo "$state rc $? $(grep -o 'together: .*' "$log" | grep -o 'dispatch_[a-z0-9_]* [0-9.]*\|combine[a-z_]* [0-9.]*' | tr '\n' ' ')"
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
  if [ $state = beside ]; then patch -s -R -p1 < $P; fi
done
patch -s -p1 < $P
timeout -s KILL 380 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  > "$OUT/pytest_reset_beside_session28.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_reset_beside_session28.log"
