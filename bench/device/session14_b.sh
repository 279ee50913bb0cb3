#!/usr/bin/env bash
# Session 14, second lease (2 H200): the combine's timeline on the GPU clock (bench/combine_timeline.py: when each
# chunk's flag lands, kernel start and end) for several chunkings at 20 and 24 SMs; the copy-chain variants with
# the flags on a stream of their own (bench/copy_chain.py, fixed).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
PYTHONPATH=src timeout 200 python3 bench/combine_timeline.py --comm-sms 20 24 32 --combine-chunks 1 0.5,0.8,1 \
  0.5,0.8,0.95,1 0.35,0.65,0.85,0.95,1 2>&1 | clean | tee "$OUT/combine_timeline_session14.log"
cp bench/results/combine_timeline.json "$OUT/" 2>/dev/null
PYTHONPATH=src timeout 150 python3 bench/copy_chain.py 2>&1 | clean | grep -v "^checks" \
  | tee "$OUT/copy_chain_session14.log"
