#!/usr/bin/env bash
# Next session (2 H200), main: the open lead of the FP8 target. The pushed FP8 dispatch's kernel is slower at 32 comm
# SMs (125.6-125.9 us on the GPU clock) than at 20 (114.0-114.5), while plain 16-byte pushes of its bytes are faster
# at 32 programs (98.9-104.8 us) than at 20 (110.0). `bench/nvlink_fp8_pattern.py` moves the rows the dispatch's
# way without its arithmetic (8-byte halves or 16-byte stores, with and without the scales and the metadata) at 20,
# 24, 32 and 40 programs: which of its stores stops the scaling, if any (then: 16-byte e4m3 stores in the kernel, as
# session 24's wip/fp8-wide-stores did at 20 SMs only, measured again at 32-40 SMs; if none, the quantization's work).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 240 python3 bench/nvlink_fp8_pattern.py --programs 20 24 32 40 --reps 20 \
  > "$OUT/nvlink_fp8_pattern_session26.log" 2>&1
echo "rc $?"; grep "P=" "$OUT/nvlink_fp8_pattern_session26.log"; cp bench/results/nvlink_fp8_pattern.json "$OUT/" 2>/dev/null
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
