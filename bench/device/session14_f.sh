#!/usr/bin/env bash
# Session 14, sixth lease (2 H200): the combine's wait fix (a block whose last row was pushed by the source's SMs
# waits for the last copied chunk too) with kernels queued before their copies (wip/kernel-first). The new test on
# main's kernels (variants/main: expected to fail), the nvlink GPU tests on the tree, then nvlink_copy_engine
# replayed at 20 and 24 SMs, tree and main.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
echo "== the late-copies test on main's kernels"
PYTHONPATH=variants/main/src timeout 100 python3 -m pytest -m gpu tests/test_ep_nvlink.py -q --tb=line \
  -k test_combine_sums_no_row_before_its_chunk_lands 2>&1 | grep -i "passed\|failed\|Error:" | head -5
echo "== the nvlink GPU tests on the tree"
PYTHONPATH=src timeout 330 python3 -m pytest -m gpu tests/test_ep_nvlink.py -q --tb=line 2>&1 \
  | grep -i "passed\|failed\|Error:" | head -10
for v in tree main; do
  root=.; [ $v = main ] && root=variants/main
  echo "== $v"
  PYTHONPATH=$root/src timeout 100 python3 $root/bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 \
    --reps 50 --copy-shares 1.0 --concurrent-sms 2>&1 | clean | grep -v "^wrote"
done
