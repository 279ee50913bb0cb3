"""Copy-engine peer copies between the GPUs of one node: the ceiling of the copy-engine EP transport.

Every rank at once copies ``--mb`` MB into (push) or out of (pull) its peer's symmetric buffer with
``cuMemcpyDtoDAsync`` on dedicated streams, whole or in chunks spread round-robin over 1, 2 or 4
streams; and a chained variant where each chunk waits on a flag (``cuStreamWaitValue32``) and is
followed by a write of a flag in the peer's memory (``cuStreamWriteValue32``), as the transport does.
The profiler confirms that no kernel runs (zero SMs). Writes ``bench/results/copy_engine.json``.

    python3 bench/copy_engine.py
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import call_times_ms, environment, join_nccl, max_over_ranks, run_ranks, write_result


def worker(rank, world, port, args, queue):
    dev = join_nccl(rank, world, port)
    from smsplit.ep.copy_engine import StreamOps
    from smsplit.ep.transport import symmetric_buffer

    nbytes = int(args.mb * 1e6) // 4096 * 4096
    buf, handle = symmetric_buffer(2 * nbytes + 4096, torch.uint8, dist.group.WORLD, dev)
    peer = (rank + 1) % world
    local = buf.data_ptr()
    remote = handle.buffer_ptrs[peer]
    flags_off = 2 * nbytes
    buf[flags_off:].zero_()
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    buf[:nbytes].copy_(src)
    ops = StreamOps(dev)
    streams = [torch.cuda.Stream(dev) for _ in range(4)]
    torch.cuda.synchronize()

    epoch = [0]

    def copy(dst, src_ptr, n_chunks, n_streams, chained=False):
        epoch[0] += 1
        main = torch.cuda.current_stream()
        ev = torch.cuda.Event()
        ev.record(main)
        chunk = nbytes // n_chunks
        for s in streams[:n_streams]:
            s.wait_event(ev)
        for c in range(n_chunks):
            s = streams[c % n_streams]
            if chained:
                ops.wait_geq(s, local + flags_off, 0)  # a flag that is already set: the cost of the op itself
            ops.memcpy(s, dst + c * chunk, src_ptr + c * chunk, chunk)
            if chained:
                ops.write(s, remote + flags_off + 64 + 4 * c, epoch[0])
        for s in streams[:n_streams]:
            e = torch.cuda.Event()
            e.record(s)
            main.wait_event(e)

    def together():  # every rank starts each timed call from an idle GPU at the same time
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])

    def timed(fn, reps=args.reps):
        return max_over_ranks(statistics.median(call_times_ms(fn, warmup=3, repeat=reps, before=together)), dev)

    rows = []
    for direction in ("push", "pull"):
        for n_chunks in (1, 8, 16):
            for n_streams in (1, 2, 4):
                if n_streams > n_chunks:
                    continue
                for chained in ((False, True) if n_chunks > 1 and direction == "push" else (False,)):
                    dst, src_ptr = (remote + nbytes, local) if direction == "push" else (local + nbytes, remote)
                    fn = functools.partial(copy, dst, src_ptr, n_chunks, n_streams, chained)
                    ms = timed(fn)
                    rows.append({"direction": direction, "chunks": n_chunks, "streams": n_streams,
                                 "chained": chained, "ms": ms, "gbps": nbytes / ms / 1e6})
                    if rank == 0:
                        print(f"{direction} chunks={n_chunks:2d} streams={n_streams} chained={chained!s:5}: "
                              f"{ms * 1e3:7.1f} us {nbytes / ms / 1e6:6.1f} GB/s", flush=True)
    # correctness of the pushed bytes and the flags written into the peer
    copy(remote + nbytes, local, 8, 2, True)
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    got = buf[nbytes: 2 * nbytes]
    gathered = [torch.empty_like(src) for _ in range(world)]
    dist.all_gather(gathered, src)
    ok_data = bool(torch.equal(got, gathered[(rank - 1) % world]))
    flags = buf[flags_off + 64: flags_off + 64 + 32].view(torch.int32).tolist()
    # a local memcpy on the same device, for the unpack budget
    local_ms = timed(lambda: ops.memcpy(torch.cuda.current_stream(), local + nbytes, local, nbytes))

    # no kernel runs for a copy
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        copy(remote + nbytes, local, 8, 2, True)
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    res = {"rank": rank, "bytes": nbytes, "rows": rows, "data_ok": ok_data, "peer_flags": flags,
           "local_memcpy_ms": local_ms, "local_memcpy_gbps": nbytes / local_ms / 1e6, "gpu_events": names}
    oks = [None] * world
    dist.all_gather_object(oks, (ok_data, names))
    res["all_ranks"] = oks
    if rank == 0:
        print(f"data ok on every rank: {oks}; peer flags {flags}; local memcpy {nbytes / local_ms / 1e6:.0f} GB/s",
              flush=True)
        queue.put(res)
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=58.4, help="bytes per rank and copy, in MB")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    world = 2
    res = {"env": environment(), "world": world, **run_ranks(worker, world, args)}
    write_result("copy_engine", res)


if __name__ == "__main__":
    main()
