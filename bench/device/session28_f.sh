#!/usr/bin/env bash
# Session 28 (2 H200), after two reviews. (1) The overflow guard's word now only goes to a source with rows past y's
# (a source that sent none was told too): the overflow tests (both cases) and the graph / pooled-stream tests.
# (2) The soak again, fixed: the comm replayed from a CUDA graph captured on the comm stream (the eager nvlink_copy_engine
# loop was host-paced, its comm stream about 64% busy), alone / with comm / alone, each stream's busy share, the GEMM
# windows from the GPU's events; nvidia-smi sampling every 100 ms (read only).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 250 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ep_nvlink.py \
  -k "num_worst_tokens or pooled or replay_in_a_cuda_graph" > "$OUT/pytest_overflow_sources_session28.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_overflow_sources_session28.log"
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv -lms 100 > "$OUT/smi_soak2_session28.csv" 2> "$OUT/smi2.err" &
SMI=$!; sleep 2
timeout -s KILL 200 python3 bench/ep.py --transports nvlink nvlink_copy_engine --comm-sms 20 --reps 5 \
  --copy-shares 1.0 --concurrent-sms 20 --concurrent-rounds 4 --soak-gemms 1500 > "$OUT/ep_soak2_session28.log" 2>&1
echo "soak rc $?"; sleep 1; kill $SMI
grep "concurrent\|soak\|Error" "$OUT/ep_soak2_session28.log" | cut -c1-600
