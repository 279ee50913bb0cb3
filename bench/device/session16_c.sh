#!/usr/bin/env bash
# Session 16, the A/B runs after session16_b.sh (2 H200, one lease, run as separate calls): the dispatch gate's cost.
# Variants (untracked trees that travel with the working tree), built on this machine first:
#   git archive 8129cd8 src bench tests | tar -x -C variants/pregate     # main before the gate
#   git archive 519752a src bench tests | tar -x -C variants/gate        # main with the gate
#   variants/nowait: variants/gate with NvlinkTransport._copy_start skipping the dispatch's (counter 0) waits and
#     resets (measurement only: unsafe)
#   variants/nofence: variants/gate with the resets written with CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER
#   ".": branch wip/two-areas (two receive areas)
# Logs: ep_gate_vs_pregate_session16.log, ep_gate_vs_no_copy_wait_session16.log,
# ep_two_areas_gate_nowait_session16.log, ep_gate_vs_unfenced_reset_session16.log (those runs kept only the lines of
# the graph replays, and NCCL in the second; the last ran with a 60 s limit).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ab() {  # ab LOG TRANSPORTS VARIANT...: bench/ep.py at 20 SMs for each variant in turn
  local log=$1 transports=$2; shift 2
  for v in "$@"; do
    echo "== $v"; d=variants/$v; [ "$v" = two_areas ] && d=.
    (cd "$d" && PYTHONPATH=src timeout -s KILL 100 python3 bench/ep.py --transports $transports --comm-sms 20 \
      --reps 50 --copy-shares 1.0 2>&1 | grep -v -i "warn\|symm_mem")
    pkill -9 -f "multiprocessing[.]spawn"; sleep 1
  done 2>&1 | tee "$OUT/$log"
}
ab ep_gate_vs_pregate_session16.log "nvlink nvlink_copy_engine" pregate gate pregate gate
ab ep_gate_vs_no_copy_wait_session16.log nvlink_copy_engine nowait gate nowait gate
ab ep_two_areas_gate_nowait_session16.log nvlink_copy_engine two_areas gate nowait two_areas gate nowait
ab ep_gate_vs_unfenced_reset_session16.log nvlink_copy_engine nofence gate nofence gate
