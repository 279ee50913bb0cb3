#!/usr/bin/env bash
# Session 11: copy chains with no kernel before their first copy (wip/chain-memop: the counter bump after each chain;
# a combine's copies wait for the peers' sums by cuStreamWaitValue32 on a word the peer's last combine program sets)
# against main (variants/main: `git archive main src bench tests`), 2 H200, 20 SMs, nvlink_copy_engine (share 1.0),
# replayed from CUDA graphs, ROUNDS rounds alternating; first (TESTS=1) the nvlink GPU tests on this tree.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
if [ "${TESTS:-1}" = 1 ]; then
  PYTHONPATH=src timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf -x tests/test_ep_nvlink.py 2>&1 \
    | clean > "$OUT/pytest_nvlink.log"
  tail -4 "$OUT/pytest_nvlink.log" | cut -c1-600
fi
for r in $(seq 1 "${ROUNDS:-1}"); do
  for v in main tree; do
    root=.; [ $v = main ] && root=variants/main
    PYTHONPATH=$root/src timeout 60 python3 $root/bench/ep.py --comm-sms 20 --reps 50 --transports nvlink_copy_engine \
      --copy-shares 1.0 --concurrent-sms 2>&1 | clean > "$OUT/ep_${v}_$r.log"
    grep "CUDA graph\|NCCL all" "$OUT/ep_${v}_$r.log" | head -3 | sed "s/^/$v r$r /" | cut -c1-400
  done
done
