#!/usr/bin/env bash
# Issue #6 on a 4- or 8-GPU machine (nvidia-h200-x4 / -x8), part b of four (one device call each: a call
# may run 600 s at most): register spills with more than 2 ranks, priced: the FP8 dispatch at its default step (16 tokens x 8 groups:
# 168 / 476 bytes spilled at 4 / 8 ranks, ptxas -v on the CPU, session 26) against 8 x 8 (none at 4 ranks), and the
# combine at 4 tokens a step (its default beyond 2 ranks: 20 / 92 bytes spilled at 4 / 8 ranks, session 27) against 2
# (none).
# Results land in bench/results/ (copied to $OUT).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
timeout -s KILL 200 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 --reps 20 --copy-shares 1.0 \
  --concurrent-sms --quantize-step 8 8 --name "ep_${N}gpus_qstep8" 2>&1 | grep -v -i warn | grep -v symm_mem \
  | tee "$OUT/ep_${N}gpus_qstep8.log" | grep "graph, P="
cp "bench/results/ep_${N}gpus_qstep8.json" "$OUT/" 2>/dev/null
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
for tb in 2 4; do
  timeout -s KILL 150 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 --reps 20 --copy-shares 1.0 \
    --concurrent-sms --combine-weights --combine-tokens-per-step $tb --name "ep_${N}gpus_combine_tb${tb}" 2>&1 \
    | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep_${N}gpus_combine_tb${tb}.log" | grep "graph, P="
  cp "bench/results/ep_${N}gpus_combine_tb${tb}.json" "$OUT/" 2>/dev/null
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
done
