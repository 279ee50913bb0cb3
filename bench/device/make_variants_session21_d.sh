#!/usr/bin/env bash
# Run HERE before session21_d.sh on wip/async-status: variants/main = main's src (each Buffer call waits for the
# previous call's kernels before reading their status), to time against the branch in the same lease.
set -eu
rm -rf variants && mkdir -p variants/main
git archive main src | tar -x -C variants/main
du -sh variants
