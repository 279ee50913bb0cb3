#!/usr/bin/env bash
# Session 38, one H200: the device transports with 3, 4 and 8 ranks sharing one GPU, one process each
# (tests/test_ep_nvlink.py::test_transports_with_more_ranks_than_gpus, smsplit.ep.testing.run_ranks_on_one_gpu).
# (Its first version ran the ranks as threads of one process: a rank's first launch of a kernel variant waited for
# the context to idle (CUDA's lazy module loading) while the other ranks' kernels spun waiting for it: timeouts.)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
save() { tar -C "$L" -cf "$OUT/session38_d_logs.tar" .; }
t0=$SECONDS
timeout -s KILL ${LIMIT:-400} python3 -m pytest -v -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "more_ranks_than_gpus or ranks_on_one_gpu" > "$L/ranks_on_one_gpu.log" 2>&1 &
pid=$!
while kill -0 $pid 2>/dev/null; do sleep 15; save; done
wait $pid; echo "ranks sharing one GPU rc $? in $((SECONDS - t0)) s"
grep -E "PASSED|FAILED|passed|failed|EPTimeout|Error:" "$L/ranks_on_one_gpu.log" | head -30 | cut -c1-250
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; save
true
