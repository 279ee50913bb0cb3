#!/usr/bin/env bash
# For the next lease (one H200 or two): session34_prefix.patch, the handle's rank_prefix_matrix summed from the
# device count matrix between the notify and the dispatch kernel (the captured path summed it after the dispatch
# kernel, which lets a peer's next notify overwrite its row first; eager calls made it from the host counts with a
# host-to-device copy). With the patch: the rounds worker (which compares rank_prefix_matrix with the reference's) and
# the Buffer graph worker (which compares the captured one) at one rank, the phase probe of an uncached dispatch,
# main against the patch, alternating, two rounds; then on 2 GPUs the rounds and Buffer graph tests at two ranks,
# on one the one-GPU suite. Logs in one tar file, made after each step. Reverts the patch at the end.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
P=bench/device/session34_prefix.patch
rm -rf variants && mkdir -p variants/main && cp -r src variants/main/
patch -s --no-backup-if-mismatch -p1 < $P
export PYTHONPATH=src
timeout -s KILL 150 python3 bench/device/session34_world1.py nvlink nvlink_copy_engine copy_engine graph \
  > "$L/world1_rounds_prefix.log" 2>&1
echo "rounds rc $?"; grep -E "PASSED|FAILED|passed" "$L/world1_rounds_prefix.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
for r in 1 2; do
  for v in main prefix; do
    src=src; [ $v = main ] && src=variants/main/src
    PYTHONPATH=$src timeout -s KILL 40 python3 bench/device/session34_uncached_phases.py --backends nvlink \
      > "$L/uncached_phases_${v}_c${r}.log" 2>&1
    echo "$v c$r rc $?"; grep "uncached dispatch" "$L/uncached_phases_${v}_c${r}.log" | cut -c1-190
  done
done
tar -C "$L" -cf "$OUT/session34_c_logs.tar" .
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout -s KILL 200 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_ep_nvlink.py \
    -k "rounds or buffer_dispatch_and_combine_replay or copy_engine_replays" > "$L/pytest_prefix_2gpu.log" 2>&1
  echo "2-GPU tests rc $?"; grep -E "PASSED|FAILED|ERROR" "$L/pytest_prefix_2gpu.log" | cut -c1-160
else
  timeout -s KILL 100 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests > "$L/pytest_one_gpu_prefix.log" 2>&1
  echo "one-GPU suite rc $?"; tail -n 1 "$L/pytest_one_gpu_prefix.log"
fi
tar -C "$L" -cf "$OUT/session34_c_logs.tar" .
patch -s -R --no-backup-if-mismatch -p1 < $P; rm -rf variants
true
