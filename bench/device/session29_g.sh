#!/usr/bin/env bash
# session29_f.sh: the unweighted nvlink_copy_engine combine at 20 SMs took 207.3-208.8 us started together on main
# against 198.1-200.2 with nvlink.py as of a1bcad0 (before the overflow guard); weighted 198.1-200.3 against
# 199.6-200.4. On the CPU (ptxas -v, 16 warps, TB 8) the guard took the unweighted copy-engine combine from 100 to 127
# registers; without the SHORT_SLOT check that program 0 makes before its SUMMED signals, 101.
# session29_short_check_last.patch moves that check after the signals, into the last program to finish (104 / 101
# registers; SM push 36 / 0 bytes of spills against 60 / 44). Overflow GPU tests with it, then A/B: main against
# the patch, three alternating runs each, both NVLink transports at 20 SMs with weights.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=bench/device/session29_short_check_last.patch
patch -p1 --no-backup-if-mismatch < $P > /dev/null || { echo "patch failed"; exit 1; }
timeout -s KILL 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py -k "overflow" \
  > "$OUT/pytest_short_check_last_session29.log" 2>&1
echo "pytest rc $?"; tail -2 "$OUT/pytest_short_check_last_session29.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
patch -p1 -R --no-backup-if-mismatch < $P > /dev/null || { echo "revert failed"; exit 1; }
run() {  # tag
  timeout -s KILL 120 python3 bench/ep.py --transports nvlink nvlink_copy_engine --comm-sms 20 --reps 30 \
    --copy-shares 1.0 --concurrent-sms --combine-weights > "$OUT/ep_short_check_$1_session29.log" 2>&1
  echo "ep $1 rc $?"
  grep "CUDA graph" "$OUT/ep_short_check_$1_session29.log" | sed 's/ share 1.0 chunks.*stage 4 FP8 rows by sm//; s/ in a CUDA graph.*combine \+\([0-9.]*\) us;.*queued:.*combine \([0-9.]*\), combine_weighted \([0-9.]*\) us; started together:.*combine \([0-9.]*\), combine_weighted \([0-9.]*\).*/ combine \1 queued \2 (weighted \3) together \4 (weighted \5)/' | cut -c1-200
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
}
for i in 1 2 3; do
  run main_$i
  patch -p1 --no-backup-if-mismatch < $P > /dev/null || { echo "patch failed"; exit 1; }
  run last_$i
  patch -p1 -R --no-backup-if-mismatch < $P > /dev/null || { echo "revert failed"; exit 1; }
done
