#!/usr/bin/env bash
# Session 9, third lease: FP8 staging launches ending on whole rounds of the programs (nvlink._stage_bounds) at
# 2 / 3 / 4 / 6 launches, the combine's new default chunks (0.5, 0.8, 1), the combine with the SMs pushing the last
# 10 / 20% of each source's rows, a profile of the staged FP8 dispatch + combine; the NVLink GPU tests first.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_ep_nvlink.py tests/test_fp8.py 2>&1 | clean \
  > "$OUT/pytest_nvlink_session9_c.log"; tail -2 "$OUT/pytest_nvlink_session9_c.log"
timeout 150 python3 bench/ep.py --comm-sms 20 24 --reps 20 --transports nvlink_copy_engine --copy-shares 1.0 \
  --stage-chunks 2 3 4 6 2>&1 | clean > "$OUT/ep_stage_chunks.log"; grep "graph" "$OUT/ep_stage_chunks.log"
cp bench/results/ep.json "$OUT/ep_stage_chunks.json"
for share in 0.9 0.8; do
  timeout 80 python3 bench/ep.py --comm-sms 20 --reps 20 --transports nvlink_copy_engine --copy-shares 1.0 \
    --combine-copy-share $share 2>&1 | clean > "$OUT/ep_combine_share_$share.log"
  grep "graph" "$OUT/ep_combine_share_$share.log" | sed "s/^/combine share $share: /"
done
timeout 90 python3 bench/ep_profile.py --transport nvlink_copy_engine --sms 20 --fp8 --graph --out "$OUT/prof" 2>&1 \
  | clean > "$OUT/ep_profile_fp8_staged_session9.log"; head -40 "$OUT/ep_profile_fp8_staged_session9.log"
rm -f "$OUT"/prof/trace_*.json
