#!/usr/bin/env bash
# The FP8 dispatch's quantize loop, two wip branches against main in one 2-GPU lease (neither GPU-run yet):
#   prefetch: the chunk after the one in flight is prefetched into L2 (ptx.prefetch_global_l2, one 128-byte line
#             per thread, across token steps: each token step starts with its first chunk's loads exposed on main);
#             static SASS 353 instructions per chunk against 306 (no barrier, no spills);
#   unroll:   two chunks per iteration, each loaded while the other is quantized (no register copies between
#             iterations); 288.5 instructions per chunk, spills only in the per-step setup.
# Before the run, here (on main):
#   rm -rf variants && mkdir -p variants/{main,prefetch,unroll}
#   git archive main src bench tests | tar -x -C variants/main
#   git archive wip/fp8-prefetch src bench tests | tar -x -C variants/prefetch
#   git archive wip/fp8-unroll src bench tests | tar -x -C variants/unroll
# PHASE=perf skips the GPU tests; TEST_VARIANTS picks whose tests run.
# (variants/ is untracked, so it travels with the tree; remove it after.) The staging launch alone (1 GPU, 20 / 24
# programs; twice, alternating), the FP8 and NVLink GPU tests of each branch, then ep.py at 20 / 24 SMs for all
# three. Merge a branch only if its FP8 dispatch is faster than main's in this run and its tests pass (the two
# branches change the same loop: merge one, then rebase the other if both win).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
for r in 1 2; do
  for v in main prefetch unroll; do
    PYTHONPATH=variants/$v/src timeout 40 python3 variants/$v/bench/fp8_stage.py --programs 20 24 --steps 16 --groups 8 \
      --warps 16 2>&1 | grep fp8 | sed "s/^/$v /"
  done
done
# main at 8 / 32 warps too: the loop holds 2 (token, group) elements per thread at 16 warps and 128 registers; at 8
# warps a thread may use 255 (slower before the barrier-free loop)
PYTHONPATH=variants/main/src timeout 60 python3 variants/main/bench/fp8_stage.py --programs 20 --steps 16 --groups 8 \
  --warps 8 32 2>&1 | grep fp8 | sed "s/^/main /"
if [ "${PHASE:-all}" != perf ]; then
for v in ${TEST_VARIANTS:-prefetch unroll}; do
  PYTHONPATH=variants/$v/src timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    variants/$v/tests/test_fp8.py \
    "variants/$v/tests/test_ep_nvlink.py::test_nvlink_dispatch_combine_match_reference_on_two_gpus" \
    "variants/$v/tests/test_ep_nvlink.py::test_buffer_nvlink_backend_equals_reference_backend" 2>&1 | clean \
    > "$OUT/pytest_$v.log"; tail -1 "$OUT/pytest_$v.log" | sed "s/^/$v /"
done
fi
for v in main prefetch unroll; do
  PYTHONPATH=variants/$v/src timeout 100 python3 variants/$v/bench/ep.py --comm-sms 20 24 --reps 50 \
    --transports nvlink nvlink_copy_engine --copy-shares 1.0 2>&1 | clean > "$OUT/ep_$v.log"
  grep "graph" "$OUT/ep_$v.log" | sed "s/^/$v /"
done
