#!/usr/bin/env bash
# Session 14, fifth lease (2 H200): wip/kernel-first with the BF16 dispatch's positions fixed: the nvlink GPU tests,
# then combine chunkings that start the sum earlier (the kernel now starts before the first chunk lands), timeline
# and ep.py replays at 20 and 24 SMs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
PYTHONPATH=src timeout 300 python3 -m pytest -m gpu tests/test_ep_nvlink.py -x -q 2>&1 | tail -4 \
  | tee "$OUT/pytest_nvlink_kernel_first_session14.log"
CH="0.5,0.8,1 0.4,0.7,0.9,1 0.3,0.6,0.85,1 0.35,0.65,0.85,0.95,1 0.25,0.5,0.75,0.9,1"
PYTHONPATH=src timeout 100 python3 bench/combine_timeline.py --comm-sms 20 --reps 20 --combine-chunks $CH 2>&1 \
  | clean | grep -v "^wrote" | tee "$OUT/combine_timeline_kernel_first_session14.log"
PYTHONPATH=src timeout 150 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 --reps 50 \
  --copy-shares 1.0 --concurrent-sms --combine-chunks $CH 2>&1 | clean | grep -v "^wrote" \
  | tee "$OUT/ep_kernel_first_chunks_session14.log"
