#!/usr/bin/env bash
# Session 39, one H200: session 38's examples (session38_c.sh) and shared-GPU transport (session38_d.sh) runs again on
# the tree that changed after them (review fixes, simplification; the shared-GPU test now takes the 2-GPU test's case
# list, so FP8 input is also moved by a copy engine at 3, 4 and 8 ranks). Logs: $OUT/session39_a_{c,d}_logs.tar.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "tree: $(git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ)"; nvidia-smi -L
t0=$SECONDS; bash bench/device/session38_c.sh; echo "examples: $((SECONDS - t0)) s"
mv "$OUT/session38_c_logs.tar" "$OUT/session39_a_c_logs.tar"
t0=$SECONDS; LIMIT=${LIMIT:-360} bash bench/device/session38_d.sh; echo "shared-GPU transports: $((SECONDS - t0)) s"
mv "$OUT/session38_d_logs.tar" "$OUT/session39_a_d_logs.tar"
true
