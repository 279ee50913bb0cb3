#!/usr/bin/env bash
# Session 10: the FP8 staging launches of `nvlink_copy_engine` in other splits than `_stage_bounds`'s near-equal
# ranges (the copy of each range runs beside the next launch, so the copy of the last range is the tail), and
# copy_share 0.9 / 0.95 (the last launch pushes the tokens past the staged rounds itself), 20 SMs. Before the run,
# here: `bash bench/device/session10_taper.sh prepare` makes variants/taper (main's tree, `_stage_bounds` reading
# SMSPLIT_STAGE_ROUNDS: the launches' sizes in rounds, the rest last; benchmark only, not in the library).
set -u
if [ "${1:-}" = prepare ]; then
  rm -rf variants/taper && mkdir -p variants/taper && git archive main src bench tests | tar -x -C variants/taper
  python3 - <<'PY'
p = 'variants/taper/src/smsplit/ep/nvlink.py'
s = open(p).read()
head = 'def _stage_bounds(num_tokens: int, chunks: int, round_tokens: int) -> list[int]:\n'
s = s.replace(head, head + '''    import os
    sizes = os.environ.get("SMSPLIT_STAGE_ROUNDS")
    if sizes:
        bounds, acc = [0], 0
        for r in sizes.split(","):
            acc += int(r) * round_tokens
            if acc < num_tokens:
                bounds.append(acc)
        return bounds + [num_tokens]
''', 1)
open(p, 'w').write(s)
PY
  exit 0
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
clean() { grep -v -i "warn\|symm_mem"; }
for rounds in "" 4,4,3 4,3,3,2 5,4,2 4,3,2,2,1 3,3,3,2; do
  SMSPLIT_STAGE_ROUNDS=$rounds PYTHONPATH=variants/taper/src timeout 100 python3 variants/taper/bench/ep.py \
    --comm-sms 20 --reps 50 --transports nvlink_copy_engine --copy-shares 1.0 2>&1 | clean > "$OUT/ep_taper.log"
  grep "graph" "$OUT/ep_taper.log" | sed "s/^/rounds=$rounds /"
done
for share in 0.9 0.95; do
  PYTHONPATH=variants/taper/src timeout 100 python3 variants/taper/bench/ep.py --comm-sms 20 --reps 50 \
    --transports nvlink_copy_engine --copy-shares $share 2>&1 | clean > "$OUT/ep_share.log"
  grep "graph" "$OUT/ep_share.log" | sed "s/^/share=$share /"
done
