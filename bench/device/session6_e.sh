#!/usr/bin/env bash
# Session 6, run E: the FP8 staging launch alone on one GPU (tokens per step x warps, against the same launch
# without quantization and a plain SM copy), then Nsight Compute on one staging launch (TB 4, 16 warps).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 bench/fp8_stage.py --programs 20 32 --steps 2 4 --warps 8 16 2>&1 | tee "$OUT/fp8_stage.log" | tail -20
cp bench/results/fp8_stage.json "$OUT/" 2>/dev/null
timeout 200 ncu -k regex:dispatch_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy --section SchedulerStats \
  python3 bench/fp8_stage.py --once --programs 20 --steps 4 --warps 16 > "$OUT/ncu_stage.txt" 2>&1
grep -i "throughput\|duration\|stall\|warp cycles\|issued\|registers\|occupancy\|No Eligible\|Active Warps" "$OUT/ncu_stage.txt" | head -40
