"""Where a `nvlink_copy_engine` combine's time goes, seen from the GPU clock: when each chunk's copy-done flag
lands, when the kernel's programs start and end, replayed from a CUDA graph on 2 GPUs (DeepSeek-V3 shape).

The profiler cannot time this chain (its timestamps around stream memory operations are unusable, session 13), so
an observer kernel (one program on an SM outside the comm budget) is captured first in the graph: it reads
``%globaltimer`` at its start, then spins on each chunk's copy-done flag from the peer and reads the clock when
the flag arrives. The combine kernel records each program's start and end (``TRACE``). One replay at a time, the
GPUs idle between (a barrier), as ep.py's "one call" (``--start-together``: a device-side barrier first in the graph,
as ep.py's "started together"); medians over the replays of each time after the observer's
start, and the replay's event time.

Measured (session 14, `bench/results/combine_timeline_session14.log`, `combine_kernel_first_session14.log`): with the
copies queued before the kernel the kernel started 16.5-37.8 us after the observer, queued first 1.1-1.7 us; the
ranks' replays start up to about 140 us apart after the host barrier (the peer's flags land that much later on one rank).

    PYTHONPATH=src python3 bench/combine_timeline.py --comm-sms 20 24 --combine-chunks 0.5,0.8,1

Writes bench/results/combine_timeline.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (capture_graph, copy_engine_combine_inputs, end_worker, join_nccl, replays_one_at_a_time,  # noqa: E402
                    run_and_write)
from start_together import StartTogether  # noqa: E402

from smsplit import ptx  # noqa: E402


@triton.jit
def observe_kernel(flags_ptr, seen_ptr, out_ptr, peer, R, timeout_ns, CHUNKS: tl.constexpr):
    """``out[0]``: the clock at the start; ``out[1 + c]``: when chunk c's flag from ``peer`` reaches the value the
    combine waits for (the copy-done counter seen so far + 1)."""
    tl.store(out_ptr, ptx.globaltimer())
    target = tl.load(seen_ptr, volatile=True) + 1
    for c in tl.static_range(CHUNKS):
        ptx.wait_geq_sys(flags_ptr + c * R + peer, target, timeout_ns)
        tl.debug_barrier()
        tl.store(out_ptr + 1 + c, ptx.globaltimer())


def worker(rank, world, port, args, queue):
    dev = join_nccl(rank, world, port)
    from smsplit.ep.nvlink import COPIES_WORD, MAX_CHUNKS
    from smsplit.trace import Trace

    inputs = copy_engine_combine_inputs(rank, world, dev, max(args.comm_sms))
    tr, lay, y = inputs.tr, inputs.layout, inputs.y
    peer = (rank + 1) % world
    off = tr.offsets["copied"] + 4 * world
    flags = tr.buffer[off:off + 4 * MAX_CHUNKS * world].view(torch.int32)  # chunk c's flag from d: word c * R + d
    seen = tr.state[COPIES_WORD.value + 1:]
    side = torch.cuda.Stream(dev)
    start_together = StartTogether(dev) if args.start_together else None
    rows = []
    for P in args.comm_sms:
        tr.num_sms = P
        for chunks in args.combine_chunks:
            tr.combine_chunks = chunks
            tr.combine(y, None, lay)  # plans this layout's copies for these chunks
            torch.cuda.synchronize()
            trace = Trace(dev)
            obs = torch.zeros(1 + len(chunks), dtype=torch.int64, device=dev)

            def step():
                if start_together is not None:  # in the graph: the observer starts as the ranks meet
                    start_together.barrier()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    observe_kernel[(1,)](flags, seen, obs, peer, world, int(2e9), CHUNKS=len(chunks), num_warps=1)
                out, _ = tr.combine(y, None, lay, trace=trace)
                torch.cuda.current_stream().wait_stream(side)
                return out
            graph = capture_graph(step, dev)
            samples = []
            for event_us in replays_one_at_a_time(graph, rank, args.warmup, args.reps, tr.raise_if_failed):
                o = obs.tolist()
                rec = trace.records(reread=True)
                rec = rec[-P:]  # this replay's combine programs (the graph writes the same slots each time)
                t0 = o[0]
                samples.append({"event_us": event_us,
                                "flags_us": [(f - t0) / 1e3 for f in o[1:]],
                                "kernel_start_us": (min(r[1] for r in rec) - t0) / 1e3,
                                "kernel_end_us": (max(r[2] for r in rec) - t0) / 1e3,
                                "program_end_spread_us": (max(r[2] for r in rec) - min(r[2] for r in rec)) / 1e3})
            med = {"event_us": statistics.median(s["event_us"] for s in samples),
                   "flags_us": [statistics.median(s["flags_us"][c] for s in samples) for c in range(len(chunks))],
                   "kernel_start_us": statistics.median(s["kernel_start_us"] for s in samples),
                   "kernel_end_us": statistics.median(s["kernel_end_us"] for s in samples),
                   "program_end_spread_us": statistics.median(s["program_end_spread_us"] for s in samples)}
            if start_together is not None:
                start_together.check()
            med["tail_after_last_flag_us"] = med["kernel_end_us"] - med["flags_us"][-1]
            row = {"rank": rank, "comm_sms": P, "combine_chunks": chunks, **med}
            gathered = [None] * world
            dist.all_gather_object(gathered, row)
            rows.extend(gathered)
            if rank == 0:
                for r in gathered:
                    print(f"P={P} chunks {chunks} rank {r['rank']}: replay {r['event_us']:.1f} us; after the observer's "
                          f"start: kernel {r['kernel_start_us']:.1f} -> {r['kernel_end_us']:.1f} us (programs end "
                          f"within {r['program_end_spread_us']:.1f}), flags "
                          + " / ".join(f"{f:.1f}" for f in r["flags_us"])
                          + f", tail after the last flag {r['tail_after_last_flag_us']:.1f} us", flush=True)
            del graph
    end_worker(rank, queue, {"rows": rows})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--comm-sms", type=int, nargs="+", default=[20])
    parser.add_argument("--combine-chunks", type=lambda text: tuple(float(f) for f in text.split(",")), nargs="+",
                        default=[(0.5, 0.8, 1.0)], help="increasing fractions ending with 1 (e.g. 0.4,0.7,0.9,1)")
    parser.add_argument("--start-together", action="store_true",
                        help="each replay after a device-side barrier (start_together.py): no rank skew")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    run_and_write("combine_timeline", worker, args,
                  "one replay at a time; medians; times after the observer "
                  "kernel's start on the same GPU's %globaltimer")


if __name__ == "__main__":
    main()
