#!/usr/bin/env bash
# First GPU run of the chunked FP8 quantization (wip/dispatch-unrolled): the nvlink GPU tests (FP8 rounds with and
# without copy engines, graph replays, Buffer backends), the staging launch alone (tokens per step x groups per
# chunk, against the unquantized launch), then the EP benchmark at 20 and 24 SMs and the tokens-per-step sweep.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 330 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_ep_nvlink.py tests/test_fp8.py 2>&1 \
  | grep -v -i "warn\|symm_mem" > "$OUT/pytest_nvlink.log"; tail -3 "$OUT/pytest_nvlink.log"
timeout 90 python3 bench/fp8_stage.py --programs 20 --steps 4 8 --groups 4 8 16 --warps 16 2>&1 | tee "$OUT/fp8_stage.log" | tail -12
cp bench/results/fp8_stage.json "$OUT/" 2>/dev/null
timeout 150 python3 bench/ep.py --comm-sms 20 24 --reps 20 --transports nvlink nvlink_copy_engine --copy-shares 1.0 \
  --concurrent-sms 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -6
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
