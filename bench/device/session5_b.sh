#!/usr/bin/env bash
# The combine's copies in chunks, summed as they land: nvlink tests, link facts (flags, local copies), EP graphs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_ep_nvlink.py tests/test_ep_copy_engine.py 2>&1 | tee "$OUT/pytest_nvlink.log" | tail -15
timeout 120 python3 bench/nvlink_link.py --only-pieces --pieces 4 2>&1 | grep -v -i warn | tee "$OUT/nvlink_link_pieces4.log" | tail -4
timeout 240 python3 bench/ep.py --comm-sms 20 --reps 20 --chunks 4 --transports nvlink nvlink_copy_engine --copy-shares 1.0 0.85 0.7 \
  --combine-chunks 0.4,0.7,0.9,1 1 0.25,0.5,0.75,1 0.2,0.4,0.6,0.8,0.9,1 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -30
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
