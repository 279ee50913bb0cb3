#!/usr/bin/env bash
# The FP8 quantization variants of the wip branches against main in one lease. Before the run, here:
#   rm -rf variants && mkdir -p variants/{main,l1,coalesced}
#   git archive main src bench tests | tar -x -C variants/main
#   git archive wip/fp8-pairs-l1 src bench tests | tar -x -C variants/l1
#   git archive wip/fp8-pairs-coalesced src bench tests | tar -x -C variants/coalesced
# (variants/ is untracked, so it travels with the tree; remove it after.) Per variant: the staging launch alone and
# the lean loop (1 GPU, 20 programs), the bit-for-bit FP8 tests and the 2-GPU dispatch tests (FP8 cases), then ep.py
# at 20 / 24 SMs (each graph case checks an FP8 round trip first). Merge a variant only if its tests pass and its
# FP8 dispatch is faster than main's in this run.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
for v in main l1 coalesced; do
  export PYTHONPATH=variants/$v/src
  timeout 40 python3 variants/$v/bench/fp8_stage.py --programs 20 --steps 16 --groups 8 --warps 16 2>&1 | grep fp8 \
    | sed "s/^/$v /"
  timeout 40 python3 variants/$v/bench/fp8_rows.py --programs 20 --steps 16 --groups 8 --warps 16 --stages 2>&1 \
    | grep -v -i warn | sed "s/^/$v /"
done
for v in l1 coalesced; do
  export PYTHONPATH=variants/$v/src
  timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rf variants/$v/tests/test_fp8.py 2>&1 | tail -1 \
    | sed "s/^/$v /"
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    "variants/$v/tests/test_ep_nvlink.py::test_nvlink_dispatch_combine_match_reference_on_two_gpus" \
    "variants/$v/tests/test_ep_nvlink.py::test_buffer_nvlink_backend_equals_reference_backend" 2>&1 | clean \
    > "$OUT/pytest_nvlink_$v.log"; tail -1 "$OUT/pytest_nvlink_$v.log" | sed "s/^/$v /"
done
for v in main l1 coalesced; do
  export PYTHONPATH=variants/$v/src
  timeout 80 python3 variants/$v/bench/ep.py --comm-sms 20 24 --reps 20 --transports nvlink nvlink_copy_engine \
    --copy-shares 1.0 --concurrent-sms 2>&1 | clean > "$OUT/ep_$v.log"
  grep "graph" "$OUT/ep_$v.log" | sed "s/^/$v /"
done
