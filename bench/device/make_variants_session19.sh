#!/usr/bin/env bash
# Run HERE before session19_b.sh on wip/dynamic-blocks: variants/main = main's src (the combine's sum blocks dealt
# round-robin), to time against the branch's counter in the same lease. Untracked; travels with the working tree.
set -eu
rm -rf variants && mkdir -p variants/main
git archive main src | tar -x -C variants/main
du -sh variants
