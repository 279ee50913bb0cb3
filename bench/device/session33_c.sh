#!/usr/bin/env bash
# Session 33 (one H200): the final branch (FastLaunch keyed as merged, the host-path trims): Triton's JIT launch
# against FastLaunch and a direct launch; session 32's host probe on main (variants/main/src) and the branch, one round
# each; bench/ep_buffer.py at one rank on the branch; the one-GPU suite and the Buffer workers at one rank.
# Every log goes into one tar file under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
PYTHONPATH=src timeout -s KILL 60 python3 bench/launch_overhead.py > "$L/launch_overhead_c_session33.log" 2>&1
echo "launch_overhead rc $?"; grep "per call" "$L/launch_overhead_c_session33.log"; cp bench/results/launch_overhead.json "$L/launch_overhead_session33.json"
for v in main branch; do
  if [ $v = main ]; then P=variants/main/src; else P=src; fi
  PYTHONPATH=$P timeout -s KILL 90 python3 bench/device/session32_host_probe.py > "$L/host_probe_${v}_c_session33.log" 2>&1
  echo "host probe $v rc $?"; grep -E "^nvlink" "$L/host_probe_${v}_c_session33.log" | cut -c1-200
done
PYTHONPATH=src timeout -s KILL 120 python3 bench/ep_buffer.py --world 1 --backends nvlink nvlink_copy_engine --comm-sms 20 \
  --profile-top 12 > "$L/ep_buffer_world1_c_session33.log" 2>&1
echo "ep_buffer rc $?"; grep -E "P=20" "$L/ep_buffer_world1_c_session33.log" | cut -c1-600
cp bench/results/ep_buffer.json "$L/ep_buffer_world1_session33.json"
export PYTHONPATH=src
timeout -s KILL 100 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests > "$L/pytest_one_gpu_c_session33.log" 2>&1
echo "one-GPU suite rc $?"; tail -n 2 "$L/pytest_one_gpu_c_session33.log"
timeout -s KILL 260 python3 bench/device/session32_world1.py > "$L/world1_tests_c_session33.log" 2>&1
echo "world1 rc $?"; grep -E "FAILED|passed" "$L/world1_tests_c_session33.log" | cut -c1-200
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
tar -C "$L" -cf "$OUT/session33_c_logs.tar" .
true
