#!/usr/bin/env bash
# (Session 35: the patch regenerated on main after session 34's docs edits: bench/device/session35_auto.patch.)
# Session 33 (2 H200; session 32's never-run _c script with the patch regenerated on main after FastLaunch): (1) Buffer(backend="auto") choosing nvlink_copy_engine on one host (session35_auto.patch): its
# 2-GPU test, then the GPU tests that run the default backend on NCCL (they must stay on the reference: num_nvl_bytes
# 0); (2) eager Buffer calls, reference against nvlink_copy_engine (bench/ep_buffer.py): what "auto" trades for
# eager users.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
patch -s --no-backup-if-mismatch -p1 < bench/device/session35_auto.patch
timeout -s KILL 120 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_ep_nvlink.py -k "auto" \
  > "$OUT/pytest_auto_session33.log" 2>&1
echo "auto test rc $?"; tail -4 "$OUT/pytest_auto_session33.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
timeout -s KILL 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ep_deepep_compat.py \
  tests/test_ep_dispatch.py tests/test_moe.py > "$OUT/pytest_auto_default_session33.log" 2>&1
echo "default-backend GPU tests rc $?"; tail -4 "$OUT/pytest_auto_default_session33.log"
patch -s -R --no-backup-if-mismatch -p1 < bench/device/session35_auto.patch
# (3) what backend="auto" trades for eager users: the reference's eager Buffer calls beside nvlink_copy_engine's
timeout -s KILL 200 python3 bench/ep_buffer.py --backends reference nvlink_copy_engine --comm-sms 20 \
  > "$OUT/ep_buffer_ref_session33.log" 2>&1
echo "ep_buffer rc $?"; grep "P=20" "$OUT/ep_buffer_ref_session33.log" | cut -c1-600
cp bench/results/ep_buffer.json "$OUT/ep_buffer_ref_session33.json" 2>/dev/null
