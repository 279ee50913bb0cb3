#!/usr/bin/env bash
# (Session 35: the patch regenerated on main after session 34's docs edits: bench/device/session35_streams.patch.)
# Session 33 (2 H200), regenerated on main after FastLaunch and with cheaper stream hops: with session35_streams.patch, the rest of the Buffer GPU tests (copy-engine Buffer, DeepEP
# compatibility, dispatch, errors, MoE), then eager Buffer calls main against the patch (bench/ep_buffer.py,
# alternating): what the stream hops cost a call.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=bench/device/session35_streams.patch
patch -s --no-backup-if-mismatch -p1 < $P
timeout -s KILL 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ep_copy_engine.py tests/test_ep_deepep_compat.py \
  tests/test_ep_dispatch.py tests/test_ep_errors.py tests/test_moe.py > "$OUT/pytest_streams_rest_session33.log" 2>&1
echo "rest rc $?"; tail -4 "$OUT/pytest_streams_rest_session33.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
patch -s -R --no-backup-if-mismatch -p1 < $P
for state in main streams; do
  if [ $state = streams ]; then patch -s --no-backup-if-mismatch -p1 < $P; fi
  timeout -s KILL 120 python3 bench/ep_buffer.py --backends nvlink_copy_engine --comm-sms 20 \
    > "$OUT/ep_buffer_${state}_session33.log" 2>&1
  echo "$state rc $?"; grep "P=20" "$OUT/ep_buffer_${state}_session33.log" | cut -c1-500
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
  if [ $state = streams ]; then patch -s -R --no-backup-if-mismatch -p1 < $P; fi
done
