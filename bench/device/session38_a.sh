#!/usr/bin/env bash
# For the next lease (one GPU, about a minute): whether memcheck checks spawned workers (session 37 ran the Buffer
# workers under it through torch.multiprocessing.spawn and saw 0 errors, with no control inside a spawned process).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MC="compute-sanitizer --tool memcheck --target-processes all --report-api-errors no --print-limit 30"
for mode in clean overrun; do
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -s KILL 90 $MC --log-file "$OUT/memcheck_spawn_${mode}_%p.log" \
    python3 bench/device/session37_memcheck_spawn_control.py $mode > "$OUT/spawn_control_$mode.log" 2>&1
  echo "spawned control $mode rc $?: $(cat "$OUT"/memcheck_spawn_${mode}_*.log | grep -c "Invalid __global__ write")" \
    "invalid writes; $(cat "$OUT"/memcheck_spawn_${mode}_*.log | grep "ERROR SUMMARY" | tr '\n' ' ')"
  ls "$OUT" | grep -c "memcheck_spawn_${mode}_"
done
true
