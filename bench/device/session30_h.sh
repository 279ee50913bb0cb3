#!/usr/bin/env bash
# 2 GPUs, next session's first FP8 run: session30_split_unroll.patch (the split FP8 dispatch of session30_split.patch
# and the unrolled quantize loop loaded 2 chunks ahead of session30_unroll.patch, both on; supersedes
# session30_e.sh and session30_f.sh). The GPU tests of the FP8 paths first (oracle, Buffer against the reference
# at hidden 2048 / 2176 / 7168, cached dispatches in a row, graph replays with the split case), then `bash
# bench/device/session30_i.sh` for the timings (one device call each: the tests take about 3 minutes).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! grep -q quantized_copy_share src/smsplit/ep/nvlink.py; then
  patch -p1 --forward --no-backup-if-mismatch < bench/device/session30_split_unroll.patch > "$OUT/patch_split_unroll.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_split_unroll.log"; exit 1; }
fi
timeout -s KILL 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "match_reference_on_two or equals_reference_backend or replay_in_a_cuda_graph or cached_dispatches_in_a_row" \
  > "$OUT/pytest_split_unroll_session31.log" 2>&1
echo "pytest rc $?"; grep -E "passed|failed|Error" "$OUT/pytest_split_unroll_session31.log" | head -8
