#!/usr/bin/env bash
# Session 13, fifth lease (1 H200): the FP8 staging launch alone with the bf16 loads two chunks ahead (variants/pf2:
# main's nvlink.py with a second chunk in flight, 64 KiB per program) against main's one chunk ahead, 8 and 16 warps.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for round in 1 2; do
  for v in main pf2; do
    root=.; [ $v = pf2 ] && root=variants/pf2
    echo "== $v round $round"
    PYTHONPATH=$root/src timeout 100 python3 $root/bench/fp8_stage.py --programs 20 24 --steps 16 --groups 8 \
      --warps 8 16 --reps 20 2>&1 | grep -v -i warn | grep -v "^wrote"
  done
done 2>&1 | tee "$OUT/fp8_stage_prefetch2_session13.log"
