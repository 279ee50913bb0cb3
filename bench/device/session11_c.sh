#!/usr/bin/env bash
# Session 11: the combine's sum prefetching its own rows into L2 PREFETCH blocks ahead (wip/combine-prefetch2:
# --combine-prefetch-blocks 2 / 4) against none (variants/main: `git archive main src bench tests`), 2 H200, 20 SMs,
# nvlink_copy_engine (share 1.0), replayed from CUDA graphs, ROUNDS rounds alternating.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
for r in $(seq 1 "${ROUNDS:-1}"); do
  for v in main prefetch2 prefetch4; do
    root=.; extra=""
    case $v in main) root=variants/main;; prefetch2) extra="--combine-prefetch-blocks 2";;
      prefetch4) extra="--combine-prefetch-blocks 4";; esac
    PYTHONPATH=$root/src timeout 60 python3 $root/bench/ep.py --comm-sms 20 --reps 50 --transports nvlink_copy_engine \
      --copy-shares 1.0 --concurrent-sms $extra 2>&1 | clean > "$OUT/ep_${v}_$r.log"
    grep "CUDA graph" "$OUT/ep_${v}_$r.log" | head -3 | sed "s/^/$v r$r /" | cut -c1-400
  done
done
