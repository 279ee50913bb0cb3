#!/usr/bin/env bash
# Smoke runs of the benchmark scripts after their shared helpers moved into bench/common.py (short, results not kept).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
run() { name=$1; shift; timeout 120 python3 "$@" 2>&1 | grep -v -i warn | grep -v symm_mem > "$OUT/$name.log"; echo "$name rc=${PIPESTATUS[0]}: $(tail -2 "$OUT/$name.log" | tr '\n' ' ')"; }
run ep_steps bench/ep_steps.py --steps 4 --reps 5
run ep_profile bench/ep_profile.py --transport nvlink_copy_engine --graph --out "$OUT/prof"
run ep bench/ep.py --comm-sms 20 --reps 5 --copy-shares 0.7 --concurrent-sms
run nvlink_link bench/nvlink_link.py --only-pieces --pieces 4 --reps 5
run copy_engine bench/copy_engine.py --mb 8 --reps 5
