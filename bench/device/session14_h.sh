#!/usr/bin/env bash
# Session 14, commands run by hand on 2 H200 (recorded here): which half of wip/kernel-first broke the 2-GPU test
# (variants/kf_combine: only the combine's kernel first, failed "case 2" / "case 6: combine differs"; variants/
# kf_dispatch: only the BF16 dispatch's, passed twice), then the final late-copies test on main's kernels and on the
# tree, and the GPU suite but the nvlink tests on the tree.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for v in kf_combine kf_dispatch; do for i in 1 2; do echo "== $v $i"; (cd variants/$v && PYTHONPATH=src timeout 100 \
  python3 -m pytest -m gpu tests/test_ep_nvlink.py -x -q --tb=line \
  -k test_nvlink_dispatch_combine_match_reference_on_two_gpus 2>&1 | grep -i "passed\|failed\|Error:" | head -5); done; done
for v in main tree; do root=.; [ $v = main ] && root=variants/main; echo "== late-copies test (eager + graph) on $v's kernels"
  PYTHONPATH=$root/src timeout 80 python3 -m pytest -m gpu tests/test_ep_nvlink.py -q --tb=line \
  -k test_combine_sums_no_row_before_its_chunk_lands 2>&1 | grep -i "passed\|failed\|Error:\|differs" | head -6
done 2>&1 | tee "$OUT/late_copies_test_graph_session14.log"
PYTHONPATH=src timeout 170 python3 -m pytest -m gpu tests --ignore=tests/test_ep_nvlink.py -q --tb=line 2>&1 \
  | grep -v -i warn | tail -8 | tee "$OUT/pytest_gpu_session14_rest.log"
