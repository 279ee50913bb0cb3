#!/usr/bin/env bash
# The FP8 dispatch's quantize loop with its chunks unrolled (NvlinkTransport.unroll_quantize, NG a constant of the
# kernel: no registers carried between chunks, unmasked loads of valid rows, constant address offsets; 1823 SASS
# instructions per 16-token step against about 2520 with the loop, compiled on the CPU). One GPU first: the pushing
# launch alone (fp8_stage.py --push), loop against unrolled at 20 / 24 / 32 programs, and ncu of both at 20 (issue
# rate, stalls: is the loop issue-bound?); then ep.py on 2 GPUs, loop (0) against unrolled (1), in both orders.
# (Ran from the branch that session30_unroll.patch holds, before its AHEAD option, whose default 1 is this code;
# from main the script applies it.)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
patch -p1 --forward --no-backup-if-mismatch < bench/device/session30_unroll.patch > "$OUT/patch_session30_unroll.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_session30_unroll.log"; exit 1; }
timeout -s KILL 150 python3 bench/fp8_stage.py --push --programs 20 24 32 --steps 16 --warps 16 --unroll 0 1 \
  > "$OUT/fp8_push_unroll_session30.log" 2>&1
echo "fp8_stage rc $?"; grep "P=" "$OUT/fp8_push_unroll_session30.log"; cp bench/results/fp8_stage_push.json "$OUT/" 2>/dev/null
for u in 0 1; do
  timeout -s KILL 150 ncu --section SpeedOfLight --section SchedulerStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section InstructionStats -k regex:dispatch_kernel --launch-skip 3 --launch-count 1 \
    python3 bench/fp8_stage.py --once --push --programs 20 --steps 16 --warps 16 --unroll $u \
    > "$OUT/fp8_push_ncu_unroll${u}_session30.txt" 2>&1
  echo "ncu unroll $u rc $?"
  grep -E "Duration|Issued Warp|No Eligible|L1/TEX Cache Throughput|Executed Ipc A|Warp Cycles Per Issued|Executed Instructions  " \
    "$OUT/fp8_push_ncu_unroll${u}_session30.txt"
done
run() {  # tag, unroll values in order
  timeout -s KILL 100 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 24 32 --reps 30 \
    --copy-shares 1.0 --concurrent-sms --unroll-quantize $2 > "$OUT/ep_unroll_$1_session30.log" 2>&1
  echo "ep $1 rc $?"
  grep "CUDA graph" "$OUT/ep_unroll_$1_session30.log" | sed 's/.*stage 4 FP8 rows by sm//; s/ dispatch bf16 .*fp8 \+\([0-9.]*\) us (FP8 input \([0-9.]*\)).*round trip equal: \({[^}]*}\).*queued: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*together: dispatch_bf16 [0-9.]*, dispatch_fp8 \([0-9.]*\).*/ fp8 \1 queued \4 together \5 equal \3/' | cut -c1-200
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
}
run ab "0 1"
run ba "1 0"
