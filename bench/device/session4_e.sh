#!/usr/bin/env bash
# bulk="copy_engine" moving this rank's own rows too; combine sum with sources unrolled. Tests, profile, bench.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py 2>&1 | tee "$OUT/pytest_nvlink.log" | tail -15
for t in nvlink_copy_engine nvlink; do
  timeout 120 python3 bench/ep_profile.py --transport $t --sms 20 --out "$OUT/prof" 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/profile_$t.log" | tail -12
done
rm -f "$OUT"/prof/trace_*.json
timeout 300 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 20 --transports nvlink nvlink_copy_engine 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -30
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
