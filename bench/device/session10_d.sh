#!/usr/bin/env bash
# Session 10, last lease: eager host time per call before (variants/main: `git archive c91eafb src bench tests`) and
# after `_pow2` in plain Python and `_view` by dtype.itemsize, 20 SMs, twice alternating; then the whole GPU suite.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
for r in 1 2; do
  for v in before after; do
    root=variants/main; [ $v = after ] && root=.
    PYTHONPATH=$root/src timeout 45 python3 $root/bench/ep.py --comm-sms 20 --reps 20 --transports nvlink \
      nvlink_copy_engine --copy-shares 1.0 --concurrent-sms 2>&1 | clean | grep "host per call" | sed "s/^/$v /"
  done
done
PYTHONPATH=src timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests 2>&1 | clean > "$OUT/pytest_gpu.log"
tail -5 "$OUT/pytest_gpu.log"
