#!/usr/bin/env bash
# Session 37, one H200: the session's working tree (the EP autograd/size-check review, the bench review, the demo's
# argument checks): the one-GPU suite; the Buffer rounds and graph workers at one rank; the changed CPU test files
# under torch 2.11; bench/ep.py as a one-rank smoke run (small shape, its --world >= 2 check lifted in this copy only:
# no NVLink at one rank, the run checks that the script's paths run and its results are written; no figures kept).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
save() { tar -C "$L" -cf "$OUT/session37_a_logs.tar" .; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee "$L/versions.log"
timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests > "$L/pytest_one_gpu.log" 2>&1
echo "one-GPU suite rc $?"; tail -n 3 "$L/pytest_one_gpu.log" | cut -c1-200; save
timeout -s KILL 150 python3 bench/device/session34_world1.py nvlink nvlink_copy_engine copy_engine graph \
  > "$L/world1_rounds.log" 2>&1
echo "rounds rc $?"; grep -E "PASSED|FAILED|passed" "$L/world1_rounds.log"; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/test_cli.py tests/test_moe_demo.py \
  tests/test_ep_autograd.py tests/test_ep_dispatch.py tests/test_bench_tables.py > "$L/pytest_changed_cpu.log" 2>&1
echo "changed CPU test files rc $?"; tail -n 3 "$L/pytest_changed_cpu.log" | cut -c1-200; save
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null
sed -i 's/if args.world < 2 or/if args.world < 1 or/' bench/ep.py
timeout -s KILL 200 python3 bench/ep.py --world 1 --tokens 512 --hidden 2048 --experts 32 --topk 4 --comm-sms 20 \
  --reps 3 --concurrent-rounds 1 > "$L/ep_world1_smoke.log" 2>&1
echo "ep.py world 1 smoke rc $?"; tail -n 8 "$L/ep_world1_smoke.log" | cut -c1-250
cp bench/results/ep.json "$L/ep_world1_smoke.json" 2>/dev/null
save
true
