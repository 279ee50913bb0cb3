"""Where a `nvlink_copy_engine` dispatch's or combine's time goes, seen from the GPU clock: when the peer's copy
into this rank starts and when its copy-done flag lands, against when the call's kernels run, replayed from a CUDA
graph on 2 GPUs (DeepSeek-V3 shape), every replay started together (`start_together.py`).

An observer kernel (one warp, on an SM outside the comm budget) is captured after the ranks' device-side barrier,
beside the call: it reads ``%globaltimer`` at its start, spins until the first 16 bytes of the peer's first copied
row here change (poisoned before each replay: the copy has started writing) and then until the peer's last
copy-done flag for the call lands (a dispatch's flag; a combine's last chunk's), reading the clock at each. The
call's kernels record each program's start and end (``TRACE``). Medians over the replays, times after the
observer's start; a time the observer never saw (bounded waits) is reported as missing.

    PYTHONPATH=src python3 bench/ep_timeline.py --comm-sms 20 --calls dispatch_bf16 dispatch_fp8_input combine

Writes bench/results/ep_timeline.json.
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

CALLS = ("dispatch_bf16", "dispatch_fp8_input", "dispatch_fp8", "combine")


@triton.jit
def observe_kernel(probe_ptr, flag_ptr, seen_ptr, out_ptr, timeout_ns, WAIT_FLAG: tl.constexpr):
    """``out[0]``: the clock at the start; ``out[1]``: when the int32 at ``probe_ptr`` is no longer -1 (-1 if never,
    within ``timeout_ns``); ``out[2]``, with WAIT_FLAG: when ``*flag_ptr`` reaches ``*seen_ptr + 1`` (the value the
    call's kernel waits for)."""
    start = ptx.globaltimer()
    tl.store(out_ptr, start)
    target = tl.load(seen_ptr, volatile=True) + 1
    now = ptx.globaltimer()
    while (tl.load(probe_ptr, volatile=True) == -1) & (now - start < timeout_ns):
        now = ptx.globaltimer()
    tl.store(out_ptr + 1, tl.where(now - start < timeout_ns, now, -1))
    if WAIT_FLAG:
        seen = ptx.wait_geq_sys(flag_ptr, target, timeout_ns)
        tl.debug_barrier()
        tl.store(out_ptr + 2, tl.where(seen >= target, ptx.globaltimer(), -1))


def worker(rank, world, port, args, queue):
    dev = join_nccl(rank, world, port)
    from smsplit.ep.nvlink import COPIES_WORD, MAX_CHUNKS
    from smsplit.fp8 import quantize_1x128
    from smsplit.trace import Trace

    inputs = copy_engine_combine_inputs(rank, world, dev, max(args.comm_sms))
    tr, lay, y = inputs.tr, inputs.layout, inputs.y
    x, topk, weights, in_rank, num_local, worst = (inputs.x, inputs.topk, inputs.weights, inputs.in_rank,
                                                   inputs.num_local, inputs.worst)
    xq, xs = quantize_1x128(x)
    peer = (rank + 1) % world
    R, H = world, tr.hidden
    starts = lay.layout[R: 2 * R].tolist()  # where each source's rows start here
    side = torch.cuda.Stream(dev)
    together = StartTogether(dev)
    rows = []
    for P in args.comm_sms:
        tr.num_sms = P
        for name in args.calls:
            x_bytes = 1 if name.startswith("dispatch_fp8") else 2
            if name == "combine":
                chunks = len(tr.combine_chunks)
                probe_off = tr.offsets["cx"] + peer * tr.max_tokens * H * 2
                flag_off = tr.offsets["copied"] + 4 * ((1 + chunks - 1) * R + peer)
                seen = tr.state[COPIES_WORD.value + 1:]
            else:
                probe_off = tr.offsets["x"] + starts[peer] * H * x_bytes
                flag_off = tr.offsets["copied"] + 4 * peer
                seen = tr.state[COPIES_WORD.value:]
            assert flag_off < tr.offsets["copied"] + 4 * (1 + MAX_CHUNKS) * R
            # an FP8 dispatch whose kernel pushes its rows has no copy, so no copy-done flag: its first row's
            # arrival is the kernel's first store there
            has_flag = not (name == "dispatch_fp8" and tr.quantized_rows_by == "sm")
            probe = tr.buffer[probe_off: probe_off + 16].view(torch.int32)
            flag = tr.buffer[flag_off: flag_off + 4].view(torch.int32)
            call = {"dispatch_bf16": lambda trace: tr.dispatch(x, None, topk, weights, in_rank, num_local,
                                                               num_worst_tokens=worst, cached=lay, trace=trace),
                    "dispatch_fp8_input": lambda trace: tr.dispatch(xq, xs, topk, weights, in_rank, num_local,
                                                                    num_worst_tokens=worst, cached=lay, trace=trace),
                    "dispatch_fp8": lambda trace: tr.dispatch(x, None, topk, weights, in_rank, num_local,
                                                              quantize=True, num_worst_tokens=worst, cached=lay,
                                                              trace=trace),
                    "combine": lambda trace: tr.combine(y, None, lay, trace=trace)}[name]
            trace = Trace(dev)
            obs = torch.zeros(3, dtype=torch.int64, device=dev)

            def step():
                together.barrier()  # in the graph: the observer starts as the ranks meet
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    observe_kernel[(1,)](probe, flag, seen, obs, int(2e9), WAIT_FLAG=has_flag, num_warps=1)
                out = call(trace)
                torch.cuda.current_stream().wait_stream(side)
                return out
            step()  # plans, compiles (the eager call's records come first in the trace)
            torch.cuda.synchronize()
            first_graph_slot = trace._used
            graph = capture_graph(step, dev)
            graph_slots = slice(first_graph_slot + (trace._used - first_graph_slot) // 2, trace._used)  # (capture_graph
            # runs step once more before capturing it)
            samples = []
            for event_us in replays_one_at_a_time(graph, rank, args.warmup, args.reps, tr.raise_if_failed,
                                                  before=lambda: probe.fill_(-1)):  # the peer's copy overwrites it
                o = obs.tolist()
                rec = trace.records(reread=True)[graph_slots]
                t0 = o[0]
                samples.append({"event_us": event_us,
                                "copy_start_us": (o[1] - t0) / 1e3 if o[1] > 0 else None,
                                "flag_us": (o[2] - t0) / 1e3 if has_flag and o[2] > 0 else None,
                                "kernel_start_us": (rec[:, 1].min() - t0) / 1e3,
                                "kernel_end_us": (rec[:, 2].max() - t0) / 1e3,
                                "launches": len(rec) // P})
            together.check()

            def median(key):
                seen_values = [s[key] for s in samples if s[key] is not None]
                return statistics.median(seen_values) if seen_values else None
            med = {key: median(key) for key in ("event_us", "copy_start_us", "flag_us", "kernel_start_us",
                                                "kernel_end_us")}
            med["missing"] = sum(s["copy_start_us"] is None or (has_flag and s["flag_us"] is None) for s in samples)
            row = {"rank": rank, "comm_sms": P, "call": name, "launches": samples[0]["launches"], **med}
            if name == "combine":
                row["combine_chunks"] = list(tr.combine_chunks)
            gathered = [None] * world
            dist.all_gather_object(gathered, row)
            rows.extend(gathered)
            if rank == 0:
                for r in gathered:
                    def fmt(v):
                        return "-" if v is None else f"{v:.1f}"
                    print(f"P={P} {name} rank {r['rank']}: replay {fmt(r['event_us'])} us; after the ranks meet: "
                          f"peer's copy starts landing {fmt(r['copy_start_us'])}, its flag {fmt(r['flag_us'])}; "
                          f"kernels ({r['launches']} launches) {fmt(r['kernel_start_us'])} -> "
                          f"{fmt(r['kernel_end_us'])} us; missing {r['missing']}", flush=True)
            del graph
    end_worker(rank, queue, {"rows": rows})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--comm-sms", type=int, nargs="+", default=[20])
    parser.add_argument("--calls", nargs="+", default=list(CALLS), choices=CALLS)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    run_and_write("ep_timeline", worker, args,
                  "one replay at a time, started together; medians; times after the observer kernel's start on "
                  "the same GPU's %globaltimer")


if __name__ == "__main__":
    main()
