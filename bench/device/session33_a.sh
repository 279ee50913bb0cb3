#!/usr/bin/env bash
# Session 33 (one H200): the host time of eager cached Buffer calls by function (cProfile) and the primitives' costs;
# FastLaunch (smsplit.launch) against Triton's JIT launch, alternating (SMSPLIT_FAST_LAUNCH=0 / 1), two rounds of
# session 32's host probe; the one-GPU suite and the Buffer workers at one rank with FastLaunch.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv > "$OUT/gpu_session33_a.txt" 2>&1
timeout -s KILL 120 python3 bench/device/session33_profile.py > "$OUT/profile_session33.log" 2>&1; echo "profile rc $?"
for r in 1 2; do
  for fl in 0 1; do
    SMSPLIT_FAST_LAUNCH=$fl timeout -s KILL 90 python3 bench/device/session32_host_probe.py > "$OUT/host_probe_fl${fl}_r${r}_session33.log" 2>&1
    echo "host probe fast=$fl round $r rc $?"; grep -v Warn "$OUT/host_probe_fl${fl}_r${r}_session33.log" | grep -v symm_mem | cut -c1-230
  done
done
timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests > "$OUT/pytest_one_gpu_session33.log" 2>&1
echo "one-GPU suite rc $?"; tail -n 4 "$OUT/pytest_one_gpu_session33.log"
timeout -s KILL 200 python3 bench/device/session32_world1.py > "$OUT/world1_tests_session33.log" 2>&1
echo "world1 rc $?"; grep -E "PASSED|FAILED|passed" "$OUT/world1_tests_session33.log" | cut -c1-160
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
head -60 "$OUT/profile_session33.log"
