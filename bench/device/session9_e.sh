#!/usr/bin/env bash
# Session 9, fifth lease: the FP8 dispatch's quantization step (tokens x groups of 128 per step) now that the
# quantize loop has no barriers: nvlink (SM push) and nvlink_copy_engine at 20 / 24 SMs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
for step in "16 8" "8 8" "32 4" "8 16"; do
  timeout 100 python3 bench/ep.py --comm-sms 20 24 --reps 20 --transports nvlink nvlink_copy_engine --copy-shares 1.0 \
    --quantize-step $step 2>&1 | clean > "$OUT/ep_qstep_${step/ /x}.log"
  grep "graph" "$OUT/ep_qstep_${step/ /x}.log" | sed "s/^/step $step: /" | sed "s/dispatch bf16.*fp8/fp8/; s/combine .*queued:/queued:/; s/dispatch_bf16 [0-9.]*, //; s/, combine [0-9.]* us//"
done
