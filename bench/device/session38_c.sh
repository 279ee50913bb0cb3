#!/usr/bin/env bash
# Session 38, one H200: the runnable examples (examples/ep_moe_layer.py with every backend, examples/dualpipev.py)
# on the GPU through tests/test_examples.py (one rank: one GPU), then the CPU cases of that file under torch 2.11.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
save() { tar -C "$L" -cf "$OUT/session38_c_logs.tar" .; }
timeout -s KILL 240 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_examples.py > "$L/pytest_examples_gpu.log" 2>&1
echo "examples on the GPU rc $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$L/pytest_examples_gpu.log" | cut -c1-200; save
for b in nvlink nvlink_copy_engine copy_engine; do
  timeout -s KILL 90 python3 examples/ep_moe_layer.py --device cuda --ranks 1 --backend $b --tokens 512 --hidden 2048 \
    --experts 32 --topk 8 > "$L/ep_moe_layer_$b.log" 2>&1; echo "ep_moe_layer $b rc $?: $(grep '^rank' "$L/ep_moe_layer_$b.log")"
done; save
timeout -s KILL 200 python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/test_examples.py > "$L/pytest_examples_cpu_torch211.log" 2>&1
echo "examples on the CPU, torch 2.11 rc $?"; tail -n 2 "$L/pytest_examples_cpu_torch211.log" | cut -c1-200; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
true
