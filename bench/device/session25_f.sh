#!/usr/bin/env bash
# (Runs on branch wip/fill-at-receiver with variants/main made from main; kept on main as the record of the run.)
# Session 25 (2 H200), wip/fill-at-receiver against main (variants/main = main's src, bench/device/make_variants
# style: `git archive main src | tar -x -C variants/main`): each rank fetches the rows that fill the holes of the
# peers' copied prefixes once the copy has landed here, instead of the source waiting for its copy to land on the
# peer and pushing them. ep.py at 20 SMs, nvlink_copy_engine, alternating main / branch in separate processes; then
# the GPU tests of dispatches with copies on the branch.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
for v in main branch main branch branch main; do
  if [ $v = main ]; then P=variants/main/src; else P=src; fi
  PYTHONPATH=$P timeout -s KILL 90 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 \
    --copy-shares 1.0 --concurrent-sms >> "$OUT/ep_fill_at_receiver_${v}_session25.log" 2>&1
  echo "$v rc $?"; grep -E "graph, P=|Error" "$OUT/ep_fill_at_receiver_${v}_session25.log" | tail -1 | cut -c1-600; reap
done
PYTHONPATH=src timeout -s KILL 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "match_reference_on_two or in_a_row or replay or copy_engine_backend or pooled_stream" \
  > "$OUT/pytest_fill_at_receiver_session25.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed|Error" "$OUT/pytest_fill_at_receiver_session25.log" | tail -5; reap
