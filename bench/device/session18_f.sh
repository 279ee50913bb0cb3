#!/usr/bin/env bash
# Session 18 (2 H200): does rank 0's longer combine tail (5-9 us after the last flag, session 17) follow the rank
# or the physical GPU? combine_timeline started together, four chunks, 20 and 24 SMs, GPUs in order then swapped.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,pci.bus_id,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpus_session18_f.log"
for order in 0,1 1,0; do
  CUDA_VISIBLE_DEVICES=$order timeout -s KILL 100 python3 bench/combine_timeline.py --comm-sms 20 24 \
    --combine-chunks 0.4,0.7,0.9,1 --start-together --reps 30 > "$OUT/combine_rank_vs_gpu_${order/,/}_session18.log" 2>&1
  echo "CUDA_VISIBLE_DEVICES=$order rc $?"; grep "^P=" "$OUT/combine_rank_vs_gpu_${order/,/}_session18.log" | cut -c1-260
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
done
