#!/usr/bin/env bash
# Session 26, one lease call for both: session26_a.sh (nvlink_fp8_pattern at 20-40 programs, on main) and then
# session26_b.sh (its patch applied to the device copy: the 16-byte e4m3 stores, GPU tests and A/B).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash bench/device/session26_a.sh
bash bench/device/session26_b.sh
