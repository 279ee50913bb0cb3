#!/usr/bin/env bash
# Session 19 (2 H200), wip/dynamic-blocks: the combine's sum blocks handed out by a counter (programs that run
# slower take fewer) against main's round-robin blocks (variants/main, make_variants_session19.sh), same lease,
# alternating: (1) combine_timeline started together, four chunks, 20 and 24 SMs (kernel end, flags, tail, the
# programs' end spread per rank); (2) ep.py replayed, nvlink and nvlink_copy_engine at 20 and 24 SMs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
for round in 1 2; do
  for v in main branch; do
    src=src; [ $v = main ] && src=variants/main/src
    PYTHONPATH=$src timeout -s KILL 100 python3 bench/combine_timeline.py --comm-sms 20 24 --combine-chunks 0.4,0.7,0.9,1 \
      --start-together --reps 30 > "$OUT/combine_blocks_${v}_${round}_session19.log" 2>&1
    echo "$v round $round timeline rc $?"; grep "^P=" "$OUT/combine_blocks_${v}_${round}_session19.log" | cut -c1-260; reap
  done
done
for round in 1 2; do
  for v in main branch; do
    src=src; [ $v = main ] && src=variants/main/src
    PYTHONPATH=$src timeout -s KILL 150 python3 bench/ep.py --transports nvlink nvlink_copy_engine --comm-sms 20 24 \
      --reps 30 --copy-shares 1.0 --concurrent-sms > "$OUT/ep_blocks_${v}_${round}_session19.log" 2>&1
    echo "$v round $round ep.py rc $?"; grep "graph, P=\|Error" "$OUT/ep_blocks_${v}_${round}_session19.log" | cut -c1-400; reap
  done
done
