#!/usr/bin/env bash
# Session 27 (2 H200): the copy stream's reset of a peer's "free" word as a 4-byte copy instead of a fenced
# cuStreamWriteValue32 (its fence cost a BF16 dispatch ~9 us, session27_g): SMSPLIT_COPY_START=main (fenced write),
# p2p (copy of a zero word from the peer's buffer: a copy-engine read over NVLink), local (copy of a zero word on this
# GPU); alternating, 20 SMs; then the nvlink GPU tests with p2p (the tree's default).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for v in main p2p local p2p main local; do
  log="$OUT/ep_copy_reset_${v}_$SECONDS.log"
  SMSPLIT_COPY_START=$v timeout -s KILL 100 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 \
    --reps 30 --copy-shares 1.0 --concurrent-sms > "$log" 2>&1
  echo "$v rc $? $(grep -o 'together: .*' "$log" | grep -o 'dispatch_bf16 [0-9.]*\|combine [0-9.]*' | tr '\n' ' ')"
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
done
timeout -s KILL 340 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py -x \
  > "$OUT/pytest_copy_reset_p2p_session27.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_copy_reset_p2p_session27.log"
