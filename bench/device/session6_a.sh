#!/usr/bin/env bash
# Session 6, run A: the dispatch's copy of a prefix of x per peer (holes filled after it lands): the nvlink GPU
# tests, then the EP benchmark at 20/24 SMs for copy shares 1.0 / 0.9 / 0.7 (round trips checked in it).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_ep_nvlink.py 2>&1 | grep -v -i "warn\|symm_mem" > "$OUT/pytest_nvlink.log"
tail -3 "$OUT/pytest_nvlink.log"
timeout 300 python3 bench/ep.py --comm-sms 20 24 --reps 20 --chunks 4 --transports nvlink nvlink_copy_engine \
  --copy-share 1.0 --copy-shares 1.0 0.9 0.7 --concurrent-sms 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -16
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
