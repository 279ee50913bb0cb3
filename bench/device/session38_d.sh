#!/usr/bin/env bash
# Session 38, one H200: the device transports with 3, 4 and 8 ranks sharing one GPU, one process each
# (tests/test_ep_nvlink.py::test_transports_with_more_ranks_than_gpus, smsplit.ep.testing.run_ranks_on_one_gpu),
# most telling cases first, at most ${LIMIT:-200} s in all.
# (Its first version ran the ranks as threads of one process: a rank's first launch of a kernel variant waited for
# the context to idle (CUDA's lazy module loading) while the other ranks' kernels spun waiting for it: timeouts.)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
save() { tar -C "$L" -cf "$OUT/session38_d_logs.tar" .; }
end=$((SECONDS + ${LIMIT:-200}))
for sel in "nvlink-4" "nvlink-8" "nvlink_copy_engine-4" "copy_engine-4 and not nvlink_copy" "nvlink-3" \
           "nvlink_copy_engine-8" "copy_engine-8 and not nvlink_copy" "nvlink_copy_engine-3" "copy_engine-3 and not nvlink_copy"; do
  left=$((end - SECONDS)); [ $left -lt 20 ] && break
  name=$(echo "$sel" | cut -d' ' -f1); t0=$SECONDS
  timeout -s KILL $left python3 -m pytest -q -p no:cacheprovider tests/test_ep_nvlink.py \
    -k "more_ranks_than_gpus and $sel" > "$L/ranks_on_one_gpu_$name.log" 2>&1
  echo "$name rc $? in $((SECONDS - t0)) s: $(tail -n 1 "$L/ranks_on_one_gpu_$name.log" | cut -c1-120)"
  grep -hE "EPTimeout|Error:" "$L/ranks_on_one_gpu_$name.log" | sort | uniq -c | head -4 | cut -c1-250
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; save
done
true
