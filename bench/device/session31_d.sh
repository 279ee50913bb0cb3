#!/usr/bin/env bash
# Session 31 (2 H200): Buffer(backend="auto") choosing nvlink_copy_engine on one host (session31_auto.patch): its
# CPU tests passed; here its 2-GPU test, then the Buffer GPU tests that run the default backend on NCCL (they must
# stay on the reference: num_nvl_bytes 0).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=bench/device/session31_auto.patch
grep -q "_auto_backend" src/smsplit/ep/buffer.py || patch -s --no-backup-if-mismatch -p1 < $P
timeout -s KILL 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_ep_nvlink.py -k "auto" \
  > "$OUT/pytest_auto_session31.log" 2>&1
echo "auto test rc $?"; tail -4 "$OUT/pytest_auto_session31.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
timeout -s KILL 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ep_deepep_compat.py tests/test_ep_dispatch.py \
  tests/test_moe.py > "$OUT/pytest_auto_default_session31.log" 2>&1
echo "default-backend GPU tests rc $?"; tail -4 "$OUT/pytest_auto_default_session31.log"
