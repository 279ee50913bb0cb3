#!/usr/bin/env bash
# Session 26 (2 H200), the tree with 16-byte e4m3 stores by default (session26_b.patch merged: faster at 20, 32 and
# 40 SMs in both orders) and the opt-in `NvlinkTransport.scales_after_row`: a token's 224 bytes of scales sent once,
# after its row, in 16-byte vectors, instead of each chunk's 8 scales as 4-byte stores by 8 threads (about 57k
# 16-byte writes per rank across NVLink for 4080 rows, as many write requests as the rows' 512-byte ones). First the
# GPU reference test (case 3 with scales after the row, case 5 with the 8-byte halves), then ep.py at 20 and 32 SMs,
# both orders, then the FP8 dispatch on the GPU clock at 20 / 32 / 40 SMs with the new default.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
timeout -s KILL 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py --durations=0 \
  -k "match_reference_on_two" > "$OUT/pytest_scales_after_row_session26.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed|Error" "$OUT/pytest_scales_after_row_session26.log" | tail -5; reap
for order in "0 1" "1 0"; do
  tag=${order// /_}
  timeout -s KILL 150 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 32 --reps 30 \
    --copy-shares 1.0 --concurrent-sms --scales-after-row $order > "$OUT/ep_scales_after_row_${tag}_session26.log" 2>&1
  echo "ep $order rc $?"; grep -E "graph, P=" "$OUT/ep_scales_after_row_${tag}_session26.log" | \
    grep -o "scales after the row\|P=[ 0-9]*: dispatch bf16 *[0-9.]* us, fp8 *[0-9.]* us\|queued: dispatch_bf16 [0-9.]*, dispatch_fp8 [0-9.]*\|started together: dispatch_bf16 [0-9.]*, dispatch_fp8 [0-9.]*"
  reap
done
timeout -s KILL 150 python3 bench/ep_timeline.py --comm-sms 20 32 40 --calls dispatch_fp8 --reps 30 \
  > "$OUT/ep_timeline_fp8_wide_session26.log" 2>&1
echo "timeline rc $?"; grep "P=" "$OUT/ep_timeline_fp8_wide_session26.log"; cp bench/results/ep_timeline.json "$OUT/ep_timeline_fp8_wide_session26.json"
reap
