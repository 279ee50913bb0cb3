"""What one GPU's SMs and copy engines can push to / pull from a peer over NVLink, every rank at once.

The dispatch of the DeepSeek-V3 shape moves ~58.5 MB (BF16) from each rank to the other; this measures the
same number of bytes with the building blocks a transport can use, for a range of SM counts:
``sm_copy(method="ldst")`` (16-byte loads/stores by every thread) and ``sm_copy(method="tma")`` (TMA bulk
tensor copies through shared memory), each writing into the peer's memory and reading from it, and a copy-engine
copy (``Tensor.copy_`` between peers: zero SMs). Times are the max over ranks of per-rank medians. ``--mixed S ...``:
the copy engine moves the first share S of the bytes while SM programs push the rest, both at once (is the link
wider than either alone?).

Run on 2 GPUs:  PYTHONPATH=src python3 bench/nvlink_link.py
                PYTHONPATH=src python3 bench/nvlink_link.py --only-pieces --pieces 4 --mixed 0.5 0.7 0.9 --programs 20 32
Writes bench/results/nvlink_link.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import join_nccl, max_over_ranks, run_and_write, time_ms  # noqa: E402

CONFIGS = {  # name -> sm_copy keyword arguments
    "ldst_b2048_w8": dict(method="ldst", block=2048, num_warps=8),
    "ldst_b4096_w16": dict(method="ldst", block=4096, num_warps=16),
    "tma_b1024_s8_w4": dict(method="tma", block=1024, stages=8, num_warps=4),
    "tma_b512_s12_w4": dict(method="tma", block=512, stages=12, num_warps=4),
    "tma_b2048_s6_w4": dict(method="tma", block=2048, stages=6, num_warps=4),
}


def worker(rank, world, port, args, queue):
    dev = join_nccl(rank, world, port)
    from smsplit.copy import sm_copy
    from smsplit.ep.transport import symmetric_buffer

    nbytes = args.mbytes * 2**20 // 16 * 16
    n = nbytes // 2
    buf, handle = symmetric_buffer(2 * n, torch.bfloat16, dist.group.WORLD, dev)
    peer = (rank + 1) % world
    peer_in = handle.get_buffer(peer, (n,), torch.bfloat16, storage_offset=0)  # we write here
    peer_out = handle.get_buffer(peer, (n,), torch.bfloat16, storage_offset=n)  # we read from here
    g = torch.Generator(device="cpu").manual_seed(rank)
    src = torch.randn(n, generator=g).to(dev, torch.bfloat16)
    buf[n:].copy_(torch.randn(n, generator=g).to(dev, torch.bfloat16))
    local = torch.empty(n, dtype=torch.bfloat16, device=dev)

    def timed(fn):
        dist.barrier(device_ids=[rank])
        return max_over_ranks(time_ms(fn, warmup=3, repeat=args.reps)["median_ms"], dev)

    # correctness of each path once: poison, copy, compare
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    checks = {}
    for name, kw in CONFIGS.items():
        local.fill_(float("nan"))
        sm_copy(local, peer_out, 20, **kw)
        torch.cuda.synchronize()
        expect = handle.get_buffer(peer, (n,), torch.bfloat16, storage_offset=n)
        checks[name] = bool(torch.equal(local, expect))
    rows = []
    ce = timed(lambda: peer_in.copy_(src))
    # the same bytes as `pieces` copies (a run of rows each, as bulk="copy_engine" moves them): one driver call
    # each, or one cuMemcpyBatchAsync; every rank at once, then one rank at a time (the other idle)
    from smsplit.ep.copy_engine import StreamOps

    ops = StreamOps(dev)
    stream = torch.cuda.current_stream()
    cuts = torch.linspace(0, nbytes // 16, args.pieces + 1).long().tolist()
    pieces = [(peer_in.data_ptr() + 16 * a, src.data_ptr() + 16 * a, 16 * (b - a)) for a, b in zip(cuts, cuts[1:])]

    def one_by_one():
        for dst, source, size in pieces:
            ops.memcpy(stream, dst, source, size)

    side = [torch.cuda.Stream(dev) for _ in range(3)]

    def spread(n_streams):  # pieces round-robin over n_streams streams (each a copy engine queue)
        streams = [stream] + side[: n_streams - 1]
        for s in streams[1:]:
            s.wait_stream(stream)
        for i, (dst, source, size) in enumerate(pieces):
            ops.memcpy(streams[i % n_streams], dst, source, size)
        for s in streams[1:]:
            stream.wait_stream(s)

    pieced = {"pieces": args.pieces,
              "streams2_ms": timed(lambda: spread(2)),
              "streams4_ms": timed(lambda: spread(4)),
              "one_copy_ms": ce,
              "individual_ms": timed(one_by_one),
              "batched_ms": timed(lambda: ops.memcpy_batch(stream, pieces)),
              "batched_works": ops.batched}
    flag_src = torch.zeros(1, dtype=torch.int32, device=dev)
    flag_dst = handle.get_buffer(peer, (1,), torch.int32, storage_offset=0)  # (a word of the peer's first half)

    def flagged():  # each piece followed by a 4-byte copy to the peer (a chunk's copy-done flag)
        for dst, source, size in pieces:
            ops.memcpy(stream, dst, source, size)
            ops.memcpy(stream, flag_dst.data_ptr(), flag_src.data_ptr(), 4)

    def peer_and_local():  # the peer copy and a local copy of the same bytes at once, on two streams
        side[0].wait_stream(stream)
        with torch.cuda.stream(side[0]):
            local.copy_(src)
        peer_in.copy_(src)
        stream.wait_stream(side[0])

    pieced.update({"flagged_ms": timed(flagged),
                   "local_copy_engine_ms": timed(lambda: local.copy_(src)),
                   "peer_and_local_ms": timed(peer_and_local),
                   "sm_local_tma_20_ms": timed(lambda: sm_copy(local, src, 20, method="tma")),
                   "sm_local_ldst_20_ms": timed(lambda: sm_copy(local, src, 20, block=4096, num_warps=16))})
    for share in args.mixed:  # the copy engine moves the first `share` of the bytes, P SM programs the rest, at once
        cut = int(nbytes * share) // 16 * 16

        def mixed(P, kw, cut=cut):
            side[0].wait_stream(stream)
            ops.memcpy(side[0], peer_in.data_ptr(), src.data_ptr(), cut)
            sm_copy(peer_in[cut // 2:], src[cut // 2:], P, **kw)
            stream.wait_stream(side[0])
        buf[:n].fill_(float("nan"))
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        mixed(20, CONFIGS["ldst_b4096_w16"])
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        g_writer = torch.Generator(device="cpu").manual_seed((rank - 1) % world)  # the rank whose src lands here
        pieced[f"mixed_{share}_equal"] = bool(torch.equal(buf[:n], torch.randn(n, generator=g_writer).to(dev, torch.bfloat16)))
        for P in args.programs:
            for name in ("ldst_b4096_w16", "tma_b1024_s8_w4"):
                pieced[f"mixed_{share}_{name}_P{P}_ms"] = timed(lambda: mixed(P, CONFIGS[name]))
    for who in range(world):  # one direction only: rank `who` copies, the others wait at the barrier
        dist.barrier(device_ids=[rank])
        if rank == who:
            pieced[f"one_copy_rank{who}_alone_ms"] = time_ms(lambda: peer_in.copy_(src), warmup=3, repeat=args.reps)["median_ms"]
            pieced[f"batched_rank{who}_alone_ms"] = time_ms(lambda: ops.memcpy_batch(stream, pieces), warmup=3,
                                                            repeat=args.reps)["median_ms"]
        torch.cuda.synchronize()
    gathered = [None] * world
    dist.all_gather_object(gathered, pieced)
    pieced = {k: v for d in gathered for k, v in d.items()}
    if rank == 0:
        print("copy engine, pieces:", {k: round(v * 1e3, 1) if k.endswith("_ms") else v for k, v in pieced.items()},
              flush=True)
    for P in [] if args.only_pieces else args.programs:
        for name, kw in CONFIGS.items():
            w = timed(lambda: sm_copy(peer_in, src, P, **kw))
            r = timed(lambda: sm_copy(local, peer_out, P, **kw))
            rows.append({"config": name, "programs": P, "write_ms": w, "read_ms": r,
                         "write_gbps": nbytes / w / 1e6, "read_gbps": nbytes / r / 1e6})
            if rank == 0:
                print(f"{name:18s} P={P:3d}: write {rows[-1]['write_gbps']:6.1f} GB/s, read {rows[-1]['read_gbps']:6.1f} GB/s",
                      flush=True)
    if rank == 0:
        print(f"copy engine: {nbytes / ce / 1e6:.1f} GB/s ({ce * 1e3:.1f} us for {nbytes / 1e6:.1f} MB)", flush=True)
        queue.put({"bytes": nbytes, "copy_engine_ms": ce, "copy_engine_gbps": nbytes / ce / 1e6, "rows": rows,
                   "read_checks_equal": checks, "copy_engine_pieces": pieced})
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mbytes", type=int, default=56, help="MiB each rank moves (the BF16 dispatch moves ~56)")
    parser.add_argument("--programs", type=int, nargs="+", default=[8, 16, 20, 24, 32])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--pieces", type=int, default=23, help="copy-engine copies the bytes are cut into")
    parser.add_argument("--only-pieces", action="store_true", help="skip the SM copies")
    parser.add_argument("--mixed", type=float, nargs="*", default=[],
                        help="copy-engine shares of a copy split with SM programs, both at once")
    parser.add_argument("--world", type=int, default=torch.cuda.device_count())
    args = parser.parse_args()
    run_and_write("nvlink_link", worker, args,
                  "every rank copies at once; time = max over ranks of medians")


if __name__ == "__main__":
    main()
