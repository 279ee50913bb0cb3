"""One copy-engine (or nvlink) dispatch + combine on 2 GPUs under the torch profiler: every kernel and copy with
its stream, start and duration, relative to the first event (diagnosis of where the time goes).

    python3 bench/ep_profile.py --transport copy_engine --chunks 4 --out /tmp/prof
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import call_times_ms, capture_graph, join_nccl, routed_tokens  # noqa: E402


def worker(rank, world, port, args):
    dev = join_nccl(rank, world, port)
    from smsplit.ep.copy_engine import CopyEngineTransport
    from smsplit.ep.nvlink import NvlinkTransport

    T, H, E, K = 4096, 7168, 256, 8
    num_local = E // world
    x, topk, _, in_rank, g = routed_tokens(rank, world, dev, T, H, E, K)
    worst = world * T
    if args.transport == "copy_engine":
        tr = CopyEngineTransport(dist.group.WORLD, dev, num_sms=args.sms, max_tokens=T, hidden=H, max_topk=K,
                                 num_chunks=args.chunks)
        lay = tr.layout(in_rank, worst)
    else:
        tr = NvlinkTransport(dist.group.WORLD, dev, num_sms=args.sms, max_tokens=T, hidden=H, max_topk=K,
                             bulk="copy_engine" if args.transport == "nvlink_copy_engine" else "sm")
        if args.combine_chunks:
            tr.combine_chunks = args.combine_chunks
        *_, lay = tr.dispatch(x, None, topk, None, in_rank, num_local, num_worst_tokens=worst)
    y = torch.randn(worst, H, generator=g).to(dev, torch.bfloat16)

    def dispatch_and_combine():
        tr.dispatch(x, None, topk, None, in_rank, num_local, quantize=args.fp8, num_worst_tokens=worst, cached=lay)
        tr.combine(y, None, lay)

    def combine_alone():  # after one dispatch_and_combine: the combine of that dispatch, alone
        tr.combine(y, None, lay)

    step = dispatch_and_combine
    if args.combine_only:
        dispatch_and_combine()
        step = combine_alone
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    # the pieces alone, CUDA events, median of 10: a local SM copy of x (the pack's floor) and the whole step
    from smsplit.copy import sm_copy

    def median_us(fn, reps=10):
        return statistics.median(call_times_ms(fn, warmup=0, repeat=reps, before=together)) * 1e3

    def together():  # every rank starts each timed call from an idle GPU at the same time
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])

    if args.host_profile:  # where the host time of a cached dispatch + combine goes
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(20):
            step()
        prof.disable()
        torch.cuda.synchronize()
        if rank == 0:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(args.host_sort).print_stats(args.host_lines)
            print(text.getvalue(), flush=True)
    tmp = torch.empty_like(x)
    alone = {"sm_copy_x_local": median_us(lambda: sm_copy(tmp, x, args.sms)),
             "dispatch": median_us(lambda: tr.dispatch(x, None, topk, None, in_rank, num_local, quantize=args.fp8,
                                                       num_worst_tokens=worst, cached=lay)),
             "combine": median_us(lambda: tr.combine(y, None, lay))}
    if hasattr(tr, "combine_tokens_per_step"):  # the combine with each tokens-per-step
        default = tr.combine_tokens_per_step
        for tb in (1, 2, 4):
            tr.combine_tokens_per_step = tb
            alone[f"combine_tb{tb}"] = median_us(lambda: tr.combine(y, None, lay))
        tr.combine_tokens_per_step = default
    if rank == 0:
        print("alone (us):", {k: round(v, 1) for k, v in alone.items()}, flush=True)
    run = step
    if args.graph:  # profile a replay of the step captured in a CUDA graph (no host work between the launches)
        if args.transport == "copy_engine":
            raise SystemExit("--graph: the copy_engine transport is not capturable")
        graph = capture_graph(step, dev)
        for _ in range(3):
            graph.replay()
        run = graph.replay
    together()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
        torch.cuda.synchronize()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"trace_{args.transport}_rank{rank}.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    t0 = min(e["ts"] for e in events) if events else 0
    lines = [f"rank {rank}: {args.transport} chunks={args.chunks} combine_chunks={getattr(tr, 'combine_chunks', None)} "
             f"sms={args.sms} fp8={args.fp8} graph={args.graph}"]
    for e in sorted(events, key=lambda e: e["ts"]):
        lines.append(f"  stream {e.get('tid')!s:>4} start {e['ts'] - t0:8.1f} us dur {e['dur']:7.1f} us  "
                     f"{e['name'][:60]}")
    cpu = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    if cpu:
        lines.append(f"  host span of the step: {max(e['ts'] + e['dur'] for e in cpu) - min(e['ts'] for e in cpu):.1f} us")
    (out / f"summary_{args.transport}_rank{rank}.txt").write_text("\n".join(lines) + "\n")
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transport", default="copy_engine", choices=["copy_engine", "nvlink", "nvlink_copy_engine"])
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--sms", type=int, default=20)
    parser.add_argument("--combine-chunks", type=lambda text: tuple(float(f) for f in text.split(",")), default=None,
                        help="nvlink_copy_engine: the combine's copy chunks (e.g. 0.6,1); default: the transport's")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--out", default="/tmp/prof")
    parser.add_argument("--host-profile", action="store_true", help="cProfile 20 dispatch + combine calls")
    parser.add_argument("--host-sort", default="tottime", help="--host-profile: pstats sort key (e.g. cumulative)")
    parser.add_argument("--host-lines", type=int, default=25, help="--host-profile: functions printed")
    parser.add_argument("--graph", action="store_true", help="profile a CUDA-graph replay of dispatch + combine")
    parser.add_argument("--combine-only", action="store_true", help="profile the combine alone (its own graph)")
    args = parser.parse_args()
    from smsplit.ep.testing import free_port

    mp.spawn(worker, args=(2, free_port(), args), nprocs=2, join=True)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
