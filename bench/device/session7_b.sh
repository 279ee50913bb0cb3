#!/usr/bin/env bash
# Session 7: quantization on packed bf16 words (fp8.quantize_e4m3_bf16_vectors): the bit-for-bit test against the
# reference, the nvlink GPU tests, then the FP8 staging launch alone (tokens per step x groups per chunk).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_fp8.py 2>&1 | grep -v -i "warn\|symm_mem" > "$OUT/pytest_fp8.log"
tail -12 "$OUT/pytest_fp8.log"
timeout 150 python3 bench/fp8_stage.py --programs 20 --steps 4 8 16 --groups 8 16 --warps 16 2>&1 | tee "$OUT/fp8_stage.log" | tail -14
cp bench/results/fp8_stage.json "$OUT/" 2>/dev/null
timeout 240 python3 -m pytest -q -x -m gpu -p no:cacheprovider -rf tests/test_ep_nvlink.py 2>&1 | grep -v -i "warn\|symm_mem" > "$OUT/pytest_nvlink.log"
tail -8 "$OUT/pytest_nvlink.log"
