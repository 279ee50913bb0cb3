#!/usr/bin/env bash
# Session 9, first 2-GPU lease: the whole GPU suite on wip/fp8-next (coalesced FP8 loads + scales stored from their
# layout: no barriers in the quantize loop; 8 tokens per combine step), then ep.py at 20 / 24 SMs for main and for
# this tree, same lease (variants/main from `git archive main src bench tests`).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
PYTHONPATH=src timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rf 2>&1 | clean > "$OUT/pytest_gpu_session9.log"
tail -4 "$OUT/pytest_gpu_session9.log"
for v in next main; do
  if [ $v = next ]; then root=.; else root=variants/main; fi
  PYTHONPATH=$root/src timeout 100 python3 $root/bench/ep.py --comm-sms 20 24 --reps 20 \
    --transports nvlink nvlink_copy_engine --copy-shares 1.0 2>&1 | clean > "$OUT/ep_$v.log"
  grep "graph" "$OUT/ep_$v.log" | sed "s/^/$v /"
done
cp bench/results/ep.json "$OUT/ep_next.json" 2>/dev/null
