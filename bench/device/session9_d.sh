#!/usr/bin/env bash
# Session 9, fourth lease: the FP8 dispatch with bulk="copy_engine" stages only the tokens of the copied prefix
# (copy_share of each peer's rows, rounded up to whole rounds) and its last launch pushes the later tokens' rows
# itself while the copy engines move the staged ones. GPU tests of the copy-engine paths first, then ep.py at
# 20 / 24 SMs over copy shares and staging launches.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
  "tests/test_ep_nvlink.py::test_nvlink_dispatch_combine_match_reference_on_two_gpus" \
  "tests/test_ep_nvlink.py::test_buffer_nvlink_copy_engine_backend_equals_reference_backend" \
  "tests/test_ep_nvlink.py::test_buffer_nvlink_copy_engine_replays_cached_calls_in_a_cuda_graph" \
  tests/test_fp8.py 2>&1 | clean > "$OUT/pytest_session9_d.log"; tail -2 "$OUT/pytest_session9_d.log"
timeout 200 python3 bench/ep.py --comm-sms 20 24 --reps 20 --transports nvlink_copy_engine \
  --copy-shares 1.0 0.7 0.5 0.3 --stage-chunks 1 2 2>&1 | clean > "$OUT/ep_fp8_hybrid.log"
grep "graph" "$OUT/ep_fp8_hybrid.log"
cp bench/results/ep.json "$OUT/ep_fp8_hybrid.json"
