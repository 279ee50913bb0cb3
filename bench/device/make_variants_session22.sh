#!/usr/bin/env bash
# Run HERE before session22_b.sh on wip/inert-after-failure: variants/main = main's src, to time against the
# branch in the same lease.
set -eu
rm -rf variants && mkdir -p variants/main
git archive main src | tar -x -C variants/main
du -sh variants
