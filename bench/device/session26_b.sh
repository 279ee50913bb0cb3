#!/usr/bin/env bash
# (Session 26: run on dcbe10d with the patch applied; merged into main afterwards with 16 as the default, so the patch no longer applies to main.)
# Next session (2 H200), main with bench/device/session26_b.patch applied first (session 25's wip/fp8-wide-stores,
# made on the CPU and never run on a GPU; the branch does not outlive the session, the patch does): an FP8 dispatch that
# quantizes with each thread's 16 adjacent values loaded through L1 and stored as one 16-byte e4m3 vector
# (`NvlinkTransport.e4m3_store_bytes = 16`) against the 8-byte halves, at 20, 32 and 40 comm SMs, both orders; first
# the GPU tests that quantize with it (the two-GPU reference cases 3 and 5: pushed and staged). Worth running if
# session26_a.sh shows the 8-byte halves are what stops the pushed dispatch scaling past 20 SMs.
# (Not covered by those GPU cases: a hidden size that ends in a partial chunk of groups, e.g. 2176; a review on the CPU
# found the masks right. The two patches touch the same files: run each script in its own device call.)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
# (the device runs a copy of the tree: the patch changes only that copy; here: git apply --check first)
patch -p1 --forward < bench/device/session26_b.patch > "$OUT/patch_session26_b.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_session26_b.log"; exit 1; }
timeout -s KILL 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "match_reference_on_two" > "$OUT/pytest_fp8_wide_stores_session26.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed|Error" "$OUT/pytest_fp8_wide_stores_session26.log" | tail -5; reap
for order in "8 16" "16 8"; do
  tag=${order// /_}
  timeout -s KILL 150 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 32 40 --reps 20 \
    --copy-shares 1.0 --concurrent-sms --e4m3-store-bytes $order > "$OUT/ep_fp8_wide_${tag}_session26.log" 2>&1
  echo "ep $order rc $?"; grep -E "graph, P=" "$OUT/ep_fp8_wide_${tag}_session26.log" | \
    grep -o "16-byte stores in\|P=[ 0-9]*: dispatch bf16 *[0-9.]* us, fp8 *[0-9.]* us\|started together: dispatch_bf16 [0-9.]*, dispatch_fp8 [0-9.]*"
  reap
done
