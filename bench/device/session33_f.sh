#!/usr/bin/env bash
# Session 33 (one H200): what DeepEP's stream contract (session33_streams.patch, regenerated on main with cheaper stream
# hops) costs an eager cached call's host time: session 32's host probe on main and with the patch, alternating, two
# rounds; the patch's one-GPU stream tests and the one-GPU suite with it. Logs in one tar file under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
P=bench/device/session33_streams.patch
for r in 1 2; do
  for state in main streams; do
    if [ $state = streams ]; then patch -s --no-backup-if-mismatch -p1 < $P; fi
    timeout -s KILL 90 python3 bench/device/session32_host_probe.py > "$L/host_probe_${state}_f${r}_session33.log" 2>&1
    echo "host probe $state round $r rc $?"; grep -E "^nvlink" "$L/host_probe_${state}_f${r}_session33.log" | cut -c1-200
    if [ $state = streams ]; then patch -s -R -p1 < $P; fi
  done
done
patch -s --no-backup-if-mismatch -p1 < $P
timeout -s KILL 120 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests > "$L/pytest_one_gpu_streams_session33.log" 2>&1
echo "one-GPU suite with the patch rc $?"; tail -n 2 "$L/pytest_one_gpu_streams_session33.log"
patch -s -R -p1 < $P
tar -C "$L" -cf "$OUT/session33_f_logs.tar" .
true
