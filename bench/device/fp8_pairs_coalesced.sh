#!/usr/bin/env bash
# First GPU run of wip/fp8-pairs-coalesced: each thread of a group loads vectors j and j + 8 (every load of a warp
# reads whole 128-byte runs; adjacent vectors per thread use half of each 32-byte sector a load touches) and stores
# its e4m3 bytes as two 8-byte halves. Against main in the same run: before the run, here:
#   rm -rf base && mkdir base && git archive main src bench | tar -x -C base
# Bit-for-bit tests (bf16 / fp32 / fp16 x), the 2-GPU dispatch tests, the staging launch and the lean loop alone,
# ep.py at 20 / 24 SMs. Merge only if every test passes and FP8 is faster.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
for tree in base .; do
  name=$([ "$tree" = base ] && echo main || echo coalesced)
  PYTHONPATH=$tree/src timeout 40 python3 $tree/bench/fp8_stage.py --programs 20 --steps 16 --groups 8 --warps 16 2>&1 \
    | grep fp8 | sed "s/^/$name /"
  PYTHONPATH=$tree/src timeout 40 python3 $tree/bench/fp8_rows.py --programs 20 --steps 16 --groups 8 --warps 16 \
    --stages 2>&1 | grep -v -i warn | sed "s/^/$name /"
done
export PYTHONPATH=src
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_fp8.py 2>&1 | tail -1
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
  "tests/test_ep_nvlink.py::test_nvlink_dispatch_combine_match_reference_on_two_gpus" \
  "tests/test_ep_nvlink.py::test_buffer_nvlink_backend_equals_reference_backend" \
  "tests/test_ep_nvlink.py::test_buffer_nvlink_copy_engine_backend_equals_reference_backend" 2>&1 | clean \
  > "$OUT/pytest_nvlink.log"; tail -1 "$OUT/pytest_nvlink.log"
for tree in base .; do
  name=$([ "$tree" = base ] && echo main || echo coalesced)
  PYTHONPATH=$tree/src timeout 80 python3 $tree/bench/ep.py --comm-sms 20 24 --reps 20 --transports nvlink \
    nvlink_copy_engine --copy-shares 1.0 --concurrent-sms 2>&1 | clean > "$OUT/ep_$name.log"
  grep "graph" "$OUT/ep_$name.log" | sed "s/^/$name /"
done
