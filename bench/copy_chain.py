"""What a combine's copy-engine chain costs beyond its bytes, in CUDA graphs, every rank at once.

A `nvlink_copy_engine` combine queues on a copy stream: a wait until the peer has summed the previous combine
(``cuStreamWaitValue32``) and a reset of that word (``cuStreamWriteValue32``), then each chunk of rows
followed by a 4-byte copy of a counter into the peer's chunk flag, then a one-thread kernel bumping the counter.
Here each variant of that chain is captured in a CUDA graph and replayed (58.7 MB per rank, as the DeepSeek-V3
shape's combine moves; chunks 0.5 / 0.8 / 1 of the rows unless named), so that the cost of each piece shows:
flags as 4-byte copies or as stream memory writes into the peer's word, the start's wait and reset, the bump
kernel. Data and flags are checked on the peer after the runs. Times: max over ranks of per-rank medians of
replays, ranks started together after a barrier.

Measured (session 13, `bench/results/copy_chain_session13.log`, `copy_chain_beside_session13.log`): one copy
159-162 us, the combine's chain 182-185: 3 pieces +6-8, their flags +6-7 (as stream memory writes no cheaper), the
bump kernel +6-7, the start's wait and reset +2-4. Session 14 (`copy_chain_session14.log`): flags on a stream of
their own (``flag="side"``) were copied after the next chunk, not beside it (they queue behind it on the copy engine).

    PYTHONPATH=src python3 bench/copy_chain.py
Writes bench/results/copy_chain.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import capture_graph, join_nccl, max_over_ranks, run_and_write, time_ms  # noqa: E402


def worker(rank, world, port, args, queue):
    dev = join_nccl(rank, world, port)
    from smsplit.ep.copy_engine import StreamOps
    from smsplit.ep.nvlink import bump_kernel
    from smsplit.ep.transport import symmetric_buffer

    nbytes = 4096 * 7168 * 2
    buf, handle = symmetric_buffer(nbytes + 4096, torch.uint8, dist.group.WORLD, dev)
    peer = (rank + 1) % world
    peer_rows = handle.get_buffer(peer, (nbytes,), torch.uint8, storage_offset=0).data_ptr()
    peer_flags = handle.get_buffer(peer, (64,), torch.int32, storage_offset=nbytes // 4).data_ptr()  # 64 words
    own_flags = buf[nbytes:nbytes + 256].view(torch.int32)
    g = torch.Generator(device="cpu").manual_seed(rank)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).to(dev)
    counter = torch.ones(1, dtype=torch.int32, device=dev)
    ops = StreamOps(dev)
    cs = torch.cuda.Stream(dev)
    fs = torch.cuda.Stream(dev)  # flag="side": each chunk's flag on a stream of its own, after the chunk's event

    def cuts(fractions):
        ends = [int(nbytes // 16 * f) * 16 for f in fractions]
        return list(zip([0] + ends[:-1], ends))

    def chain(fractions, flag="copy", start="wait_reset", bump=True, join=True):
        def fn():
            main = torch.cuda.current_stream()
            cs.wait_stream(main)
            if start in ("wait_reset", "wait"):
                ops.wait_geq(cs, own_flags.data_ptr() + 4 * 32, 1)  # the peer's "summed" word: always set here
            if start == "wait_reset":
                ops.write(cs, own_flags.data_ptr() + 4 * 40, 0)  # (a reset of a word nobody reads)
            for c, (a, b) in enumerate(cuts(fractions)):
                ops.memcpy(cs, peer_rows + a, src.data_ptr() + a, b - a)
                if flag == "copy":
                    ops.memcpy(cs, peer_flags + 4 * c, counter.data_ptr(), 4)
                elif flag == "memop":
                    ops.write(cs, peer_flags + 4 * c, 1)
                elif flag == "side":  # the next chunk starts while this one's flag is copied
                    fs.wait_stream(cs)
                    ops.memcpy(fs, peer_flags + 4 * c, counter.data_ptr(), 4)
                if start == "wait_late_reset" and c == 0:
                    ops.write(cs, own_flags.data_ptr() + 4 * 40, 0)
            if bump:
                if flag == "side":
                    cs.wait_stream(fs)  # the flags have read the counter
                with torch.cuda.stream(cs):
                    bump_kernel[(1,)](counter, num_warps=1)
            if join:
                main.wait_stream(cs)
                if flag == "side":
                    main.wait_stream(fs)
        return fn

    own_flags.zero_()
    own_flags[32] = 1
    variants = {
        "one_copy": chain([1.0], flag=None, start=None, bump=False),
        "chunks3_bare": chain([0.5, 0.8, 1.0], flag=None, start=None, bump=False),
        "chunks3_copy_flags": chain([0.5, 0.8, 1.0], flag="copy", start=None, bump=False),
        "chunks3_memop_flags": chain([0.5, 0.8, 1.0], flag="memop", start=None, bump=False),
        "chunks3_copy_flags_bump": chain([0.5, 0.8, 1.0], flag="copy", start=None, bump=True),
        "chunks3_main_chain": chain([0.5, 0.8, 1.0], flag="copy", start="wait_reset", bump=True),
        "chunks3_wait_only": chain([0.5, 0.8, 1.0], flag="copy", start="wait", bump=True),
        "chunks3_late_reset": chain([0.5, 0.8, 1.0], flag="copy", start="wait_late_reset", bump=True),
        "chunks3_memop_all": chain([0.5, 0.8, 1.0], flag="memop", start="wait_late_reset", bump=False),
        "chunks3_side_flags": chain([0.5, 0.8, 1.0], flag="side", start=None, bump=False),
        "chunks3_side_flags_bump": chain([0.5, 0.8, 1.0], flag="side", start=None, bump=True),
        "chunks4_copy_flags": chain([0.5, 0.75, 0.9, 1.0], flag="copy", start=None, bump=False),
        "chunks4_side_flags": chain([0.5, 0.75, 0.9, 1.0], flag="side", start=None, bump=False),
        "chunks6_side_flags": chain([0.3, 0.5, 0.68, 0.82, 0.93, 1.0], flag="side", start=None, bump=False),
        "chunks6_copy_flags": chain([0.3, 0.5, 0.68, 0.82, 0.93, 1.0], flag="copy", start=None, bump=False),
        "chunks6_memop_flags": chain([0.3, 0.5, 0.68, 0.82, 0.93, 1.0], flag="memop", start=None, bump=False),
    }
    times = {}
    for name, fn in variants.items():
        graph = capture_graph(fn, dev)
        dist.barrier(device_ids=[rank])
        times[name] = max_over_ranks(time_ms(graph.replay, warmup=3, repeat=args.reps)["median_ms"], dev) * 1e3
        del graph
    # a kernel of 20 programs beside the chain, as a combine runs its kernel beside its copies: when does the first
    # copy start after the kernel, with and without the start's wait and reset? One replay each under the profiler.
    from smsplit.copy import sm_copy

    scratch = torch.empty(24 << 20, dtype=torch.uint8, device=dev)
    scratch_src = torch.randint(0, 256, (24 << 20,), dtype=torch.uint8, device=dev)
    beside = {}
    for name, start, flag in (("kernel_beside_main_chain", "wait_reset", "copy"),
                              ("kernel_beside_chain_no_start", None, "copy"),
                              ("kernel_beside_side_flags_no_start", None, "side")):
        chain_fn = chain([0.5, 0.8, 1.0], flag=flag, start=start, bump=True, join=False)

        def both(chain_fn=chain_fn):
            chain_fn()  # the copies are queued before the kernel, as combine() does
            sm_copy(scratch, scratch_src, 20, block=4096, num_warps=16)
            torch.cuda.current_stream().wait_stream(cs)  # (with bump, cs has waited for the side flags)
        graph = capture_graph(both, dev)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        ms = time_ms(graph.replay, warmup=3, repeat=args.reps)["median_ms"]
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        path = Path(f"/tmp/copy_chain_{name}_rank{rank}.json")
        prof.export_chrome_trace(str(path))
        events = sorted((e for e in json.loads(path.read_text())["traceEvents"]
                         if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                        key=lambda e: e["ts"])
        t0 = events[0]["ts"] if events else 0
        kernel = [e for e in events if e["cat"] == "kernel" and "copy" in e["name"].lower()]
        copies = [e for e in events if e["cat"] == "gpu_memcpy"]
        beside[name] = {"replay_us": ms * 1e3,
                        "events": [(e["name"][:24], round(e["ts"] - t0, 1), round(e["dur"], 1)) for e in events],
                        "first_copy_after_kernel_us": (round(copies[0]["ts"] - kernel[0]["ts"], 1)
                                                       if kernel and copies else None)}
        del graph
    # checks: the rows landed on the peer, and the memop flags were written there
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    g_peer = torch.Generator(device="cpu").manual_seed((rank - 1) % world)
    rows_equal = bool(torch.equal(buf[:nbytes], torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                                              generator=g_peer).to(dev)))
    flags_set = own_flags[:6].tolist()
    res = {"rank": rank, "rows_equal": rows_equal, "flags": flags_set, "beside": beside}
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        for name, us in times.items():
            print(f"{name:28s} {us:8.1f} us", flush=True)
        for r in gathered:
            for name, b in r["beside"].items():
                print(f"rank {r['rank']} {name}: replay {b['replay_us']:.1f} us, first copy "
                      f"{b['first_copy_after_kernel_us']} us after the kernel's start; {b['events']}", flush=True)
        print("checks:", gathered, flush=True)
        queue.put({"bytes": nbytes, "us": times, "checks": gathered})
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--world", type=int, default=torch.cuda.device_count())
    args = parser.parse_args()
    run_and_write("copy_chain", worker, args,
                  "graph replays, every rank at once; max over ranks of medians")


if __name__ == "__main__":
    main()
