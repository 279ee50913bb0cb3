#!/usr/bin/env bash
# 2 GPUs: the FP8 dispatch that quantizes, split in one launch between programs that stage a share of the tokens'
# peer rows for the copy engines (a release-add per range of theirs; the copy stream waits for it by
# cuStreamWaitValue32 and copies the range) and programs that push the rest (`quantized_copy_share`;
# session30_split.patch). The graph-replay GPU tests first (the split case: 3 of 8 programs stage half the tokens
# in 2 ranges), then ep.py at 20 and 24 SMs, pushed (0) against shares 0.3 / 0.36 / 0.45 (staging programs
# 1.15 x share x SMs).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! grep -q quantized_copy_share src/smsplit/ep/nvlink.py; then
  patch -p1 --forward --no-backup-if-mismatch < bench/device/session30_split.patch > "$OUT/patch_session30_split.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_session30_split.log"; exit 1; }
fi
timeout -s KILL 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py -k "replay_in_a_cuda_graph" \
  > "$OUT/pytest_split_session30.log" 2>&1
echo "pytest rc $?"; grep -E "passed|failed|Error" "$OUT/pytest_split_session30.log" | head -8
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
run() {  # tag, splits
  timeout -s KILL 150 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 --reps 30 \
    --copy-shares 1.0 --concurrent-sms --quantized-copy-splits $2 > "$OUT/ep_split_$1_session30.log" 2>&1
  echo "ep $1 rc $?"
  grep "CUDA graph" "$OUT/ep_split_$1_session30.log" | sed 's/.*stage 4 FP8 rows by sm//; s/ dispatch bf16 .*fp8 \+\([0-9.]*\) us (FP8 input \([0-9.]*\)).*round trip equal: \({[^}]*}\).*queued: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*together: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*/ fp8 \1 queued \4 together \5 equal \3/' | cut -c1-220
  grep -m3 "Error\|Traceback" "$OUT/ep_split_$1_session30.log"
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
}
run a "0 0.3 0.36 0.45"
