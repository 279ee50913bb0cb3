#!/usr/bin/env bash
# 2 GPUs: the combine reading the copied rows as they land (`NvlinkTransport(combine_poll=True)`,
# session30_poll.patch; `ptx.landed_bf16x2` passed its one-GPU test in this session): its combine area holds 0xFFFF
# halves where no row has landed, the sum reads each word and waits for the chunk's flag only for a word that
# holds one, and refills the slots it read. GPU tests first (combines in a row; late copies, eager and replayed,
# with rows whose data holds 0xFFFF halves against a transport that waits for the flags), then ep.py, main's
# combine against the polled one with the default chunks and with one chunk, alternating, 20 / 24 / 32 SMs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! grep -q landed_bf16x2 src/smsplit/ptx.py; then
  patch -p1 --forward --no-backup-if-mismatch < bench/device/session30_poll.patch > "$OUT/patch_session30_poll.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_session30_poll.log"; exit 1; }
fi
timeout -s KILL 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py tests/test_ptx.py \
  -k "combines_in_a_row or chunk_lands or landed" > "$OUT/pytest_poll_session30.log" 2>&1
echo "pytest rc $?"; grep -E "passed|failed|Error" "$OUT/pytest_poll_session30.log" | head -8
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
run() {  # tag, extra args
  timeout -s KILL 100 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 32 --reps 30 \
    --copy-shares 1.0 --concurrent-sms --combine-weights $2 > "$OUT/ep_poll_$1_session30.log" 2>&1
  echo "ep $1 rc $?"
  grep "CUDA graph" "$OUT/ep_poll_$1_session30.log" | sed 's/nvlink_copy_engine share 1.0 chunks//; s/stage 4 FP8 rows by sm in a CUDA graph//; s/dispatch bf16 .*combine \+\([0-9.]*\) us;.*queued: .*combine \([0-9.]*\), combine_weighted \([0-9.]*\) us; started together: .*combine \([0-9.]*\), combine_weighted \([0-9.]*\) us/combine \1 queued \2 together \4 weighted queued \3 together \5/' | cut -c1-200
  grep -m3 "Error\|Traceback" "$OUT/ep_poll_$1_session30.log"
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
}
run main1 ""
run poll1 "--combine-poll"
run poll1c1 "--combine-poll --combine-chunks 1"
run main2 ""
run poll2 "--combine-poll"
