#!/usr/bin/env bash
# Session 13, second lease (2 H200): the two-rank combine sum in explicit 16-byte vectors (own rows ld.global.nc,
# landed rows ld.global.cg, sums st.global.L1::no_allocate) against main's (variants/main: `git archive` of main),
# combine replayed at 20 and 24 SMs with 4 and 8 tokens per step, one call and 5 queued; then the nvlink GPU tests.
# (variants/main was `git archive bc3a707 src bench`, removed after; the vector sum was reverted: BENCHMARKS §2.)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
for round in 1 2; do
  for v in tree main; do
    root=.; [ $v = main ] && root=variants/main
    for q in 1 5; do
      echo "== $v round $round queued $q"
      PYTHONPATH=$root/src timeout 120 python3 $root/bench/ep_steps.py --comm-sms 20 24 --steps 4 8 --kernels combine \
        --queued $q 2>&1 | clean | grep -v "^wrote"
    done
  done
done 2>&1 | tee "$OUT/combine_v4_sum_session13.log"
PYTHONPATH=src timeout 330 python3 -m pytest -m gpu tests/test_ep_nvlink.py -x -q 2>&1 | tail -6 \
  | tee "$OUT/pytest_nvlink_session13.log"
