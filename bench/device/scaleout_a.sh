#!/usr/bin/env bash
# Issue #6 on a 4- or 8-GPU machine (nvidia-h200-x4 / -x8), part a of four (one device call each: a call
# may run 600 s at most): the nvlink GPU round-trip tests on every GPU, then the full EP benchmark (both copy shares, 20 and 24 SMs, NCCL
# and the copy-engine all-to-all ceiling in the same run).
# Results land in bench/results/ (copied to $OUT).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
timeout -s KILL 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py -k "two_gpus" 2>&1 | tail -3
timeout -s KILL 330 python3 bench/ep.py --comm-sms 20 24 --reps 20 --chunks 4 --copy-shares 1.0 0.7 --combine-weights --name "ep_${N}gpus" 2>&1 \
  | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep_${N}gpus.log" | tail -30
cp "bench/results/ep_${N}gpus.json" "$OUT/" 2>/dev/null
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
