#!/usr/bin/env bash
# The FP8 dispatch's peer rows by bulk copies with more staging buffers (session29_bulk_buffers.patch: the bulk patch
# of session29_a.sh plus BULK_BUFFERS / NvlinkTransport.bulk_buffers / ep.py --bulk-buffers). session29_a.sh:
# with two 16-KB buffers the bulk copies were slower at 20 / 24 SMs (170.8 / 147.7 us started together against
# 114.5 / 116.0) and faster at 32 (112.5 against 126.0): about 1.9 us per chunk per SM, as if each SM's bulk copies
# were bound by the time their reads take to finish, not by bytes. Four or five buffers of 8 KB (8 tokens x 1 KB, or
# 16 tokens x 512 B) keep 24-32 KB in flight instead of 16. Tests first (rows against the oracle), then ep.py at
# 20 / 24 / 32 SMs per quantize step, stores (0) against bulk copies (1), then the first sweep again.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
patch -p1 --forward --no-backup-if-mismatch < bench/device/session29_bulk_buffers.patch > "$OUT/patch_session29_d.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_session29_d.log"; exit 1; }
timeout -s KILL 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py tests/test_ptx.py -k "bulk_copies" \
  > "$OUT/pytest_bulk_buffers_session29.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_bulk_buffers_session29.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
run() {  # tag, quantize step, buffers
  local tag=$1 tok=$2 grp=$3; shift 3
  timeout -s KILL 150 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 32 --reps 30 \
    --copy-shares 1.0 --concurrent-sms --quantize-step $tok $grp --bulk-peer-rows 0 1 --bulk-buffers "$@" \
    > "$OUT/ep_bulk_buffers_${tag}_session29.log" 2>&1
  echo "ep $tag (step $tok $grp, buffers $*) rc $?"
  grep "CUDA graph" "$OUT/ep_bulk_buffers_${tag}_session29.log" | sed 's/.*stage 4 FP8 rows by sm//; s/ dispatch bf16 .*fp8 \+\([0-9.]*\) us (FP8 input \([0-9.]*\)).*round trip equal: \({[^}]*}\).*together: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*/ fp8 \1 (input \2) started together \4 equal \3/' | cut -c1-200
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
}
run a1 16 8 2
run b 8 8 2 4 5
run c 16 4 2 4 5
run a2 16 8 2
