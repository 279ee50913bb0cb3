#!/usr/bin/env bash
# Session 7: two 16-byte vectors per thread in the FP8 quantization (fp8.quantize_e4m3_bf16_vector_pairs, 16-byte
# stores). Bit-for-bit test, the 2-GPU dispatch tests with FP8 cases, the lean loop and the staging launch alone,
# then ep.py at 20 and 24 SMs (its graph cases check an FP8 round trip first).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 40 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_fp8.py 2>&1 | tail -1
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
  "tests/test_ep_nvlink.py::test_nvlink_dispatch_combine_match_reference_on_two_gpus" \
  "tests/test_ep_nvlink.py::test_buffer_nvlink_backend_equals_reference_backend" \
  "tests/test_ep_nvlink.py::test_buffer_nvlink_copy_engine_backend_equals_reference_backend" 2>&1 \
  | grep -v -i "warn\|symm_mem" > "$OUT/pytest_nvlink.log"; tail -1 "$OUT/pytest_nvlink.log"
timeout 40 python3 bench/fp8_rows.py --programs 20 --steps 16 --groups 8 --warps 16 32 --stages 2>&1 | grep -v -i warn
cp bench/results/fp8_rows.json "$OUT/" 2>/dev/null
timeout 40 python3 bench/fp8_stage.py --programs 20 --steps 8 16 --groups 8 --warps 16 2>&1 | grep fp8
cp bench/results/fp8_stage.json "$OUT/" 2>/dev/null
timeout 100 python3 bench/ep.py --comm-sms 20 24 --reps 20 --transports nvlink nvlink_copy_engine --copy-shares 1.0 \
  --concurrent-sms 2>&1 | grep -v -i warn | grep -v symm_mem > "$OUT/ep.log"; grep "graph" "$OUT/ep.log"
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
