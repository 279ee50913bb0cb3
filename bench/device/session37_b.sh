#!/usr/bin/env bash
# Session 37, one H200: bench/ep.py's one-rank smoke run again with the comm-alone timing queued behind a sleep kernel
# (bench/common.py time_ms gate_ms), every eager row's round trip checked (copy_engine's too) and --name (its --world
# >= 2 check lifted in this copy only, no figures kept); then session
# 36's memcheck positive control and the Buffer rounds and graph workers at one rank under memcheck (session 36's
# logs of these were lost with that session's cut-off).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
save() { tar -C "$L" -cf "$OUT/session37_b_logs.tar" .; }
sed -i 's/if args.world < 2 or/if args.world < 1 or/' bench/ep.py
timeout -s KILL 200 python3 bench/ep.py --world 1 --tokens 512 --hidden 2048 --experts 32 --topk 4 --comm-sms 20 \
  --reps 3 --concurrent-rounds 2 --name ep_world1_smoke > "$L/ep_world1_smoke.log" 2>&1
echo "ep.py world 1 smoke rc $?"; grep -E "concurrent|round trip" "$L/ep_world1_smoke.log" | cut -c1-330
cp bench/results/ep_world1_smoke.json "$L/ep_world1_smoke.json" 2>/dev/null; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
MC="compute-sanitizer --tool memcheck --target-processes all --report-api-errors no --print-limit 30"
for mode in clean overrun; do
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -s KILL 60 $MC python3 bench/device/session36_memcheck_control.py $mode \
    > "$L/control_$mode.log" 2>&1
  echo "control $mode rc $?: $(grep -c "Invalid __global__ write" "$L/control_$mode.log") invalid writes;" \
    "$(grep "ERROR SUMMARY" "$L/control_$mode.log")"
done; save
t0=$SECONDS
timeout -s KILL 320 $MC --log-file "$L/mc_rounds_%p.log" python3 bench/device/session34_world1.py nvlink \
  nvlink_copy_engine copy_engine graph > "$L/world1_rounds_mc.log" 2>&1
echo "rounds rc $? in $((SECONDS - t0)) s"; grep -E "PASSED|FAILED|passed" "$L/world1_rounds_mc.log"
grep -h "ERROR SUMMARY" "$L"/mc_rounds_*.log | sort | uniq -c; save
true
