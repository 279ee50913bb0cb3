#!/usr/bin/env bash
# Session 39, one H200: the transports' all-gather through smsplit.ep.transport.all_gather_into_tensor (torch 2.13's
# all_gather_single where torch has it): the one-GPU suite (the shared-GPU tests at 3 ranks only: the rest ran in
# session39_a.sh on the tree before), bench/ep_buffer.py at one rank on every backend (NCCL header exchange).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
save() { tar -C "$L" -cf "$OUT/session39_b_logs.tar" .; }
echo "device copy: HEAD $(git rev-parse --short HEAD 2>/dev/null), changed files:"; git status --short 2>/dev/null | head -20
python3 -c "import torch, torch.distributed as d; print('torch', torch.__version__, 'all_gather_single:', hasattr(d, 'all_gather_single'))"
timeout -s KILL 330 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" -k "not more_ranks_than_gpus" \
  tests > "$L/pytest_one_gpu.log" 2>&1
echo "one-GPU suite rc $?"; tail -n 2 "$L/pytest_one_gpu.log" | cut -c1-200; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
timeout -s KILL 100 python3 -m pytest -q -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "more_ranks_than_gpus and (nvlink-3 or copy_engine-3)" > "$L/pytest_ranks_on_one_gpu_3.log" 2>&1
echo "shared-GPU tests at 3 ranks rc $?"; tail -n 1 "$L/pytest_ranks_on_one_gpu_3.log" | cut -c1-200; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
timeout -s KILL 120 python3 bench/ep_buffer.py --world 1 --tokens 512 --hidden 2048 --experts 32 --topk 4 \
  --reps 3 --queued 2 --profile-calls 2 --profile-top 3 > "$L/ep_buffer_world1.log" 2>&1
echo "ep_buffer.py world 1 rc $?"; grep -iE "round|wrote|mismatch|warn" "$L/ep_buffer_world1.log" | cut -c1-300
cp bench/results/ep_buffer.json "$L/ep_buffer_world1.json" 2>/dev/null; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
true
