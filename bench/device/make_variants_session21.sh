#!/usr/bin/env bash
# Run HERE before session21_c.sh on wip/kernel-bump: variants/main = main's src (the dispatch copy-done counter
# bumped by a kernel on the copy stream after the chain), to time against the branch in the same lease.
set -eu
rm -rf variants && mkdir -p variants/main
git archive main src | tar -x -C variants/main
du -sh variants
