#!/usr/bin/env bash
# Session 19 (2 H200), main with the Buffer changes (header all-gather on its own stream, event wait): the main job,
# `smsplit demo`, on the GPUs (EP over 2 ranks through Buffer(backend="nvlink"), DualPipeV).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 170 python3 -m smsplit demo --out "$OUT/demo" > "$OUT/demo_gpu_session19.log" 2>&1
echo "demo rc $?"; grep -v "^ *$" "$OUT/demo_gpu_session19.log" | tail -8 | cut -c1-200; ls "$OUT/demo" | head
