#!/usr/bin/env bash
# Device call (2 GPUs): every GPU test, then `smsplit demo` on the GPUs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# (the transports with 3-8 ranks sharing GPU 0 take about 4 minutes: bench/device/session38_d.sh runs them)
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -k "not more_ranks_than_gpus" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -8
timeout 200 python3 -m smsplit demo --out /tmp/demo > "$OUT/demo.log" 2>&1; echo "demo rc=$?"; tail -3 "$OUT/demo.log"
tar czf "$OUT/demo.tgz" -C /tmp demo 2>/dev/null
