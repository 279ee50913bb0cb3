#!/usr/bin/env bash
# Session 37, one H200: bench/moe_overlap.py at one rank (its --world >= 2 check lifted in the device's copy only), its
# new overlapped-equals-serial check in bf16 on the GPU. Run as two device calls: first the DeepSeek-V3 shape (256
# experts, all on the one rank: out of memory), then 64 experts. Logs and the second run's result under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
sed -i 's/    if world < 2:/    if world < 1:/' bench/moe_overlap.py
timeout -s KILL 200 python3 bench/moe_overlap.py --world 1 --comm-sms 20 --iters 3 > $OUT/moe_overlap_world1_d_session37.log 2>&1
echo rc $?; tail -n 8 $OUT/moe_overlap_world1_d_session37.log | cut -c1-300
timeout -s KILL 200 python3 bench/moe_overlap.py --world 1 --comm-sms 20 --iters 3 --experts 64 \
  > $OUT/moe_overlap_world1_e64_d_session37.log 2>&1
echo rc $?; tail -n 8 $OUT/moe_overlap_world1_e64_d_session37.log | cut -c1-300
cp bench/results/moe_overlap_1ranks.json $OUT/ 2>/dev/null; true
# Then (third call, after max_difference in bench/common.py compares 2**24 elements at a time: the out-of-memory was
# its float32 copy of a 28 GiB gradient) the DeepSeek-V3 shape again, two transports:
#   timeout -s KILL 100 python3 bench/moe_overlap.py --world 1 --comm-sms 20 --iters 3 \
#     --transports reference nvlink_copy_engine > $OUT/moe_overlap_world1_e_session37.log 2>&1
# Last (fourth call, the tree with the MoE review's fixes: the overlapped hook's outputs path backward through autograd
# to the tape, piece notes on errors): tests/test_moe.py's GPU test, then 64 experts, two transports:
#   timeout -s KILL 40 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/test_moe.py \
#     > $OUT/pytest_moe_gpu_f_session37.log 2>&1
#   timeout -s KILL 90 python3 bench/moe_overlap.py --world 1 --comm-sms 20 --iters 3 --experts 64 \
#     --transports reference nvlink_copy_engine > $OUT/moe_overlap_world1_e64_f_session37.log 2>&1
