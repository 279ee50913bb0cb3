#!/usr/bin/env bash
# Session 36, one H200: compute-sanitizer memcheck over the one-GPU suite, a test file at a time (each bounded).
# Files without CUDA graphs run with PyTorch's caching allocator off, so that an access past a tensor leaves its
# allocation and memcheck sees it. First a check that the sanitizer works on this machine's runtime at all.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$(mktemp -d)
save() { tar -C "$L" -cf "$OUT/session36_b_logs.tar" .; }
uname -r | tee "$L/uname.log"
MC="compute-sanitizer --tool memcheck --target-processes all --report-api-errors no --print-limit 30"
timeout -s KILL 60 $MC python3 -c "import torch; x = torch.randn(4096, device='cuda'); print('sum', (2 * x).sum().item())" \
  > "$L/smoke.log" 2>&1
echo "smoke rc $?"; tail -n 3 "$L/smoke.log"; save
grep -q "ERROR SUMMARY: 0 errors" "$L/smoke.log" || { echo "sanitizer does not run here"; exit 0; }
run() {  # name, bound (s), allocator caching (1: on), pytest file
  local name=$1 bound=$2 caching=$3 file=$4 nocache=1
  [ "$caching" = 1 ] && nocache=0
  local t0=$SECONDS
  PYTORCH_NO_CUDA_MEMORY_CACHING=$nocache timeout -s KILL "$bound" $MC --log-file "$L/mc_${name}_%p.log" \
    python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" "tests/$file" > "$L/pytest_mc_$name.log" 2>&1
  echo "$name rc $? in $((SECONDS - t0)) s: $(tail -n 1 "$L/pytest_mc_$name.log" | cut -c1-150)"
  grep -h "ERROR SUMMARY" "$L"/mc_"${name}"_*.log 2>/dev/null | sort | uniq -c
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; save
}
run layout 90 0 test_ep_layout.py
run fp8 70 0 test_fp8.py
run copy_tma 80 0 test_copy_tma.py
run ep_nvlink 90 1 test_ep_nvlink.py
run launch 40 1 test_launch.py
run trace 40 1 test_trace.py
run budget 40 1 test_budget.py
run autotune 30 0 test_autotune.py
run moe 30 0 test_moe.py
true
