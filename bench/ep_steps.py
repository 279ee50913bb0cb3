"""Tokens per program step of the NVLink transport's kernels (``tokens_per_step`` for the dispatch,
``quantize_tokens_per_step`` for one that quantizes, ``combine_tokens_per_step`` for the combine; one value for
all three per row), replayed from CUDA graphs on 2 GPUs, DeepSeek-V3 shape, with the copy engines moving the bulk
(``bulk="copy_engine"``, the default shares), and warps per program (``num_warps``). Picks the defaults.

    PYTHONPATH=src python3 bench/ep_steps.py --comm-sms 20

Writes bench/results/ep_steps.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (capture_graph, copy_engine_combine_inputs, end_worker, join_nccl, max_over_ranks,  # noqa: E402
                    run_and_write, time_ms)


def worker(rank, world, port, args, queue):
    dev = join_nccl(rank, world, port)
    inputs = copy_engine_combine_inputs(rank, world, dev, max(args.comm_sms))
    tr, x, topk, weights, in_rank = inputs.tr, inputs.x, inputs.topk, inputs.weights, inputs.in_rank
    num_local, worst, lay, y = inputs.num_local, inputs.worst, inputs.layout, inputs.y

    def replayed_us(fn):
        graph = capture_graph(fn, dev)
        dist.barrier(device_ids=[rank])
        ms = max_over_ranks(time_ms(graph.replay, warmup=3, repeat=args.reps, inner=args.queued)["median_ms"], dev)
        tr.raise_if_failed()
        return ms * 1e3

    rows = []
    for P in args.comm_sms:
        tr.num_sms = P
        calls = {"dispatch_bf16": lambda: tr.dispatch(x, None, topk, weights, in_rank, num_local,
                                                      num_worst_tokens=worst, cached=lay),
                 "dispatch_fp8": lambda: tr.dispatch(x, None, topk, weights, in_rank, num_local,
                                                     quantize=True, num_worst_tokens=worst, cached=lay),
                 "combine": lambda: tr.combine(y, None, lay)}
        step_of = {"dispatch_bf16": "tokens_per_step", "dispatch_fp8": "quantize_tokens_per_step",
                   "combine": "combine_tokens_per_step"}
        for tb, warps in [(tb, w) for tb in args.steps for w in args.warps]:
            for kernel in args.kernels:
                setattr(tr, step_of[kernel], tb)
            tr.num_warps = warps
            row = {"comm_sms": P, "tokens_per_step": tb, "num_warps": warps}
            row.update({f"{kernel}_us": replayed_us(calls[kernel]) for kernel in args.kernels})
            rows.append(row)
            if rank == 0:
                print(f"P={P} tokens per step {tb}, {warps} warps: "
                      + ", ".join(f"{kernel} {row[kernel + '_us']:.1f} us" for kernel in args.kernels), flush=True)
    end_worker(rank, queue, {"rows": rows})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--comm-sms", type=int, nargs="+", default=[20])
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--warps", type=int, nargs="+", default=[16])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--queued", type=int, default=1, help="replays queued between two events (time divided)")
    parser.add_argument("--kernels", nargs="+", default=["dispatch_bf16", "dispatch_fp8", "combine"],
                        choices=["dispatch_bf16", "dispatch_fp8", "combine"],
                        help="which calls to time (only their tokens per step change)")
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    run_and_write("ep_steps", worker, args,
                  "replayed from CUDA graphs; max over ranks of per-rank medians")


if __name__ == "__main__":
    main()
