"""Does NVLink carry more from one GPU to the other when the sender's SMs push part of the bytes and the receiver's
SMs pull the rest, than when the sender's SMs push them all? Every rank at once (each both sends and receives).

The FP8 dispatch that quantizes in its kernel moves its 29.3 MB of peer rows as the sender's SM stores, at about
the rate plain 16-byte pushes reach (`bench/nvlink_store_width.py`: at best ~265 GB/s, 111 us for 28 MiB), below
the copy engines' ~360-380 GB/s. If SM stores and SM loads across NVLink are limited apart (the requests a GPU's
SMs keep in flight to the link, per direction of the request), a dispatch whose receiver pulls a share of the rows
(staged by the sender in its own memory) could move them faster. Here each rank's ``P`` programs move ``--mbytes``
MiB of the peer's data into this rank's buffer: the first ``share`` of it pushed by the peer's programs, the rest
pulled by this rank's programs (both halves at once, every program doing both, block by block); share 1.0 = push
only, 0.0 = pull only. The result is checked against the peer's data after poisoning.

    PYTHONPATH=src python3 bench/nvlink_push_pull.py --programs 20 --shares 1.0 0.0 0.5 0.6 0.7

Writes bench/results/nvlink_push_pull.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import end_worker, join_nccl, max_over_ranks, run_and_write, symmetric_with_next, time_ms  # noqa: E402

from smsplit import ptx  # noqa: E402


@triton.jit
def push_pull_kernel(src_ptr, peer_src_ptr, dst_ptr, peer_dst_ptr, n_push, n_vec, BLOCK: tl.constexpr):
    """Vectors (16 bytes) ``v < n_push`` of this rank's ``src`` into the peer's ``dst`` (stores across NVLink);
    vectors ``n_push <= v < n_vec`` of the peer's ``src`` into this rank's ``dst`` (loads across NVLink). Program p
    takes blocks p, p + P, ... of each range, alternating."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    n_pull = n_vec - n_push
    steps = tl.maximum(tl.cdiv(n_push, BLOCK), tl.cdiv(n_pull, BLOCK))
    for s in range(pid, steps, programs):
        v = s * BLOCK + tl.arange(0, BLOCK)
        m = v < n_push
        w0, w1, w2, w3 = ptx.ld_global_nc_v4(src_ptr + 4 * v, m)
        ptx.st_global_na_v4(peer_dst_ptr + 4 * v, w0, w1, w2, w3, m)
        u = n_push + v
        m = v < n_pull
        w0, w1, w2, w3 = ptx.ld_global_nc_v4(peer_src_ptr + 4 * u, m)
        ptx.st_global_na_v4(dst_ptr + 4 * u, w0, w1, w2, w3, m)


def worker(rank, world, port, args, queue):
    dev = join_nccl(rank, world, port)
    n_words = args.mbytes * 2**20 // 16 * 4
    buf, peer_buf = symmetric_with_next(2 * n_words, torch.int32, dev)  # [src | dst]
    peer = (rank + 1) % world
    src, dst = buf[:n_words], buf[n_words:]
    peer_src, peer_dst = peer_buf[:n_words], peer_buf[n_words:]
    expected = torch.randint(-2**31, 2**31 - 1, (n_words,), dtype=torch.int32,
                             generator=torch.Generator(device="cpu").manual_seed(100 + peer))
    src.copy_(torch.randint(-2**31, 2**31 - 1, (n_words,), dtype=torch.int32,
                            generator=torch.Generator(device="cpu").manual_seed(100 + rank)).to(dev))
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    n_vec = n_words // 4
    rows = []
    for P in args.programs:
        for share in args.shares:
            n_push = round(share * n_vec)

            def move():
                push_pull_kernel[(P,)](src, peer_src, dst, peer_dst, n_push, n_vec, BLOCK=args.block,
                                       num_warps=args.warps)
            dst.fill_(-1)  # poison
            torch.cuda.synchronize()
            dist.barrier(device_ids=[rank])
            move()
            torch.cuda.synchronize()
            dist.barrier(device_ids=[rank])
            equal = bool(torch.equal(dst.cpu(), expected))
            equal = max_over_ranks(float(not equal), dev) == 0
            ms = max_over_ranks(time_ms(move, warmup=3, repeat=args.reps)["median_ms"], dev)
            row = {"programs": P, "push_share": share, "ms": ms, "into_each_gb_s": n_words * 4 / ms / 1e6,
                   "equal": equal}
            rows.append(row)
            if rank == 0:
                print(f"P={P:2d} pushed {share:4.2f}: {ms * 1e3:7.1f} us, {row['into_each_gb_s']:6.1f} GB/s into "
                      f"each rank; equal {equal}", flush=True)
    end_worker(rank, queue, {"rows": rows, "bytes_into_each_rank": n_words * 4})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mbytes", type=int, default=28, help="MiB each rank receives (the FP8 dispatch: about 28)")
    parser.add_argument("--programs", type=int, nargs="+", default=[20])
    parser.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.0, 0.5])
    parser.add_argument("--block", type=int, default=2048, help="16-byte vectors per program per step and range")
    parser.add_argument("--warps", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    run_and_write("nvlink_push_pull", worker, args,
                  "every rank at once; max over ranks of per-rank CUDA-event medians")


if __name__ == "__main__":
    main()
