#!/usr/bin/env bash
# Session 13, review (2 H200): the benches that now share bench/common.py's max_over_ranks (and copy_chain.py its
# capture_graph) run as before, short; the 2-GPU Buffer test with the shared misaligned-input helper.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
{
timeout 60 python3 -m pytest -m gpu -q -x "tests/test_ep_nvlink.py::test_buffer_nvlink_backend_equals_reference_backend[2048]" 2>&1 | tail -2
timeout 70 python3 bench/copy_chain.py --reps 10 2>&1 | clean | grep -v "^rank" | cut -c1-160 | tail -13
timeout 60 python3 bench/ep_steps.py --comm-sms 20 --steps 8 --kernels combine --reps 10 2>&1 | clean | tail -2
timeout 40 python3 bench/nvlink_link.py --only-pieces --pieces 4 --reps 5 2>&1 | clean | tail -2
timeout 40 python3 bench/copy_engine.py --reps 5 2>&1 | clean | tail -3
timeout 80 python3 bench/ep.py --comm-sms 20 --reps 5 --transports nvlink --concurrent-sms 2>&1 | clean | tail -4
} 2>&1 | tee "$OUT/review_benches_session13.log"
