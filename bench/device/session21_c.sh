#!/usr/bin/env bash
# Session 21 (2 H200), wip/kernel-bump: a bulk="copy_engine" dispatch's copy-done counter bumped by its first
# launch (program 0, before its X_FREE signals; the copy stream also waits for this rank's own X_FREE word) instead
# of a one-thread kernel queued on the copy stream after the chain's last flag. (1) the nvlink GPU tests with copy
# engines and the Buffer's nvlink_copy_engine tests on the branch; (2) ep.py replayed, nvlink_copy_engine at 20
# SMs, main (variants/main, make_variants_session21.sh) and the branch alternating (main, branch, branch, main).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 260 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "copy_engine or match_reference or pooled_stream or chunk_lands" --durations=0 > "$OUT/pytest_kernel_bump_session21.log" 2>&1
echo "pytest rc $?"; grep -E "passed|failed|Error" "$OUT/pytest_kernel_bump_session21.log" | tail -3 | cut -c1-300; reap
for v in main branch branch main; do
  src=src; [ $v = main ] && src=variants/main/src
  PYTHONPATH=$src timeout -s KILL 80 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 \
    --reps 30 --copy-shares 1.0 --concurrent-sms > /tmp/ep_run.log 2>&1
  echo "$v rc $?"; cat /tmp/ep_run.log >> "$OUT/ep_kernel_bump_${v}_session21.log"
  grep "graph, P=\|Error" /tmp/ep_run.log | cut -c1-400; reap
done
