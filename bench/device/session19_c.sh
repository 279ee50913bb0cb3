#!/usr/bin/env bash
# Session 19 (2 H200), main: the FP8 dispatch (quantized in the dispatch, and FP8 input) and the combine with more
# comm SMs than the issue's {8..32} (40, 48, 64): where the FP8 dispatch with its quantization reaches 110 us, if
# anywhere. Result file back as ep_many_sms_session19.json (not the main ep.json).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 200 python3 bench/ep.py --transports nvlink nvlink_copy_engine --comm-sms 40 48 64 --reps 30 \
  --copy-shares 1.0 --concurrent-sms > "$OUT/ep_many_sms_session19.log" 2>&1
echo "ep.py rc $?"; cp bench/results/ep.json "$OUT/ep_many_sms_session19.json"
grep "graph, P=\|Error" "$OUT/ep_many_sms_session19.log" | cut -c1-520
