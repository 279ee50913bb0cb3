#!/usr/bin/env bash
# (Runs on branch wip/aligned-chunks, which adds combine_chunks_aligned; kept on main as the record of the run.)
# Session 25 (2 H200), wip/aligned-chunks: combine_chunks_aligned off / on at 20 SMs with the default chunks and with a
# last chunk of about 2 rounds (0.4, 0.7, 0.93, 1: aligned, every program sums 2 blocks after the last flag) and of
# about 1 round (0.4, 0.7, 0.95, 1), both orders; then the combine's GPU clock off / on; then the GPU round trip test.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
run_ep() {  # tag, chunks..., --, aligned...
  tag=$1; shift
  PYTHONPATH=src timeout -s KILL 170 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 30 \
    --copy-shares 1.0 --concurrent-sms "$@" > "$OUT/ep_aligned_chunks_${tag}_session25.log" 2>&1
  echo "ep $tag rc $?"; grep -E "graph, P=|Error" "$OUT/ep_aligned_chunks_${tag}_session25.log" | cut -c1-600
  cp bench/results/ep.json "$OUT/ep_aligned_chunks_${tag}_session25.json" 2>/dev/null; reap
}
run_ep a --combine-chunks 0.4,0.7,0.9,1 0.4,0.7,0.93,1 0.4,0.7,0.95,1 --combine-chunks-aligned 0 1
run_ep b --combine-chunks 0.4,0.7,0.95,1 0.4,0.7,0.93,1 0.4,0.7,0.9,1 --combine-chunks-aligned 1 0
PYTHONPATH=src timeout -s KILL 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "match_reference_on_two" > "$OUT/pytest_aligned_chunks_session25.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed" "$OUT/pytest_aligned_chunks_session25.log" | tail -3; reap
PYTHONPATH=src timeout -s KILL 90 python3 bench/ep_timeline.py --comm-sms 20 --calls combine \
  --combine-chunks-aligned 0 1 1 0 --reps 30 > "$OUT/ep_timeline_aligned_chunks_session25.log" 2>&1
echo "timeline rc $?"; grep -E "^P=|Error" "$OUT/ep_timeline_aligned_chunks_session25.log" | cut -c1-300
cp bench/results/ep_timeline.json "$OUT/ep_timeline_aligned_chunks_session25.json" 2>/dev/null; reap
