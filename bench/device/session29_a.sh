#!/usr/bin/env bash
# Next session (2 H200): the FP8 dispatch's peer rows by bulk copies from shared memory (session29_bulk_peer_rows.patch,
# written and compiled on the CPU in session 28, never run): each quantized 1-KB chunk of 16 tokens goes to a
# double-buffered PTX `.shared` area; one `cp.async.bulk.global.shared::cta` per token and peer sends it while the
# warps quantize the next chunk (session 28: at 32 SMs the dispatch takes 76 us without its peer stores, 126 with);
# --bulk-peer-rows 2: its own rows by bulk copies too (the SMs' global stores then only scales and metadata).
# First the GPU tests that exercise it (results against the oracle), then ep.py with and without it at 20-32 SMs
# (round trip equal printed per case).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
patch -p1 --forward < bench/device/session29_bulk_peer_rows.patch > "$OUT/patch_session29_a.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_session29_a.log"; exit 1; }
timeout -s KILL 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py tests/test_ptx.py -k "bulk_copies or compile or replay_in_a_cuda_graph" \
  > "$OUT/pytest_bulk_peer_rows_session29.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_bulk_peer_rows_session29.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
for order in "0 1 2" "2 1 0"; do
  tag=${order// /_}
  timeout -s KILL 170 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 32 --reps 30 \
    --copy-shares 1.0 --concurrent-sms --bulk-peer-rows $order > "$OUT/ep_bulk_peer_rows_${tag}_session29.log" 2>&1
  echo "ep $order rc $?"
  grep "CUDA graph" "$OUT/ep_bulk_peer_rows_${tag}_session29.log" | sed 's/.*stage 4 FP8 rows by sm//; s/round trip equal: \({[^}]*}\).*together: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*/equal \1 FP8 started together \2/' | cut -c1-250
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
done
