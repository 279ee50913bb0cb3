#!/usr/bin/env bash
# Next session (2 H200): session29_review_tidy.patch (session 28's review of its own change): five GPU test workers
# repeated the same warm-up on a side stream, barrier and graph capture, now two helpers, `_warm_up` and `_capture`,
# in tests/test_ep_nvlink.py (assertions unchanged); the combine kernel read each source's row range twice, now once
# (ptxas input on the CPU: the same instructions, one min.s32 placed earlier). Written on the CPU, not run: every
# nvlink GPU test with it, and merge the patch if they pass. (It touches the same file as session29_bulk_peer_rows.patch: apply one, then
# regenerate the other.)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
patch -p1 --forward < bench/device/session29_review_tidy.patch > "$OUT/patch_session29_c.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_session29_c.log"; exit 1; }
timeout -s KILL 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  > "$OUT/pytest_review_tidy_session29.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_review_tidy_session29.log"
