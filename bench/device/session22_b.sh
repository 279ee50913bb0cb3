#!/usr/bin/env bash
# Next session (2 H200), wip/inert-after-failure, after session22_a.sh passed: (1) the rest of the GPU suite;
# (2) ep.py replayed at 20 SMs (the kernels read one more word at entry), main (variants/main,
# make_variants_session22.sh) and the branch, main, branch, branch, main; (3) ep_buffer.py queued, same order.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests --ignore=tests/test_ep_nvlink.py \
  > "$OUT/pytest_inert_rest_session22.log" 2>&1
echo "rest rc $?"; tail -1 "$OUT/pytest_inert_rest_session22.log" | cut -c1-300; reap
for v in main branch branch main; do
  src=src; [ $v = main ] && src=variants/main/src
  PYTHONPATH=$src timeout -s KILL 80 python3 bench/ep.py --transports nvlink nvlink_copy_engine --comm-sms 20 \
    --reps 30 --copy-shares 1.0 --concurrent-sms > /tmp/ep_run.log 2>&1
  echo "$v ep rc $?"; cat /tmp/ep_run.log >> "$OUT/ep_inert_${v}_session22.log"; grep "graph, P=" /tmp/ep_run.log | cut -c1-300; reap
  PYTHONPATH=$src timeout -s KILL 80 python3 bench/ep_buffer.py --comm-sms 20 --backends nvlink nvlink_copy_engine copy_engine \
    --profile-calls 10 --profile-top 12 --profile-ranks 0 1 > /tmp/ep_buffer_run.log 2>&1
  echo "$v ep_buffer rc $?"; cat /tmp/ep_buffer_run.log >> "$OUT/ep_buffer_inert_${v}_session22.log"
  grep " P=20: " /tmp/ep_buffer_run.log | cut -c1-700; reap
done
