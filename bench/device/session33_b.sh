#!/usr/bin/env bash
# Session 33 (one H200): main (variants/main/src, the tree at session 33's start) against the branch (src: FastLaunch
# and the host-path trims), alternating, two rounds: session 32's host probe and bench/ep_buffer.py at one rank
# (one call at a time and queued); Triton's JIT launch against FastLaunch and a direct launch (launch_overhead.py);
# the one-GPU suite and the Buffer workers at one rank on the branch.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTHONPATH=src timeout -s KILL 60 python3 bench/launch_overhead.py > "$OUT/launch_overhead_session33.log" 2>&1
echo "launch_overhead rc $?"; cat "$OUT/launch_overhead_session33.log" | grep "per call"; cp bench/results/launch_overhead.json "$OUT/launch_overhead_session33.json"
for r in 1 2; do
  for v in main branch; do
    if [ $v = main ]; then P=variants/main/src; else P=src; fi
    PYTHONPATH=$P timeout -s KILL 90 python3 bench/device/session32_host_probe.py > "$OUT/host_probe_${v}_r${r}_session33.log" 2>&1
    echo "host probe $v round $r rc $?"; grep -E "^nvlink" "$OUT/host_probe_${v}_r${r}_session33.log" | cut -c1-200
    PYTHONPATH=$P timeout -s KILL 120 python3 bench/ep_buffer.py --world 1 --backends nvlink nvlink_copy_engine --comm-sms 20 \
      --profile-top 12 > "$OUT/ep_buffer_world1_${v}_r${r}_session33.log" 2>&1
    echo "ep_buffer $v round $r rc $?"; grep -E "P=20" "$OUT/ep_buffer_world1_${v}_r${r}_session33.log" | cut -c1-400
    cp bench/results/ep_buffer.json "$OUT/ep_buffer_world1_${v}_r${r}_session33.json" 2>/dev/null
  done
done
export PYTHONPATH=src
timeout -s KILL 100 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests > "$OUT/pytest_one_gpu_b_session33.log" 2>&1
echo "one-GPU suite rc $?"; tail -n 3 "$OUT/pytest_one_gpu_b_session33.log"
timeout -s KILL 300 python3 bench/device/session32_world1.py > "$OUT/world1_tests_b_session33.log" 2>&1
echo "world1 rc $?"; grep -E "FAILED|passed" "$OUT/world1_tests_b_session33.log" | cut -c1-200
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
