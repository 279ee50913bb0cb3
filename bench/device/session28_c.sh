#!/usr/bin/env bash
# Session 28 (2 H200): a review's gap (session 27): with num_worst_tokens too small for a graph replay's real
# receive (status code 4, an error the host raises), the combine kernel read rows of y past the caller's rows, and the
# ranks whose tokens lay past them summed stale rows without an error. session28_overflow_clamp.patch: the push loop
# clamps each source's rows to y's, a rank whose receive overflowed sums nothing and sets a word (SHORT_SLOT) on each
# source of a row past y's, whose combine records status 10 (a ValueError naming the overflowing rank); ptxas on the
# CPU: no spills, 127/126 registers at 8 tokens a step (against 101 with weights). Main against the patch,
# alternating, then (patch applied) every nvlink GPU test, among them the new overflow replay test.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=bench/device/session28_overflow_clamp.patch
for state in main clamp main clamp; do
  if [ $state = clamp ]; then patch -s -p1 < $P; fi
  log="$OUT/ep_overflow_clamp_${state}_$SECONDS.log"
  timeout -s KILL 100 python3 bench/ep.py --transports nvlink nvlink_copy_engine --comm-sms 20 --reps 30 \
    --copy-shares 1.0 --concurrent-sms --combine-weights > "$log" 2>&1
  echo "$state rc $? $(grep -o '^nvlink[a-z_]* \|together: .*' "$log" | grep -o '^nvlink[a-z_]*\|combine[a-z_]* [0-9.]*' | tr '\n' ' ')"
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
  if [ $state = clamp ]; then patch -s -R -p1 < $P; fi
done
patch -s -p1 < $P
timeout -s KILL 380 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  > "$OUT/pytest_overflow_clamp_session28.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_overflow_clamp_session28.log"
