#!/usr/bin/env bash
# Issue #6 on a 4- or 8-GPU machine (nvidia-h200-x4 / -x8): EP benchmark with every GPU, DualPipe(V) vs torch's
# schedules with 4 and 8 ranks, the MoE overlap with EP over every GPU. Results land in bench/results/ (copied to $OUT).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py -k "two_gpus" 2>&1 | tail -3
timeout 330 python3 bench/ep.py --comm-sms 20 24 --reps 20 --chunks 4 --copy-shares 1.0 0.7 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep_${N}gpus.log" | tail -30
cp bench/results/ep.json "$OUT/ep_${N}gpus.json" 2>/dev/null
# the FP8 dispatch spills registers with 4 and 8 ranks at its default step (16 tokens x 8 groups: 168 / 476 bytes,
# ptxas -v on the CPU, session 26); 8 x 8 compiles without spills at 4 ranks: both, FP8 only
timeout 200 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 --reps 20 --copy-shares 1.0 \
  --concurrent-sms --quantize-step 8 8 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep_${N}gpus_qstep8.log" | grep "graph, P="
for R in 4 8; do
  [ "$R" -le "$N" ] || continue
  timeout 300 python3 bench/pipeline.py --ranks $R 2>&1 | tee "$OUT/pipeline_${R}ranks.log" | tail -20
  cp bench/results/pipeline_${R}ranks.json bench/figures/pipeline_*_${R}ranks.png "$OUT/" 2>/dev/null
done
timeout 200 python3 bench/ep_buffer.py --comm-sms 20 24 2>&1 | tee "$OUT/ep_buffer_${N}gpus.log" | grep " P=" ; cp bench/results/ep_buffer.json "$OUT/ep_buffer_${N}gpus.json" 2>/dev/null
timeout 300 python3 bench/moe_overlap.py --world $N --transports reference nvlink --comm-sms 16 24 --iters 3 2>&1 | tee "$OUT/moe_overlap_${N}ranks.log" | tail -12
cp bench/results/moe_overlap_${N}ranks.json "$OUT/" 2>/dev/null
