"""Expert-parallel dispatch/combine benchmark on the GPUs of one node (DeepSeek-V3 shape).

Per rank: 4096 tokens, hidden 7168, 256 experts, top-8 (uniform random routing). For each comm SM
count: BF16 dispatch, FP8 dispatch (quantization fused, from BF16 input), FP8 dispatch of input quantized before
the call (``dispatch((x_fp8, scales), ...)``, as DeepEP's benchmark times its FP8 dispatch), combine (BF16), each with
the SM-push NVLink transport (``smsplit.ep.nvlink``) using exactly that many persistent programs, the
same with a copy engine moving the BF16 rows (``bulk="copy_engine"``), and the copy-engine transport.
Dispatch is timed with a cached layout (as DeepEP's benchmark does) and with the count exchange.
In the same run: NCCL ``all_to_all_single`` moving the same token bytes (all SMs), and a plain
copy-engine peer copy of the bytes that cross NVLink (zero SMs; the ceiling; with more than 2 ranks also
each peer's rows to that peer, all peers at once). Then dispatch+combine
on a green-context comm budget while a bf16 GEMM runs on the compute budget.

Graph replays, NCCL and the copy-engine copy are timed three ways: one call between two CUDA events (the
GPU idle before it: the graph's launch latency and the ranks' skew included), QUEUED calls between two
events divided by QUEUED (the steady state of calls queued back to back, as in a training step), and one call
started together on every rank (captured in a graph of its own after a device-side barrier and timed from the
barrier's exit to a stamp after it on the GPU clock, `common.StartTogether`: the call's own time, as DeepEP's
profiled benchmark (`bench_kineto` with `barrier_comm_profiling`) aligns the ranks with a GEMM and an all-reduce
before each profiled call; its tuning loop (`bench`) times calls queued back to back, the "5 queued" way).

Run on 2 GPUs:  PYTHONPATH=src python3 bench/ep.py   (on N GPUs it uses all of them: --world N)
Writes bench/results/ep.json (``--name``: another file). Every transport's calls are checked: each row's tokens
dispatched and combined back unchanged must return exactly (``roundtrip_equal``); the script exits non-zero when
one does not, after writing its times.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import statistics
import time
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (StartTogether, add_shape_arguments, capture_graph, end_worker, environment,  # noqa: E402
                    exit_if_roundtrips_failed, interleaved_rounds, join_nccl, max_over_ranks, routed_tokens, run_ranks,
                    time_ms, write_result)
from tables import add_ep_rates  # noqa: E402


QUEUED = 5
_ROUNDTRIPS = itertools.count(1)  # seeds of _roundtrip_equal's tokens


def _roundtrip_equal(tr, x, topk, weights, in_rank, num_local, worst, cached, sms) -> dict:
    """Poison the receive and combine areas, dispatch tokens and combine the received rows unchanged: each token must
    come back times the number of ranks it went to, exactly (BF16; FP8, quantized in the dispatch or before it
    (``fp8_input``): its e4m3 rows dequantized to BF16, per ``smsplit.fp8.quantize_1x128``). Checks placement and
    return for any order of the received rows. Each case draws fresh random tokens of ``x``'s shape (same routing):
    the combine's output is a new tensor that cannot be poisoned, and memory freed by an earlier case (its expected
    result) must not hold this case's expected result."""
    from smsplit.fp8 import dequantize_1x128, quantize_1x128

    times = in_rank.sum(1, keepdim=True).float()
    g = torch.Generator(device=x.device)
    g.manual_seed(1_000_003 * next(_ROUNDTRIPS) + dist.get_rank())  # different on every rank and every call
    result = {}
    for name, quantize in (("bf16", False), ("fp8", True), ("fp8_input", False)):
        x = torch.randn(x.shape, generator=g, device=x.device).to(x.dtype)
        q, s = quantize_1x128(x)
        source = x if name == "bf16" else dequantize_1x128(q, s)
        tr.buffer[tr.offsets["x" if "x" in tr.offsets else "sx"]:].fill_(0x7F)  # (copy_engine: from its staging)
        torch.cuda.synchronize()
        dist.barrier()  # no peer writes into this rank's buffer before it is poisoned (a cached dispatch's copies
        # start at once: no count exchange orders them after the peer's work)
        rx, rs, *_, lay = tr.dispatch(*((q, s) if name == "fp8_input" else (x, None)), topk, weights, in_rank,
                                      num_local, num_sms=sms, quantize=quantize, num_worst_tokens=worst, cached=cached)
        if rs is not None:
            rx = dequantize_1x128(rx, rs)
        out, _ = tr.combine(rx.contiguous(), None, lay, num_sms=sms)
        torch.cuda.synchronize()
        tr.raise_if_failed()
        result[name] = bool(torch.equal(out, (source.float() * times).to(torch.bfloat16)))
    return result


