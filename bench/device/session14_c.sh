#!/usr/bin/env bash
# Session 14, third lease (2 H200): the combine's sum alone and beside copy-engine traffic (bench/sum_beside_copy.py).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
PYTHONPATH=src timeout 200 python3 bench/sum_beside_copy.py --programs 20 24 32 2>&1 | clean \
  | tee "$OUT/sum_beside_copy_session14.log"
cp bench/results/sum_beside_copy.json "$OUT/" 2>/dev/null
# the combine's kernel captured before its copies (variants/kfirst: the copy stream waits on an event recorded
# before the kernel) against main's order (copies first), timeline and replay time
for round in 1 2; do
  for v in tree kfirst; do
    root=.; [ $v = kfirst ] && root=variants/kfirst
    echo "== $v round $round"
    PYTHONPATH=$root/src timeout 150 python3 $root/bench/combine_timeline.py --comm-sms 20 24 --reps 30 \
      --combine-chunks 0.5,0.8,1 2>&1 | clean | grep -v "^wrote"
  done
done 2>&1 | tee "$OUT/combine_kernel_first_session14.log"
