#!/usr/bin/env bash
# Issue #6 on a 4- or 8-GPU machine (nvidia-h200-x4 / -x8), part d of four (one device call each: a call
# may run 600 s at most): eager Buffer calls on every GPU, and the MoE block's overlap with EP over every GPU.
# Results land in bench/results/ (copied to $OUT).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
timeout -s KILL 200 python3 bench/ep_buffer.py --comm-sms 20 24 2>&1 | tee "$OUT/ep_buffer_${N}gpus.log" | grep " P="
cp bench/results/ep_buffer.json "$OUT/ep_buffer_${N}gpus.json" 2>/dev/null
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
timeout -s KILL 330 python3 bench/moe_overlap.py --world $N --transports reference nvlink --comm-sms 16 24 --iters 3 2>&1 \
  | tee "$OUT/moe_overlap_${N}ranks.log" | tail -12
cp bench/results/moe_overlap_${N}ranks.json "$OUT/" 2>/dev/null
