#!/usr/bin/env bash
# Run HERE before session20_a.sh on main: variants/before = main before the header-stream merge (747e7f1^1: the
# Buffer's header all-gather on the current stream after a whole-stream synchronize). Untracked.
set -eu
rm -rf variants && mkdir -p variants/before
git archive 747e7f1^1 src | tar -x -C variants/before
du -sh variants
