#!/usr/bin/env bash
# Session 14, fourth lease (2 H200): kernels captured before their copies (wip/kernel-first: the BF16 dispatch's and
# the combine's copy stream waits on an event recorded before the kernel, and the kernel is queued first) against
# main (variants/main: `git archive main src bench`), nvlink_copy_engine replayed at 20 and 24 SMs, two rounds;
# then the nvlink GPU tests on the tree.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
for round in 1 2; do
  for v in tree main; do
    root=.; [ $v = main ] && root=variants/main
    echo "== $v round $round"
    PYTHONPATH=$root/src timeout 100 python3 $root/bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 \
      --reps 50 --copy-shares 1.0 --concurrent-sms 2>&1 | clean | grep -v "^wrote"
  done
done 2>&1 | tee "$OUT/kernel_first_session14.log"
PYTHONPATH=src timeout 300 python3 -m pytest -m gpu tests/test_ep_nvlink.py -x -q 2>&1 | tail -6 \
  | tee "$OUT/pytest_nvlink_kernel_first_session14.log"
