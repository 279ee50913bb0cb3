#!/usr/bin/env bash
# Is the FP8 staging launch bound by the bytes it writes? Today it writes each token's e4m3 row twice (this rank's
# own receive row and the peer's staged row: 58.7 MB read, ~59 MB written at 4096 x 7168). `--peer-only` routes no
# token to this rank, so each row is written once (~29 MB): if the launch takes ~3/4 of the time, a staging launch
# that writes each row once and lets the copy engines make the own rows too (a local copy, as the peers' copies)
# is worth building. One GPU, 20 / 24 programs, two rounds alternating.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
for r in 1 2; do
  for flag in "" --peer-only; do
    timeout 60 python3 bench/fp8_stage.py --programs 20 24 --steps 16 --groups 8 --warps 16 $flag 2>&1 \
      | grep "fp8\|copy" | sed "s/^/${flag:-both} /"
  done
done