def worker(rank, world, port, args, queue):
    dev = join_nccl(rank, world, port)
    from smsplit.budget import SmBudget
    from smsplit.ep.copy_engine import CopyEngineTransport
    from smsplit.ep.nvlink import NvlinkTransport
    from smsplit.ep.nvlink_plan import default_combine_chunks
    from smsplit.fp8 import quantize_1x128

    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    num_local = E // world
    x, topk, weights, in_rank, g = routed_tokens(rank, world, dev, T, H, E, K)
    xq, xs = quantize_1x128(x)  # FP8 input, as DeepEP's benchmark dispatches it (quantized before the call)
    transport = NvlinkTransport(dist.group.WORLD, dev, max_tokens=T, hidden=H, max_topk=K, timeout_s=60)
    transports = {"nvlink": transport}
    if "nvlink_copy_engine" in args.transports:
        transports["nvlink_copy_engine"] = NvlinkTransport(dist.group.WORLD, dev, max_tokens=T, hidden=H, max_topk=K,
                                                           timeout_s=60, bulk="copy_engine")
    if "copy_engine" in args.transports:
        transports["copy_engine"] = CopyEngineTransport(dist.group.WORLD, dev, max_tokens=T, hidden=H, max_topk=K,
                                                        timeout_s=60, num_chunks=args.chunks)
    first_sms = args.comm_sms[0]
    worst = world * T

    # layout and byte counts
    _, _, _, _, _, layout = transport.dispatch(x, None, topk, weights, in_rank, num_local, num_sms=first_sms,
                                               num_worst_tokens=worst)
    torch.cuda.synchronize()
    transport.raise_if_failed()
    num_recv = int(layout.num_recv_tokens.item())
    source_start = layout.layout[world: 2 * world + 1].tolist()  # per source, then the total
    recv_from_peers = num_recv - (source_start[rank + 1] - source_start[rank])
    send_counts = in_rank.sum(0).tolist()
    sent_to_peers = sum(c for r, c in enumerate(send_counts) if r != rank)
    res = {"rank": rank, "num_recv": num_recv, "recv_from_peers": recv_from_peers, "sent_to_peers": sent_to_peers,
           "recv_bytes_bf16_deepep": num_recv * H * 2, "rows": []}

    def host_us(fn, reps=10):
        dist.barrier(device_ids=[rank])
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        return statistics.median(times)

    def timed(fn, reps=args.reps, inner=1):
        dist.barrier(device_ids=[rank])
        return time_ms(fn, warmup=3, repeat=reps, inner=inner)["median_ms"]

    def queued(fn):  # QUEUED calls between two events, divided: no launch latency or rank skew per call
        return timed(fn, inner=QUEUED)

    start_together = StartTogether(dev)

    def aligned(fn):  # one call in a graph of its own, every rank's GPU starting it together, on the GPU clock
        dist.barrier(device_ids=[rank])
        return start_together.median_ms(fn, repeat=args.reps)

    y = torch.randn(worst, H, generator=g).to(dev, torch.bfloat16)
    yw = torch.rand(worst, K, generator=g).to(dev)  # received top-k weights, for --combine-weights
    layouts = {"nvlink": layout}
    if "nvlink_copy_engine" in transports:
        *_, layouts["nvlink_copy_engine"] = transports["nvlink_copy_engine"].dispatch(
            x, None, topk, weights, in_rank, num_local, num_sms=first_sms, num_worst_tokens=worst)
        split = layouts["nvlink_copy_engine"].splits["dispatch"]
        # per peer: rows in its one copy, and the holes in them (tokens not sent there, filled after the copy)
        res["nvlink_copy_engine_copies"] = [
            {"peer": d, "rows": m, "holes": int(m - in_rank[:m, d].sum())} for d, m, _ in split.copies]
    if "copy_engine" in transports:
        layouts["copy_engine"] = transports["copy_engine"].layout(in_rank, worst)
    for name, P in [(n, P) for n in args.transports for P in args.comm_sms]:
        tr, lay = transports[name], layouts[name]
        row = {"transport": name, "comm_sms": P}
        row["dispatch_bf16_cached_ms"] = timed(lambda: tr.dispatch(
            x, None, topk, weights, in_rank, num_local, num_sms=P, num_worst_tokens=worst, cached=lay))
        row["dispatch_bf16_ms"] = timed(lambda: tr.dispatch(
            x, None, topk, weights, in_rank, num_local, num_sms=P, num_worst_tokens=worst))
        row["dispatch_fp8_cached_ms"] = timed(lambda: tr.dispatch(
            x, None, topk, weights, in_rank, num_local, num_sms=P, quantize=True, num_worst_tokens=worst,
            cached=lay))
        row["dispatch_fp8_input_cached_ms"] = timed(lambda: tr.dispatch(
            xq, xs, topk, weights, in_rank, num_local, num_sms=P, num_worst_tokens=worst, cached=lay))
        tr.dispatch(x, None, topk, weights, in_rank, num_local, num_sms=P, num_worst_tokens=worst, cached=lay)
        row["combine_ms"] = timed(lambda: tr.combine(y, None, lay, num_sms=P))
        torch.cuda.synchronize()
        tr.raise_if_failed()
        # host time per call (Python + launches), no synchronization inside: bounds the GPU time from below
        # when the GPU waits for the host
        row["dispatch_bf16_host_us"] = host_us(lambda: tr.dispatch(
            x, None, topk, weights, in_rank, num_local, num_sms=P, num_worst_tokens=worst, cached=lay))
        row["combine_host_us"] = host_us(lambda: tr.combine(y, None, lay, num_sms=P))
        for key in list(row):
            if key.endswith("_ms"):
                row[key] = max_over_ranks(row[key], dev)
        equal = _roundtrip_equal(tr, x, topk, weights, in_rank, num_local, worst, lay, P)  # the calls timed above
        row["roundtrip_equal"] = {k: bool(max_over_ranks(float(not v), dev) == 0) for k, v in equal.items()}
        res["rows"].append(row)
        if rank == 0:
            print(f"{name:11s} P={P:2d}: dispatch bf16 {row['dispatch_bf16_cached_ms'] * 1e3:7.1f} us (uncached "
                  f"{row['dispatch_bf16_ms'] * 1e3:7.1f}), fp8 {row['dispatch_fp8_cached_ms'] * 1e3:7.1f} us (FP8 input "
                  f"{row['dispatch_fp8_input_cached_ms'] * 1e3:7.1f}), "
                  f"combine {row['combine_ms'] * 1e3:7.1f} us; host per call: dispatch {row['dispatch_bf16_host_us']:.0f} us, "
                  f"combine {row['combine_host_us']:.0f} us; round trip equal: {row['roundtrip_equal']}", flush=True)

    # the nvlink transport replayed from CUDA graphs: the same GPU work with no host work per call (dispatch
    # with its device-side count exchange: uncached)
    def graph_of(fn):
        return capture_graph(fn, dev)

    # nvlink: uncached (the device-side count exchange inside); nvlink_copy_engine: cached layout (its copies are
    # planned on the host at the first call)
    res["graph_rows"] = []
    graph_cases = [(n, P) for n in args.transports if n.startswith("nvlink") for P in args.comm_sms]
    for name, P in graph_cases:
        tr, lay = transports[name], layouts[name]
        cached = lay if name == "nvlink_copy_engine" else None
        planned = name == "nvlink_copy_engine"  # copy engines move every row sent to a peer (the winning share)
        if planned:
            tr.plan(lay, in_rank, num_sms=P)  # the combine's chunks for P SMs, planned before capture
        calls = {
            "dispatch_bf16": lambda: tr.dispatch(x, None, topk, weights, in_rank, num_local, num_sms=P,
                                                 num_worst_tokens=worst, cached=cached),
            "dispatch_fp8": lambda: tr.dispatch(x, None, topk, weights, in_rank, num_local, num_sms=P, quantize=True,
                                                num_worst_tokens=worst, cached=cached),
            "dispatch_fp8_input": lambda: tr.dispatch(xq, xs, topk, weights, in_rank, num_local, num_sms=P,
                                                      num_worst_tokens=worst, cached=cached),
            "combine": lambda: tr.combine(y, None, lay, num_sms=P),
        }
        if args.combine_weights:  # DeepEP's benchmark times its combine without weights; a model passes them
            calls["combine_weighted"] = lambda: tr.combine(y, yw, lay, num_sms=P)
        graphs = {key: graph_of(call) for key, call in calls.items()}
        row = {"transport": name, "comm_sms": P, "cached": cached is not None,
               "copy_share": 1.0 if planned else None, "combine_copy_share": 1.0 if planned else None,
               "combine_chunks": default_combine_chunks(P) if planned else None, "combine_chunks_by_sms": planned}
        equal = _roundtrip_equal(tr, x, topk, weights, in_rank, num_local, worst, cached, P)
        row["roundtrip_equal"] = {k: bool(max_over_ranks(float(not v), dev) == 0) for k, v in equal.items()}
        for key, graph in graphs.items():
            row[key + "_graph_ms"] = max_over_ranks(timed(graph.replay), dev)
            row[key + "_graph_queued_ms"] = max_over_ranks(queued(graph.replay), dev)
            row[key + "_graph_aligned_ms"] = max_over_ranks(aligned(calls[key]), dev)
        torch.cuda.synchronize()
        tr.raise_if_failed()
        res["graph_rows"].append(row)
        del graphs
        if rank == 0:
            chunk_note = f" chunks {default_combine_chunks(P)}" if planned else ""
            print(f"{name}{chunk_note} in a CUDA graph, P={P:2d}: dispatch bf16 {row['dispatch_bf16_graph_ms'] * 1e3:7.1f} us, "
                  f"fp8 {row['dispatch_fp8_graph_ms'] * 1e3:7.1f} us (FP8 input {row['dispatch_fp8_input_graph_ms'] * 1e3:.1f}), combine {row['combine_graph_ms'] * 1e3:7.1f} us; "
                  f"round trip equal: {row['roundtrip_equal']}; {QUEUED} queued: "
                  + ", ".join(f"{k} {row[k + '_graph_queued_ms'] * 1e3:.1f}" for k in calls)
                  + " us; started together: "
                  + ", ".join(f"{k} {row[k + '_graph_aligned_ms'] * 1e3:.1f}" for k in calls)
                  + " us", flush=True)

    # NCCL all_to_all_single of the same token bytes (bf16 rows, self part included)
    order = torch.cat([torch.nonzero(in_rank[:, r]).flatten() for r in range(world)])
    send = x[order].contiguous()
    counts_all = [torch.zeros(world, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(counts_all, in_rank.sum(0).to(torch.int64))
    recv_splits = [int(c[rank]) for c in counts_all]
    recv = torch.empty(sum(recv_splits), H, dtype=torch.bfloat16, device=dev)
    nccl_ms = timed(lambda: dist.all_to_all_single(recv, send, recv_splits, send_counts))
    res["nccl_all_to_all_ms"] = max_over_ranks(nccl_ms, dev)
    res["nccl_all_to_all_queued_ms"] = max_over_ranks(queued(lambda: dist.all_to_all_single(recv, send, recv_splits,
                                                                                              send_counts)), dev)
    try:  # NCCL captured in a CUDA graph
        res["nccl_all_to_all_aligned_ms"] = max_over_ranks(aligned(lambda: dist.all_to_all_single(
            recv, send, recv_splits, send_counts)), dev)
    except RuntimeError as e:
        print(f"rank {rank}: NCCL all_to_all_single not timed started together: {e}", flush=True)
        res["nccl_all_to_all_aligned_ms"] = float("nan")

    # copy-engine peer copy of the bytes that cross NVLink, every rank at once (the ceiling)
    peer = (rank + 1) % world
    n_cross = sent_to_peers
    dst = transport.handle.get_buffer(peer, (n_cross, H), torch.bfloat16, storage_offset=transport.offsets["cx"] // 2)
    src = torch.randn(n_cross, H, generator=g).to(dev, torch.bfloat16)
    ce_ms = timed(lambda: dst.copy_(src))
    res["copy_engine_ms"] = max_over_ranks(ce_ms, dev)
    res["copy_engine_queued_ms"] = max_over_ranks(queued(lambda: dst.copy_(src)), dev)
    res["copy_engine_aligned_ms"] = max_over_ranks(aligned(lambda: dst.copy_(src)), dev)
    res["copy_engine_bytes"] = n_cross * H * 2
    if world > 2:  # the all-to-all ceiling: each peer's rows to that peer, all peers at once (a stream each)
        pieces = [(transport.handle.get_buffer(d, (send_counts[d], H), torch.bfloat16,
                                               storage_offset=transport.offsets["cx"] // 2 + rank * T * H),
                   torch.randn(send_counts[d], H, generator=g).to(dev, torch.bfloat16))
                  for d in range(world) if d != rank]
        streams = [torch.cuda.Stream(dev) for _ in pieces]

        def to_all_peers():
            current = torch.cuda.current_stream()
            for stream, (to, frm) in zip(streams, pieces):
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    to.copy_(frm)
            for stream in streams:
                current.wait_stream(stream)

        res["copy_engine_all_peers_ms"] = max_over_ranks(timed(to_all_peers), dev)
        res["copy_engine_all_peers_bytes"] = sent_to_peers * H * 2

    # SM copies over NVLink, every rank at once: persistent programs writing to / reading from the peer
    from smsplit.copy import sm_copy

    peer_src = transport.handle.get_buffer(peer, (n_cross, H), torch.bfloat16,
                                           storage_offset=transport.offsets["x"] // 2)
    local = torch.empty(n_cross, H, dtype=torch.bfloat16, device=dev)
    link = []
    for P in args.comm_sms:
        w = max_over_ranks(timed(lambda: sm_copy(dst, src, P, block=4096, num_warps=16)), dev)
        r = max_over_ranks(timed(lambda: sm_copy(local, peer_src, P, block=4096, num_warps=16)), dev)
        link.append({"programs": P, "write_ms": w, "read_ms": r,
                     "write_gbps": n_cross * H * 2 / w / 1e6, "read_gbps": n_cross * H * 2 / r / 1e6})
        if rank == 0:
            print(f"SM copy over NVLink, {P:2d} programs: write {link[-1]['write_gbps']:6.1f} GB/s, "
                  f"read {link[-1]['read_gbps']:6.1f} GB/s", flush=True)
    res["sm_copy_over_nvlink"] = link
    if rank == 0:
        print(f"NCCL all_to_all_single {res['nccl_all_to_all_ms'] * 1e3:.1f} us; copy engine "
              f"{res['copy_engine_ms'] * 1e3:.1f} us for {n_cross * H * 2 / 1e6:.1f} MB; {QUEUED} queued: NCCL "
              f"{res['nccl_all_to_all_queued_ms'] * 1e3:.1f} us, copy engine {res['copy_engine_queued_ms'] * 1e3:.1f} us; "
              f"started together: NCCL {res['nccl_all_to_all_aligned_ms'] * 1e3:.1f} us, copy engine "
              f"{res['copy_engine_aligned_ms'] * 1e3:.1f} us", flush=True)

    # concurrent: dispatch + combine on a green comm budget while a GEMM runs on the compute budget
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    gemm_full = timed(lambda: torch.matmul(a, b), reps=10)
    conc = []
    for name, asked in [(n, a) for n in args.transports for a in args.concurrent_sms]:
        with SmBudget(asked, device=dev, mode="green") as budget:
            tr, lay, sms = transports[name], layouts[name], budget.comm_sms

            def comm():
                tr.dispatch(x, None, topk, weights, in_rank, num_local, num_sms=sms, quantize=True,
                            num_worst_tokens=worst, cached=lay)
                tr.combine(y, None, lay, num_sms=sms)

            with torch.cuda.stream(budget.comm_stream):  # warm, and the host time to queue one call
                comm()
                torch.cuda.synchronize()
                host_ms = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    comm()
                    host_ms.append((time.perf_counter() - t0) * 1e3)
                    torch.cuda.synchronize()
            rounds = interleaved_rounds(budget, lambda: torch.matmul(a, b), comm, args.concurrent_rounds, repeat=10,
                                        n_gemm=10, agree=lambda k: int(max_over_ranks(k, dev)),
                                        copy_host_ms=max_over_ranks(max(host_ms), dev), copy_inner=QUEUED)
            torch.cuda.synchronize()
            tr.raise_if_failed()
            slowdowns = [1 / r["gemm_kept"] - 1 for r in rounds if r["gemm_kept"]]
            comm_slowdowns = [1 / r["copy_kept"] - 1 for r in rounds if r["copy_kept"]]
            g_in = [t for r in rounds for t in r["_samples"][0]]
            c_in = [t for r in rounds for t in r["_samples"][1]]
            entry = {"transport": name, "asked": asked, "comm_sms": budget.comm_sms, "compute_sms": budget.compute_sms,
                     "gemm_full_gpu_ms": gemm_full,
                     "gemm_alone_on_budget_ms": statistics.median(r["gemm_alone_ms"] for r in rounds),
                     "gemm_concurrent_ms": statistics.median(g_in) if g_in else None,
                     "gemm_slowdown": statistics.median(slowdowns) if slowdowns else None,
                     "gemm_slowdown_rounds": slowdowns,
                     "comm_alone_ms": statistics.median(r["copy_alone_ms"] for r in rounds),
                     "comm_alone_queued": QUEUED,  # calls queued behind a sleep kernel per timing, as beside the GEMM
                     "comm_concurrent_ms": statistics.median(c_in) if c_in else None,
                     "comm_slowdown": statistics.median(comm_slowdowns) if comm_slowdowns else None,
                     "comm_slowdown_rounds": comm_slowdowns,
                     "comm_host_ms": max(host_ms),
                     "all_queued_before_start": all(r["window"]["queued_before_start"] and r["copy_alone_queued_before_start"]
                                                    for r in rounds),
                     "samples": [len(g_in), len(c_in)],
                     "rounds": [{k: v for k, v in r.items() if k != "_samples"} for r in rounds]}
            if args.soak_gemms:
                entry["soak"] = soak(budget, lambda: torch.matmul(a, b), comm, args.soak_gemms, entry, dev,
                                     tr.raise_if_failed, capture=name != "copy_engine")  # (its calls are not captured)
            conc.append(entry)
            if rank == 0:
                print(f"{name} concurrent (comm {budget.comm_sms} SMs, {len(rounds)} rounds): GEMM full "
                      f"{gemm_full:.3f} ms, on budget {entry['gemm_alone_on_budget_ms']:.3f} ms, with comm "
                      f"{entry['gemm_concurrent_ms']:.3f} ms; slowdown median {entry['gemm_slowdown'] * 100:+.1f}% "
                      f"(rounds {', '.join(f'{x * 100:+.1f}' for x in slowdowns)}); fp8 dispatch+combine alone "
                      f"{entry['comm_alone_ms'] * 1e3:.1f} us ({QUEUED} queued), with GEMM "
                      f"{entry['comm_concurrent_ms'] * 1e3:.1f} us, slowdown median "
                      f"{(entry['comm_slowdown'] or float('nan')) * 100:+.1f}%; "
                      f"all queued before start: {entry['all_queued_before_start']}", flush=True)
                if "soak" in entry:
                    k = entry["soak"]
                    windows = ", ".join(f"{key} {k[key]['gemm_ms']:.3f} ms, GEMM stream busy "
                                        f"{k[key]['gemm_stream_busy'] * 100:.0f}% ({k[key]['start']} - {k[key]['end']})"
                                        for key in ("alone", "with_comm", "alone_after"))
                    print(f"{name} soak ({args.soak_gemms} GEMMs, {k['comm_calls_per_gemm']} comm calls per GEMM, "
                          f"{'graph replays' if k['comm_graph'] else 'eager calls'}): {windows}; comm stream busy "
                          f"{k['with_comm']['comm_stream_busy'] * 100:.0f}%; slowdown {k['slowdown'] * 100:+.1f}%",
                          flush=True)
    res["concurrent"] = conc
    if "nvlink_copy_engine" in transports:  # whether the copies went in one cuMemcpyBatchAsync per call
        res["nvlink_copy_engine_batched"] = transports["nvlink_copy_engine"].ops.batched
    end_worker(rank, queue, res)


def soak(budget, gemm, comm, n: int, entry: dict, dev, check, capture: bool) -> dict:
    """The GEMM on the compute budget ``n`` times in a row: alone, then with comm calls queued beside each GEMM on
    the comm stream (enough to outlast it, the same count on every rank), then alone again (so that a drift in
    temperature counts against neither side). The comm is one call captured in a CUDA graph from the comm stream
    (its kernels keep the comm SMs) and replayed, so that the host's time per call does not thin it out (``capture``
    False, or a capture that fails: eager calls). Per loop: the median GEMM time over the middle half from per-GEMM
    events, how busy the GEMM stream was over that half, and the wall-clock window of the GEMMs (for a clock and
    power sampler, nvidia-smi); with comm also how busy the comm stream was over its loop. ``check()`` raises a failed wait."""
    from datetime import datetime, timedelta

    graph, replay = None, comm
    try:
        if not capture:
            raise RuntimeError("not capturable")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=budget.comm_stream):
            comm()
        torch.cuda.synchronize()
        check()
        replay = graph.replay
    except Exception as error:  # (reported: the loop then runs eager calls)
        print(f"soak: comm not captured ({type(error).__name__}: {error}); eager calls", flush=True)
        torch.cuda.synchronize()
        graph, replay = None, comm
    comm_ms = entry["comm_concurrent_ms"] or entry["comm_alone_ms"]
    per_gemm = int(max_over_ranks(math.ceil(1.3 * entry["gemm_alone_on_budget_ms"] / comm_ms), dev))
    out = {"gemms": n, "comm_calls_per_gemm": per_gemm, "comm_graph": graph is not None}
    for label, calls in (("alone", 0), ("with_comm", per_gemm), ("alone_after", 0)):
        torch.cuda.synchronize()
        dist.barrier(device_ids=[dev.index])
        gemms = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        comms = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        start = datetime.now()
        for (g0, g1), (c0, c1) in zip(gemms, comms):
            g0.record(budget.compute_stream)
            with torch.cuda.stream(budget.compute_stream):
                gemm()
            g1.record(budget.compute_stream)
            if calls:
                c0.record(budget.comm_stream)
                with torch.cuda.stream(budget.comm_stream):
                    for _ in range(calls):
                        replay()
                c1.record(budget.comm_stream)
        torch.cuda.synchronize()
        check()
        mid = gemms[n // 4: 3 * n // 4]
        times = [e0.elapsed_time(e1) for e0, e1 in mid]
        span = mid[0][0].elapsed_time(mid[-1][1])
        end = start + timedelta(milliseconds=gemms[0][0].elapsed_time(gemms[-1][1]))
        got = {"gemm_ms": max_over_ranks(statistics.median(times), dev),
               "gemm_stream_busy": min(sum(times) / span, 1.0), "start": start.strftime("%H:%M:%S.%f")[:-3],
               "end": end.strftime("%H:%M:%S.%f")[:-3]}
        if calls:
            busy = sum(c0.elapsed_time(c1) for c0, c1 in comms) / comms[0][0].elapsed_time(comms[-1][1])
            got["comm_stream_busy"] = min(busy, 1.0)
        out[label] = got
    alone = statistics.mean([out["alone"]["gemm_ms"], out["alone_after"]["gemm_ms"]])
    out["slowdown"] = out["with_comm"]["gemm_ms"] / alone - 1
    return out


NOTES = ("times (rows, graph_rows, the NCCL and copy-engine baselines, sm_copy_over_nvlink) are the max over ranks "
         "of per-rank medians (CUDA events; aligned: the GPU clock); the concurrent entries (GEMM and comm times, "
         "slowdowns) are rank 0's, their soak GEMM times the max over ranks; host times are rank 0's. Byte counts "
         "are rank 0's (num_recv, recv_from_peers, sent_to_peers). DeepEP-convention GB/s = bytes of recv_x, every "
         "received row, the rank's own included (BF16: 2 bytes a value; FP8: (1+4/128)/2 of that, e4m3 and one "
         "fp32 scale per 128) / time, a combine counting its dispatch's; NVLink GB/s = bytes of the rows that cross "
         "NVLink (a dispatch's received from other ranks, FP8 with its scales; a combine's sent back to them) / time; "
         "metadata counted in neither (bench/tables.py add_ep_rates)")


def check_arguments(parser, args, gpus: int) -> None:
    """Exit through ``parser.error`` on arguments the run cannot use, before any process starts: ``gpus`` is the
    number of GPUs this machine has."""
    if args.world < 2 or args.world > gpus:
        parser.error(f"--world {args.world}: bench/ep.py runs on 2 or more GPUs of one node, at most the {gpus} "
                     f"GPU(s) this machine has")
    if min(args.tokens, args.hidden, args.experts, args.topk) < 1 or args.hidden % 128:
        parser.error("--tokens, --hidden, --experts, --topk must be positive, --hidden a multiple of 128 "
                     "(one FP8 scale per 128 values)")
    if args.experts % args.world or args.topk > args.experts:
        parser.error(f"--experts {args.experts} must split evenly over {args.world} ranks and be at least --topk")
    if min(args.comm_sms) < 1 or min(args.concurrent_sms, default=1) < 1:
        parser.error("--comm-sms and --concurrent-sms must be at least 1")
    if args.reps < 1 or args.concurrent_rounds < 1:
        parser.error("--reps and --concurrent-rounds must be at least 1")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.name) or args.name.startswith("."):
        parser.error(f"--name {args.name!r}: a plain file name (letters, digits, _ . -), written to bench/results/")
    if 0 < args.soak_gemms < 8 or args.soak_gemms < 0:
        parser.error("--soak-gemms: 0 (no soak) or at least 8 (the middle half is timed)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--comm-sms", type=int, nargs="+", default=[8, 16, 20, 24, 32])
    parser.add_argument("--concurrent-sms", type=int, nargs="*", default=[20])
    parser.add_argument("--concurrent-rounds", type=int, default=4,
                        help="rounds of GEMM alone, comm alone and both (odd rounds in reverse order)")
    parser.add_argument("--soak-gemms", type=int, default=0,
                        help="also run the concurrent GEMM this many times in a row, alone and with comm calls beside it "
                             "(seconds each: for a clock and power sampler), after the rounds")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--transports", nargs="+", default=["nvlink", "nvlink_copy_engine", "copy_engine"],
                        choices=["nvlink", "nvlink_copy_engine", "copy_engine"])
    parser.add_argument("--chunks", type=int, default=8, help="copy_engine: chunks per rank's tokens")
    parser.add_argument("--combine-weights", action="store_true",
                        help="NVLink transports replayed from CUDA graphs: also time a combine that sums top-k weights")
    parser.add_argument("--world", type=int, default=torch.cuda.device_count())
    parser.add_argument("--name", default="ep", help="writes bench/results/<name>.json (default: ep)")
    args = parser.parse_args()
    check_arguments(parser, args, torch.cuda.device_count())
    res = run_ranks(worker, args.world, args)
    result = add_ep_rates({"env": environment(), "shape": vars(args), **res,
                           "notes": NOTES})
    path = write_result(args.name, result)
    print(f"wrote {path}")
    exit_if_roundtrips_failed(res["rows"] + res["graph_rows"], path, "transport")


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
