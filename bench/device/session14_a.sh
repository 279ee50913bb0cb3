#!/usr/bin/env bash
# Session 14, first lease (2 H200): copy-done flags on a stream of their own (wip/side-flags: the next chunk's copy
# does not queue behind the flag copies). The copy-chain variants (tree), then the nvlink_copy_engine combine
# replayed at 20 and 24 SMs with 3 and 4 chunks, tree against main (variants/main: `git archive main src bench`).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
PYTHONPATH=src timeout 150 python3 bench/copy_chain.py 2>&1 | clean | tee "$OUT/copy_chain_session14.log"
for round in 1 2; do
  for v in tree main; do
    root=.; [ $v = main ] && root=variants/main
    echo "== $v round $round"
    PYTHONPATH=$root/src timeout 150 python3 $root/bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 \
      --reps 50 --copy-shares 1.0 --concurrent-sms --combine-chunks 0.5,0.8,1 0.5,0.75,0.9,1 2>&1 | clean \
      | grep -v "^wrote"
  done
done 2>&1 | tee "$OUT/side_flags_session14.log"
