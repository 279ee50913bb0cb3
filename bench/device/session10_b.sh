#!/usr/bin/env bash
# Session 10: (1) where the host time of an eager cached dispatch + combine goes (bench/device/host_profile.sh);
# (2) the copy-engine transport's FP8 dispatch before / after `fp8.e4m3_v4_words` became two `e4m3_v2_words`
# splits (same bytes; variants/main: `git archive main src bench tests`), eager, 20 SMs, 4 chunks, twice alternating.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
for r in 1 2; do
  for v in main tree; do
    root=variants/main; [ $v = tree ] && root=.
    PYTHONPATH=$root/src timeout 100 python3 $root/bench/ep.py --comm-sms 20 --reps 50 --transports copy_engine \
      --chunks 4 --concurrent-sms 2>&1 | clean > "$OUT/ep_copy_engine_${v}_$r.log"
    grep -i "copy_engine" "$OUT/ep_copy_engine_${v}_$r.log" | grep -v "^#" | head -4 | sed "s/^/$v /"
  done
done
bash bench/device/host_profile.sh
