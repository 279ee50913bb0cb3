"""What a user's eager `smsplit.ep.Buffer` call costs, against the transport call it makes (DeepSeek-V3 shape, 2 GPUs).

`bench/ep.py` times the transports (`NvlinkTransport.dispatch`, ...) and replays them from CUDA graphs. A user calls
`Buffer.dispatch` / `Buffer.combine` eagerly: each call first exchanges a header with every rank (the arguments are
checked on every rank before any token moves; a host synchronization), then makes the transport call, then copies the
received rows out of the transport's buffer. For each backend at ``--comm-sms``, one call at a time between two CUDA
events after a barrier (median over ranks' medians, max over ranks): Buffer dispatch uncached (BF16), cached (BF16,
FP8 quantized in the dispatch, FP8 input) and combine, and the same transport calls without the Buffer (cached
layout). Then the same calls queued back to back, as DeepEP's benchmark times its calls (``--queued`` calls between
two CUDA events, divided: the host may run ahead of the GPU). Then a host profile (cProfile) of each rank's cached BF16
dispatch + combine through the Buffer, printed for the ranks in ``--profile-ranks``: the functions with the most own time.

    PYTHONPATH=src python3 bench/ep_buffer.py --backends nvlink nvlink_copy_engine copy_engine --comm-sms 20
Writes bench/results/ep_buffer.json. Each row's Buffer is also checked (``roundtrip_equal``: fresh tokens dispatched
and combined back, BF16 and FP8); the script exits non-zero when one does not come back, after writing its times.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_shape_arguments, end_worker, exit_if_roundtrips_failed, join_nccl,  # noqa: E402
                    max_difference, max_over_ranks, routed_tokens, run_and_write, time_ms)


def roundtrip(buf, handle, in_rank, g, shape, dev) -> dict:
    """Fresh random tokens of ``shape`` (rows the timed calls left behind cannot pass) dispatched through ``buf`` with
    the cached ``handle`` and combined back unchanged: each token must come back times the number of ranks it went
    to, BF16 exactly; FP8 (quantized in the dispatch, dequantized on receive) within e4m3's rounding of the token.
    Returns ``{"bf16": bool, "fp8": bool, "fp8_max_rel_diff": float}`` (every rank's worst; a collective)."""
    from smsplit.fp8 import dequantize_1x128, quantize_1x128

    x = torch.randn(shape, generator=g).to(dev, torch.bfloat16)
    times = in_rank.sum(1, keepdim=True).float()
    recv, *_ = buf.dispatch(x, handle=handle)
    out, *_ = buf.combine(recv, handle)
    bf16_bad = float(not torch.equal(out, (x.float() * times).to(torch.bfloat16)))
    deq = dequantize_1x128(*quantize_1x128(x), dtype=torch.float32)
    recv, *_ = buf.dispatch(x, handle=handle, fp8=True, dequantize=True)
    out, *_ = buf.combine(recv, handle)
    fp8_rel = max_difference(out, deq * times)[1]
    worst = torch.tensor([bf16_bad, fp8_rel], dtype=torch.float64, device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    bf16_bad, fp8_rel = worst.tolist()
    return {"bf16": bf16_bad == 0, "fp8": fp8_rel <= 1e-2, "fp8_max_rel_diff": fp8_rel}


def worker(rank, world, port, args, queue):
    dev = join_nccl(rank, world, port)
    from smsplit.ep import Buffer
    from smsplit.ep.device import DeviceState
    from smsplit.fp8 import quantize_1x128

    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    x, topk, weights, in_rank, g = routed_tokens(rank, world, dev, T, H, E, K)
    xq, xs = quantize_1x128(x)
    rows, profiles = [], {}

    def timed(fn, inner=1):
        dist.barrier(device_ids=[rank])
        return max_over_ranks(time_ms(fn, warmup=3, repeat=args.reps, inner=inner)["median_ms"], dev)

    for backend in args.backends:
        for P in args.comm_sms:
            buf = Buffer(dist.group.WORLD, num_nvl_bytes=Buffer.get_buffer_size_hint(T, H, world, K, backend=backend),
                         num_sms=P, backend=backend, timeout_s=60)
            per_rank, _, per_expert, in_rank_b, _ = buf.get_dispatch_layout(topk, E)
            layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank_b, num_tokens_per_expert=per_expert,
                          topk_idx=topk, topk_weights=weights)
            recv_x, _, _, _, handle, _ = buf.dispatch(x, **layout)
            y = torch.randn(recv_x.shape, generator=g).to(dev, torch.bfloat16)
            state = handle.transport_state  # a device transport's: its engine and the engine's layout
            tr, lay = (state.engine, state.layout) if isinstance(state, DeviceState) else (None, None)
            num_local = E // world

            def transport_bf16():  # a cached BF16 dispatch of the transport alone
                return tr.dispatch(x, None, topk, weights, in_rank, num_local, num_sms=P, cached=lay)

            row = {"backend": backend, "comm_sms": P,
                   "buffer_dispatch_bf16_ms": timed(lambda: buf.dispatch(x, **layout)),
                   "buffer_dispatch_bf16_cached_ms": timed(lambda: buf.dispatch(x, handle=handle)),
                   "buffer_dispatch_fp8_cached_ms": timed(lambda: buf.dispatch(x, handle=handle, fp8=True)),
                   "buffer_dispatch_fp8_input_cached_ms": timed(lambda: buf.dispatch((xq, xs), handle=handle)),
                   "buffer_combine_ms": timed(lambda: buf.combine(y, handle))}
            if tr is not None:  # (the reference backend has no kernels of its own to time alone)
                row["transport_dispatch_bf16_cached_ms"] = timed(transport_bf16)
                row["transport_dispatch_fp8_cached_ms"] = timed(lambda: tr.dispatch(
                    x, None, topk, weights, in_rank, num_local, num_sms=P, quantize=True, cached=lay))
                transport_bf16()
                row["transport_combine_ms"] = timed(lambda: tr.combine(y, None, lay, num_sms=P))
            if args.queued > 1:
                row.update({
                    "buffer_dispatch_bf16_cached_queued_ms": timed(lambda: buf.dispatch(x, handle=handle), args.queued),
                    "buffer_dispatch_fp8_cached_queued_ms": timed(lambda: buf.dispatch(x, handle=handle, fp8=True),
                                                                  args.queued),
                    "buffer_combine_queued_ms": timed(lambda: buf.combine(y, handle), args.queued)})
                if tr is not None:
                    row["transport_dispatch_bf16_cached_queued_ms"] = timed(transport_bf16, args.queued)
                    transport_bf16()
                    row["transport_combine_queued_ms"] = timed(lambda: tr.combine(y, None, lay, num_sms=P), args.queued)
            row["roundtrip_equal"] = roundtrip(buf, handle, in_rank_b, g, x.shape, dev)
            torch.cuda.synchronize()
            dist.barrier(device_ids=[rank])
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.profile_calls):
                recv, *_ = buf.dispatch(x, handle=handle)
                buf.combine(recv, handle)
            torch.cuda.synchronize()
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile_top)
            profiles[f"{backend}_{P}"] = text.getvalue()
            rows.append(row)
            if rank == 0:
                print(f"{backend} P={P}: " + ", ".join(f"{k[:-3]} {v * 1e3:.1f} us" for k, v in row.items()
                                                      if k.endswith("_ms"))
                      + f"; round trip equal: {row['roundtrip_equal']}", flush=True)
            for r in args.profile_ranks:  # one rank at a time, so that the printed profiles do not interleave
                if r == rank:
                    print(f"host profile, {args.profile_calls} cached BF16 dispatches + combines through the Buffer "
                          f"(rank {rank}, by own time):\n"
                          + "\n".join(profiles[f"{backend}_{P}"].splitlines()[:args.profile_top + 12]), flush=True)
                dist.barrier(device_ids=[rank])
            buf = handle = tr = None  # the next backend's buffer replaces this one
            torch.cuda.synchronize()
    end_worker(rank, queue, {"rows": rows, "profiles_rank0": profiles})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--comm-sms", type=int, nargs="+", default=[20])
    parser.add_argument("--backends", nargs="+", default=["reference", "nvlink", "nvlink_copy_engine", "copy_engine"],
                        choices=["reference", "nvlink", "nvlink_copy_engine", "copy_engine"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--queued", type=int, default=10,
                        help="calls queued back to back per timed run in the queued columns (1: none)")
    parser.add_argument("--profile-calls", type=int, default=20)
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="ranks whose host profile is printed")
    parser.add_argument("--world", type=int, default=torch.cuda.device_count())
    path = run_and_write("ep_buffer", worker, parser.parse_args(),
                         notes="one eager call between two CUDA events after a barrier, median of reps per rank, max "
                               "over ranks; *_queued_ms: --queued calls back to back between two events, divided; "
                               "roundtrip_equal: fresh tokens dispatched and combined back through the Buffer")
    exit_if_roundtrips_failed(json.loads(path.read_text())["rows"], path, "backend")


if __name__ == "__main__":
    main()
