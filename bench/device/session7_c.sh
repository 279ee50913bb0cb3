#!/usr/bin/env bash
# Session 7: the quantizing dispatch loads the next chunk while it quantizes this one (load_chunk). Bit-for-bit
# tests, the staging launch alone (tokens per step x groups per chunk), the nvlink GPU tests, ep.py at 20 SMs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_fp8.py 2>&1 | grep -v -i "warn\|symm_mem" > "$OUT/pytest_fp8.log"
tail -4 "$OUT/pytest_fp8.log"
timeout 100 python3 bench/fp8_stage.py --programs 20 --steps 8 16 --groups 4 8 --warps 16 2>&1 | tee "$OUT/fp8_stage.log" | grep -v "^P=20 TB=.*bf16" | tail -8
cp bench/results/fp8_stage.json "$OUT/" 2>/dev/null
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_ep_nvlink.py 2>&1 | grep -v -i "warn\|symm_mem" > "$OUT/pytest_nvlink.log"
tail -4 "$OUT/pytest_nvlink.log"
for step in "16 8" "8 8"; do
  timeout 100 python3 bench/ep.py --comm-sms 20 --reps 20 --transports nvlink nvlink_copy_engine --copy-shares 1.0 \
    --concurrent-sms --quantize-step $step 2>&1 | grep -v -i warn | grep -v symm_mem > "$OUT/ep_${step// /_}.log"
  grep -i "fp8\|dispatch\|combine" "$OUT/ep_${step// /_}.log" | head -12
  cp bench/results/ep.json "$OUT/ep_${step// /_}.json" 2>/dev/null
done
