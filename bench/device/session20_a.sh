#!/usr/bin/env bash
# Next session (2 H200), main: settle whether the header-stream merge (747e7f1) made an eager Buffer call slower
# (session 19: after slower in 7 of nvlink's 8 cached cells in two alternating pairs, within the rounds' spread) and
# the demo (6288 tokens/s in session 19 against 7738 on 2026-11-29). Before = variants/before
# (make_variants_session20.sh). (1) bench/ep_buffer.py, nvlink and nvlink_copy_engine, three alternating rounds;
# (2) smsplit demo before and after, one each.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
for round in 1 2 3; do
  for v in before after; do
    src=src; [ $v = before ] && src=variants/before/src
    echo "=== round $round" >> "$OUT/ep_buffer_${v}_session20.log"  # one file per variant: few files come back
    PYTHONPATH=$src timeout -s KILL 90 python3 bench/ep_buffer.py --comm-sms 20 --backends nvlink nvlink_copy_engine \
      --profile-top 10 > /tmp/ep_buffer_run.log 2>&1
    echo "$v round $round rc $?"; cat /tmp/ep_buffer_run.log >> "$OUT/ep_buffer_${v}_session20.log"
    grep " P=20: " /tmp/ep_buffer_run.log | cut -c1-420; reap
  done
done
for v in before after; do
  src=src; [ $v = before ] && src=variants/before/src
  PYTHONPATH=$src timeout -s KILL 150 python3 -m smsplit demo --out "/tmp/demo_$v" > "$OUT/demo_${v}_session20.log" 2>&1
  echo "demo $v rc $?"; grep -v "^ *$" "$OUT/demo_${v}_session20.log" | tail -2 | cut -c1-200
  cp "/tmp/demo_$v/summary.json" "$OUT/demo_${v}_session20.json" 2>/dev/null; reap
done
