#!/usr/bin/env bash
# Session 33 (one H200): the layout kernels (compute_dispatch_layout, check_dispatch_layout, token_positions as one
# Triton kernel each on a GPU): their GPU tests against loop oracles, the one-GPU suite, the Buffer workers at one
# rank; an eager uncached dispatch's host time on main (variants/main/src) and the branch, alternating.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
for v in main branch main branch; do
  if [ $v = main ]; then P=variants/main/src; else P=src; fi
  PYTHONPATH=$P timeout -s KILL 60 python3 bench/device/session33_uncached_profile.py --no-profile >> "$L/uncached_${v}_session33.log" 2>&1
  echo "$v rc $?"; grep "uncached dispatch:" "$L/uncached_${v}_session33.log" | tail -2
done
export PYTHONPATH=src
timeout -s KILL 120 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests > "$L/pytest_one_gpu_h_session33.log" 2>&1
echo "one-GPU suite rc $?"; grep -E "FAILED|Error" "$L/pytest_one_gpu_h_session33.log" | head -20; tail -n 2 "$L/pytest_one_gpu_h_session33.log"
timeout -s KILL 250 python3 bench/device/session32_world1.py > "$L/world1_tests_h_session33.log" 2>&1
echo "world1 rc $?"; grep -E "FAILED|passed" "$L/world1_tests_h_session33.log" | cut -c1-200
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
tar -C "$L" -cf "$OUT/session33_h_logs.tar" .
true
