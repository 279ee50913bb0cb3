#!/usr/bin/env bash
# Session 21 (2 H200), wip/async-status: a Buffer call reads its kernels' status words without waiting for the
# previous call's kernels (a timeout is raised by the first call after it). (1) the Buffer GPU tests and the new
# kernel-timeout test on the branch; (2) bench/ep_buffer.py, main (variants/main, make_variants_session21_d.sh)
# and the branch in the order main, branch, branch, main, main, branch; (3) smsplit demo on the branch.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  tests/test_ep_copy_engine.py tests/test_moe.py -k "buffer or kernel_timeout or moe" --durations=0 \
  > "$OUT/pytest_async_status_session21.log" 2>&1
echo "pytest rc $?"; grep -E "passed|failed|Error" "$OUT/pytest_async_status_session21.log" | tail -4 | cut -c1-300; reap
n=0
for v in main branch branch main main branch; do
  n=$((n + 1)); src=src; [ $v = main ] && src=variants/main/src
  echo "=== run $n" >> "$OUT/ep_buffer_async_${v}_session21.log"
  PYTHONPATH=$src timeout -s KILL 90 python3 bench/ep_buffer.py --comm-sms 20 \
    --backends nvlink nvlink_copy_engine copy_engine --profile-calls 10 --profile-top 12 > /tmp/ep_buffer_run.log 2>&1
  echo "$v run $n rc $?"; cat /tmp/ep_buffer_run.log >> "$OUT/ep_buffer_async_${v}_session21.log"
  mkdir -p /tmp/async_json; cp bench/results/ep_buffer.json "/tmp/async_json/ep_buffer_async_${v}_${n}_session21.json"; reap
done
python3 - /tmp/async_json "$OUT/ep_buffer_async_session21.json" <<'PY'
import json, glob, sys, os
keys = ["buffer_dispatch_bf16_cached_queued_ms", "buffer_dispatch_fp8_cached_queued_ms", "buffer_combine_queued_ms",
        "buffer_dispatch_bf16_cached_ms", "buffer_combine_ms", "transport_dispatch_bf16_cached_queued_ms",
        "transport_combine_queued_ms"]
runs = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "ep_buffer_async_*_session21.json")), key=lambda p: int(p.split("_")[-2])):
    data = json.load(open(f))
    runs.append({"run": os.path.basename(f)[16:-15], "result": data})
    for row in data["rows"]:
        print(runs[-1]["run"], row["backend"], " ".join(f"{k[:-3]}={row[k] * 1e3:.0f}" for k in keys))
json.dump(runs, open(sys.argv[2], "w"), indent=1)
PY
PYTHONPATH=src timeout -s KILL 150 python3 -m smsplit demo --out /tmp/demo_as > "$OUT/demo_async_status_session21.log" 2>&1
echo "demo rc $?"; grep -v "^ *$" "$OUT/demo_async_status_session21.log" | tail -2 | cut -c1-200
cp /tmp/demo_as/summary.json "$OUT/demo_async_status_session21.json" 2>/dev/null; reap
