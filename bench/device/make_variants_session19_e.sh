#!/usr/bin/env bash
# Run HERE before session19_e.sh on wip/buffer-overhead: variants/main = main's src (headers exchanged by NCCL
# point-to-point messages, polled every 100 us), to time against the branch in the same lease. Untracked.
set -eu
rm -rf variants && mkdir -p variants/main
git archive main src | tar -x -C variants/main
du -sh variants
