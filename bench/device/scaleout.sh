#!/usr/bin/env bash
# Issue #6 on a 4- or 8-GPU machine (nvidia-h200-x4 / -x8): the four parts, in order. A device call may run 600 s at
# most and the parts' limits add up to more: run each in a call of its own, `bash bench/device/scaleout_a.sh` (EP
# benchmark), `_b.sh` (register spills priced), `_c.sh` (pipelines), `_d.sh` (Buffer, MoE overlap). This script runs
# them back to back where no such limit applies.
set -u
for part in a b c d; do
  bash "$(dirname "$0")/scaleout_${part}.sh"
done
