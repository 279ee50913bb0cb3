#!/usr/bin/env bash
# Session 31: the combine with a small share of each source's rows pushed by the SMs (combine_copy_share 0.97 /
# 0.94: the last 3 / 6% of the rows a source returns, pushed before the sum's barrier) against every row copied
# (1.0, the default). Session ~10 measured 0.9 / 0.8 much slower, with a combine kernel since rewritten. Main,
# alternating, two rounds, 20 SMs, nvlink_copy_engine replayed.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for round in 1 2; do
  for share in 1.0 0.97 0.94; do
    log="$OUT/ep_combine_share_${share}_${round}_session31.log"
    timeout -s KILL 85 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 --copy-shares 1.0 \
      --combine-copy-share $share --concurrent-sms --combine-weights > "$log" 2>&1
    echo "$share $round rc $? ${SECONDS}s $(grep -o 'together: .*' "$log" | grep -o 'combine[a-z_]* [0-9.]*' | tr '\n' ' ') $(grep -o 'round trip equal: [A-Za-z]*' "$log" | head -1)"
    pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
  done
done
