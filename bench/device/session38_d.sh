#!/usr/bin/env bash
# Session 38, one H200: the device transports with 3, 4 and 8 ranks as threads on one GPU
# (tests/test_ep_nvlink.py::test_transports_with_more_ranks_than_gpus, smsplit.ep.testing.run_virtual_ranks), one
# pytest run per transport (a hang in one cannot take the others), then the one-GPU suite's other EP files.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
save() { tar -C "$L" -cf "$OUT/session38_d_logs.tar" .; }
for kind in nvlink nvlink_copy_engine copy_engine; do
  t0=$SECONDS
  timeout -s KILL ${LIMIT:-170} python3 -m pytest -v -x -p no:cacheprovider tests/test_ep_nvlink.py \
    -k "more_ranks_than_gpus and $kind- $([ $kind = copy_engine ] && echo 'and not nvlink_copy')" > "$L/virtual_$kind.log" 2>&1
  echo "virtual ranks $kind rc $? in $((SECONDS - t0)) s"; grep -E "PASSED|FAILED|passed|failed|Error" "$L/virtual_$kind.log" | head -8 | cut -c1-250
  save
done
timeout -s KILL 100 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/test_ep_nvlink.py \
  -k "not more_ranks_than_gpus" > "$L/pytest_nvlink_one_gpu.log" 2>&1
echo "test_ep_nvlink one-GPU rest rc $?"; tail -n 1 "$L/pytest_nvlink_one_gpu.log"; save
true
