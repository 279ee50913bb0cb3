#!/usr/bin/env bash
# Session 38, one H200: the tree at a1757c6+ (round trips dequantize with smsplit.fp8.dequantize_1x128; ep_buffer.py's
# round trip check): the one-GPU suite; bench/ep.py's one-rank smoke run (its --world >= 2 check lifted in this copy
# only, no figures kept); bench/ep_buffer.py at one rank on every backend at a small shape, its round trips checked.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
save() { tar -C "$L" -cf "$OUT/session38_b_logs.tar" .; }
timeout -s KILL 120 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests > "$L/pytest_one_gpu.log" 2>&1
echo "one-GPU suite rc $?"; tail -n 2 "$L/pytest_one_gpu.log" | cut -c1-200; save
sed -i 's/if args.world < 2 or/if args.world < 1 or/' bench/ep.py
timeout -s KILL 200 python3 bench/ep.py --world 1 --tokens 512 --hidden 2048 --experts 32 --topk 4 --comm-sms 20 \
  --reps 3 --concurrent-rounds 2 --name ep_world1_smoke > "$L/ep_world1_smoke.log" 2>&1
echo "ep.py world 1 smoke rc $?"; grep -E "round trip" "$L/ep_world1_smoke.log" | cut -c1-330
cp bench/results/ep_world1_smoke.json "$L/" 2>/dev/null; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
timeout -s KILL 150 python3 bench/ep_buffer.py --world 1 --tokens 512 --hidden 2048 --experts 32 --topk 4 \
  --reps 3 --queued 2 --profile-calls 2 --profile-top 3 > "$L/ep_buffer_world1.log" 2>&1
echo "ep_buffer.py world 1 rc $?"; grep -iE "round|wrote|mismatch" "$L/ep_buffer_world1.log" | cut -c1-300
cp bench/results/ep_buffer.json "$L/ep_buffer_world1.json" 2>/dev/null; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
true
