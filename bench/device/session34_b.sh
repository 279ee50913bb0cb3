#!/usr/bin/env bash
# Session 34 (one H200): an uncached nvlink dispatch without its host read of the count exchange and with the
# handle's rank_prefix_matrix made on the device (branch) against main, phase probe alternating, two rounds; then the
# rounds worker and session 32's Buffer workers at one rank, and the one-GPU suite, on the branch. Logs in one tar.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
for r in 1 2; do
  for v in main branch; do
    src=src; [ $v = main ] && src=variants/main/src
    PYTHONPATH=$src timeout -s KILL 60 python3 bench/device/session34_uncached_phases.py --backends nvlink \
      > "$L/uncached_phases_${v}_r${r}.log" 2>&1
    echo "$v r$r rc $?"; grep "uncached dispatch" "$L/uncached_phases_${v}_r${r}.log" | cut -c1-190
  done
done
export PYTHONPATH=src
timeout -s KILL 120 python3 bench/device/session34_world1.py > "$L/world1_rounds_b.log" 2>&1
echo "rounds rc $?"; grep -E "PASSED|FAILED|passed" "$L/world1_rounds_b.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
timeout -s KILL 120 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests > "$L/pytest_one_gpu_b.log" 2>&1
echo "one-GPU suite rc $?"; grep -E "FAILED|Error" "$L/pytest_one_gpu_b.log" | head; tail -n 1 "$L/pytest_one_gpu_b.log"
tar -C "$L" -cf "$OUT/session34_b_logs.tar" .
timeout -s KILL 230 python3 bench/device/session32_world1.py > "$L/world1_tests_b.log" 2>&1
echo "world1 rc $?"; grep -E "FAILED|passed" "$L/world1_tests_b.log" | cut -c1-200
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
tar -C "$L" -cf "$OUT/session34_b_logs.tar" .
true
