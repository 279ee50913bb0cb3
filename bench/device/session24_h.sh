#!/usr/bin/env bash
# Session 24 (2 H200): the pushed FP8 dispatch ran slower at 24 and 32 SMs than at 20 (as did plain SM pushes at 24
# in nvlink_store_width.py): do fewer warps per program (fewer stores in flight per SM) change that? Plain pushes
# with 8 warps at 16-32 programs, then ep.py (nvlink_copy_engine, FP8 rows by sm) at 20 / 24 SMs with 8, 16 and 4
# warps per program of its kernels.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
PYTHONPATH=src timeout -s KILL 100 python3 bench/nvlink_store_width.py --programs 16 20 24 32 --warps 8 \
  > "$OUT/nvlink_store_width_warps8_session24.log" 2>&1
echo "store width rc $?"; grep -E "^P=|Error" "$OUT/nvlink_store_width_warps8_session24.log"; reap
for w in 8 16 4; do
  PYTHONPATH=src timeout -s KILL 110 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 --reps 30 \
    --copy-shares 1.0 --num-warps $w --concurrent-sms > "$OUT/ep_warps${w}_session24.log" 2>&1
  echo "ep warps $w rc $?"; grep -E "graph, P=|Error" "$OUT/ep_warps${w}_session24.log" | cut -c1-520; reap
done
