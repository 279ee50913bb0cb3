#!/usr/bin/env bash
# Session 36, one H200: memcheck's positive control (a Triton kernel writing past its tensor must be reported, the
# same kernel in bounds must not), then the 2-GPU Buffer workers of tests/test_ep_nvlink.py as one-rank groups under
# memcheck (rounds through other shapes for the three device backends, the graph workers, session 32's workers).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
save() { tar -C "$L" -cf "$OUT/session36_c_logs.tar" .; }
MC="compute-sanitizer --tool memcheck --target-processes all --report-api-errors no --print-limit 30"
for mode in clean overrun; do
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -s KILL 60 $MC python3 bench/device/session36_memcheck_control.py $mode \
    > "$L/control_$mode.log" 2>&1
  echo "control $mode rc $?: $(grep -c "Invalid __global__ write" "$L/control_$mode.log") invalid writes;" \
    "$(grep "ERROR SUMMARY" "$L/control_$mode.log")"
done; save
t0=$SECONDS
timeout -s KILL 330 $MC --log-file "$L/mc_rounds_%p.log" python3 bench/device/session34_world1.py nvlink \
  nvlink_copy_engine copy_engine graph > "$L/world1_rounds_mc.log" 2>&1
echo "rounds rc $? in $((SECONDS - t0)) s"; grep -E "PASSED|FAILED|passed" "$L/world1_rounds_mc.log"
grep -h "ERROR SUMMARY" "$L"/mc_rounds_*.log | sort | uniq -c; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
t0=$SECONDS
timeout -s KILL 200 $MC --log-file "$L/mc_workers_%p.log" python3 bench/device/session32_world1.py \
  > "$L/world1_workers_mc.log" 2>&1
echo "workers rc $? in $((SECONDS - t0)) s"; grep -E "PASSED|FAILED|passed" "$L/world1_workers_mc.log"
grep -h "ERROR SUMMARY" "$L"/mc_workers_*.log | sort | uniq -c; save
true
