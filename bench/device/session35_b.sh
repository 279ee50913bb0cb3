#!/usr/bin/env bash
# Session 35, one H200: this session's working tree (the infra and moe reviews' fixes, the poison helper in
# tests/test_ep_nvlink.py): the one-GPU suite; the Buffer rounds and graph workers at one rank (the helper's callers);
# _buffer_worker at one rank for each device backend; the grouped_mm probe (CUDA's torch._grouped_mm with no tokens);
# moe_overlap at one rank; the demo on the GPU; the pipeline hooks' host cost on this host. Logs in one tar file.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
save() { tar -C "$L" -cf "$OUT/session35_b_logs.tar" .; }
timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests > "$L/pytest_one_gpu.log" 2>&1
echo "one-GPU suite rc $?"; tail -n 3 "$L/pytest_one_gpu.log" | cut -c1-200; save
timeout -s KILL 40 python3 bench/device/session35_grouped_mm_probe.py > "$L/grouped_mm_probe.log" 2>&1
echo "grouped_mm probe rc $?"; cat "$L/grouped_mm_probe.log" | cut -c1-250; save
timeout -s KILL 30 python3 bench/pipeline_hook_cost.py > "$L/pipeline_hook_cost.log" 2>&1
echo "hook cost rc $?"; cat "$L/pipeline_hook_cost.log"; save
timeout -s KILL 150 python3 bench/device/session34_world1.py nvlink nvlink_copy_engine copy_engine graph \
  > "$L/world1_rounds.log" 2>&1
echo "rounds rc $?"; grep -E "PASSED|FAILED|passed" "$L/world1_rounds.log"; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
timeout -s KILL 100 python3 - > "$L/world1_buffer_worker.log" 2>&1 <<'PY'
import sys, traceback
import torch.multiprocessing as mp
sys.path.insert(0, "tests")
from test_ep_nvlink import _buffer_worker
from smsplit.ep.testing import free_port
for backend in ("nvlink", "nvlink_copy_engine", "copy_engine"):
    try:
        mp.spawn(_buffer_worker, args=(1, free_port(), backend, 2048, 6, "random"), nprocs=1, join=True)
        print("PASSED _buffer_worker", backend, flush=True)
    except Exception:
        print("FAILED _buffer_worker", backend, traceback.format_exc()[-2000:], flush=True)
PY
echo "buffer worker rc $?"; grep -E "PASSED|FAILED" "$L/world1_buffer_worker.log"; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
timeout -s KILL 100 python3 -m smsplit demo --steps 20 --out "$L/demo" > "$L/demo.log" 2>&1
echo "demo rc $?"; tail -n 4 "$L/demo.log" | cut -c1-200; rm -rf "$L/demo"/*.png 2>/dev/null; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
timeout -s KILL 120 python3 bench/moe_overlap.py --world 1 --comm-sms 20 --transports nvlink_copy_engine --iters 3 \
  > "$L/moe_overlap_world1.log" 2>&1
echo "moe_overlap world 1 rc $?"; tail -n 6 "$L/moe_overlap_world1.log" | cut -c1-220; save
true
