#!/usr/bin/env bash
# Run HERE before session19_f.sh on wip/header-stream: variants/main = main's src (the header all-gather on the
# current stream after a whole-stream synchronize), the control for the new test and the timing. Untracked.
set -eu
rm -rf variants && mkdir -p variants/main
git archive main src | tar -x -C variants/main
du -sh variants
