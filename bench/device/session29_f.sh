#!/usr/bin/env bash
# The nvlink_copy_engine combine at 20 SMs took 205.9-210.7 us (started together 206.8-214.3) in every ep.py run of
# this session's lease, against 197.4-198.7 started together in session 28's A/B (session28_c.sh) that found the
# overflow guard (db56fab, aced3de) free for it. A/B in one lease: main against nvlink.py as of a1bcad0 (before the
# guard; session29_nvlink_at_a1bcad0.patch), three alternating runs each with session28_c.sh's ep.py arguments less
# the SM-push transport; then main with the SM-push transport first as in session28_c.sh.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=bench/device/session29_nvlink_at_a1bcad0.patch
run() {  # tag, transports...
  local tag=$1; shift
  timeout -s KILL 120 python3 bench/ep.py --transports "$@" --comm-sms 20 --reps 30 --copy-shares 1.0 \
    --concurrent-sms --combine-weights > "$OUT/ep_combine_ab_${tag}_session29.log" 2>&1
  echo "ep $tag rc $?"
  grep "CUDA graph" "$OUT/ep_combine_ab_${tag}_session29.log" | sed 's/ in a CUDA graph.*combine \+\([0-9.]*\) us;.*queued:.*combine \([0-9.]*\), combine_weighted \([0-9.]*\) us; started together:.*combine \([0-9.]*\), combine_weighted \([0-9.]*\).*/ combine \1 queued \2 (weighted \3) together \4 (weighted \5)/' | cut -c1-200
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
}
for i in 1 2 3; do
  run main_$i nvlink_copy_engine
  patch -p1 --no-backup-if-mismatch < $P > /dev/null || { echo "patch failed"; exit 1; }
  run a1bcad0_$i nvlink_copy_engine
  patch -p1 -R --no-backup-if-mismatch < $P > /dev/null || { echo "revert failed"; exit 1; }
done
run main_sm_first nvlink nvlink_copy_engine
