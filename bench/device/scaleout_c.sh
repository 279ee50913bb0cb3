#!/usr/bin/env bash
# Issue #6 on a 4- or 8-GPU machine (nvidia-h200-x4 / -x8), part c of four (one device call each: a call
# may run 600 s at most): DualPipe and DualPipeV against torch's schedules with 4 and 8 ranks (measured bubble against the simulator).
# Results land in bench/results/ (copied to $OUT).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
for R in 4 8; do
  [ "$R" -le "$N" ] || continue
  timeout -s KILL 270 python3 bench/pipeline.py --ranks $R 2>&1 | tee "$OUT/pipeline_${R}ranks.log" | tail -20
  cp bench/results/pipeline_${R}ranks.json bench/figures/pipeline_*_${R}ranks.png "$OUT/" 2>/dev/null
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
done
