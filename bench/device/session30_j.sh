#!/usr/bin/env bash
# One GPU: the quantization's two divisions without div.rn's check and slow path (`ptx.e4m3_scales_of_bf16`,
# session30_scales.patch, applied to session30_split_unroll.patch's tree for this run): checked against div.rn for
# every bf16 magnitude, then the FP8
# dispatch's pushing launch alone (fp8_stage.py --push, main's loop (0) and unrolled 2 ahead (2)) with the new
# scales against the tree before it (ab_old_src/, a copy of src/ taken for this run), alternating, two rounds.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTHONPATH=src timeout -s KILL 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ptx.py tests/test_fp8.py \
  -k "not landed" > "$OUT/pytest_scales_session30.log" 2>&1
echo "pytest rc $?"; tail -2 "$OUT/pytest_scales_session30.log"
i=0
for v in new old new old; do
  i=$((i + 1))
  if [ $v = new ]; then P=src; else P=ab_old_src; fi
  PYTHONPATH=$P timeout -s KILL 150 python3 bench/fp8_stage.py --push --programs 20 24 32 --steps 16 --warps 16 \
    --unroll 0 2 > "$OUT/fp8_push_scales_${i}_${v}_session30.log" 2>&1
  echo "$i $v rc $?"; grep push_fp8 "$OUT/fp8_push_scales_${i}_${v}_session30.log" | sed 's/ warps=16 QG=8//; s/ push_fp8//'
done
