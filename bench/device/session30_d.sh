#!/usr/bin/env bash
# One GPU: the FP8 dispatch's pushing launch alone (fp8_stage.py --push), more bytes in flight per SM: the unrolled
# quantize loop loading 1 or 2 chunks ahead (--unroll 1 / 2; 0: main's loop), at 16 or 8 tokens a step and 4, 8 or
# 16 groups a chunk (bytes in flight per SM: 512 threads x 32 B x elements per thread x chunks ahead; registers
# stay at the 128 of 512 threads). Session 30's ncu: the loop waits on L1TEX (long scoreboard 44% of the cycles
# between issues) at 0.56 instructions per scheduler-cycle, unrolled. (Ran from the branch session30_unroll.patch
# holds, on a one-GPU machine; from main the script applies it.)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
patch -p1 --forward --no-backup-if-mismatch < bench/device/session30_unroll.patch > "$OUT/patch_session30_unroll.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_session30_unroll.log"; exit 1; }
go() {  # tag, args
  timeout -s KILL 200 python3 bench/fp8_stage.py --push --programs 20 24 32 --warps 16 $2 > "$OUT/fp8_push_$1_session30.log" 2>&1
  echo "$1 rc $?"; grep "push_fp8" "$OUT/fp8_push_$1_session30.log"
}
go tb16 "--steps 16 --groups 8 --unroll 0 1 2"
go tb8 "--steps 8 --groups 8 16 --unroll 0 1 2"
go tb16qg4 "--steps 16 --groups 4 --unroll 1 2"
