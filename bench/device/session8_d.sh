#!/usr/bin/env bash
# Session 8, fourth run: combines queued back to back (no dispatch between) while one rank is slowed. First on the
# code before the guard (base/: a combine waits for nothing before overwriting a peer's combine area), then with it
# (a combine, and its copies, wait until every peer has summed the previous one); the nvlink tests; ep.py at 20
# SMs before and after the guard (its cost).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
PYTHONPATH=base/src timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rf base/tests/test_ep_nvlink.py \
  -k combines_in_a_row 2>&1 | clean > "$OUT/pytest_in_a_row_before.log"; tail -4 "$OUT/pytest_in_a_row_before.log"
export PYTHONPATH=src
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_ep_nvlink.py 2>&1 | clean \
  > "$OUT/pytest_nvlink.log"; tail -4 "$OUT/pytest_nvlink.log"
PYTHONPATH=base/src timeout 70 python3 base/bench/ep.py --comm-sms 20 --reps 20 --transports nvlink nvlink_copy_engine \
  --copy-shares 1.0 --combine-chunks 0.6,1 --concurrent-sms 2>&1 | clean > "$OUT/ep_before.log"; grep "graph" "$OUT/ep_before.log"
timeout 70 python3 bench/ep.py --comm-sms 20 --reps 20 --transports nvlink nvlink_copy_engine --copy-shares 1.0 --combine-chunks 0.6,1 \
  --concurrent-sms 2>&1 | clean > "$OUT/ep_after.log"; grep "graph" "$OUT/ep_after.log"
cp bench/results/ep.json "$OUT/ep_after.json" 2>/dev/null
