#!/usr/bin/env bash
# FP8 peer rows by bulk copies, per warp, second try (session30_bulk_warp.patch). session29_i.sh's run failed two
# ways: the dispatch kernel did not compile when Triton specialized rank == 1 (the first destination picked from
# `(rank == 0).to(...)`), and the one-GPU test kernel's two copy calls were laid out differently (lanes along tokens
# in one, along vectors in the other), so a lane 0 copied bytes other warps were writing. Now every call stores the
# bytes it copies (`ptx.bulk_stage_copy_warp`; no copy-only intrinsic), checks its valid lanes' addresses are
# consecutive too, and a kernel with several copies per chunk (own rows too, or more than 2 ranks) keeps one CTA
# barrier per chunk; with 2 ranks and peer rows only there is none. The own-rows case had passed against the oracle.
# A review then: the host refuses bulk_warp where two warps would hold the same elements (TB x QG x 8 not a multiple
# of the threads) and more than 5 buffers; the one-GPU test now counts which path each copy took (lane 0 of a warp /
# a lane on its own: reversed addresses force the latter) and the compile test asserts the lanes' layout.
# Tests first (rows against the oracle, one-GPU copies), then ep.py at 20 / 24 / 32 SMs, stores (0) against per-warp
# bulk copies (1).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
patch -p1 --forward --no-backup-if-mismatch < bench/device/session30_bulk_warp.patch > "$OUT/patch_session30_i.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_session30_i.log"; exit 1; }
timeout -s KILL 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py tests/test_ptx.py \
  -k "warp_bulk or bulk_buffers5 or bulk_buffers6 or bulk_buffers7" > "$OUT/pytest_bulk_warp_session30.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_bulk_warp_session30.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
run() {  # tag, quantize step, buffers
  timeout -s KILL 80 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 32 --reps 30 \
    --copy-shares 1.0 --concurrent-sms --quantize-step $2 $3 --bulk-peer-rows 0 1 --bulk-warp --bulk-buffers $4 \
    > "$OUT/ep_bulk_warp_$1_session30.log" 2>&1
  echo "ep $1 rc $?"
  grep "CUDA graph" "$OUT/ep_bulk_warp_$1_session30.log" | sed 's/.*stage 4 FP8 rows by sm//; s/ dispatch bf16 .*fp8 \+\([0-9.]*\) us (FP8 input \([0-9.]*\)).*round trip equal: \({[^}]*}\).*queued: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*together: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*/ fp8 \1 queued \4 together \5 equal \3/' | cut -c1-200
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
}
run tb16 16 8 2
run tb16qg4 16 4 4
