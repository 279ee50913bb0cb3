#!/usr/bin/env bash
# Session 37, one H200: the tree with the EP autograd follow-ups (outputs require grad only from their own inputs)
# and the benchmarks' result checks: the one-GPU suite; bench/moe_overlap.py at one rank with every device transport
# (its new overlapped-equals-serial check in bf16 on the GPU); the changed CPU test files under torch 2.11.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
save() { tar -C "$L" -cf "$OUT/session37_c_logs.tar" .; }
timeout -s KILL 120 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests > "$L/pytest_one_gpu.log" 2>&1
echo "one-GPU suite rc $?"; tail -n 2 "$L/pytest_one_gpu.log" | cut -c1-200; save
timeout -s KILL 150 python3 bench/moe_overlap.py --world 1 --comm-sms 20 --iters 3 > "$L/moe_overlap_world1.log" 2>&1
echo "moe_overlap world 1 rc $?"; tail -n 6 "$L/moe_overlap_world1.log" | cut -c1-260
cp bench/results/moe_overlap_1ranks.json "$L/" 2>/dev/null; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
timeout -s KILL 120 python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/test_ep_autograd.py \
  tests/test_bench_checks.py tests/test_bench_tables.py > "$L/pytest_changed_cpu.log" 2>&1
echo "changed CPU test files rc $?"; tail -n 2 "$L/pytest_changed_cpu.log" | cut -c1-200; save
true
