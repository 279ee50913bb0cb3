"""How fast a few SMs push rows into the peer GPU with 8-byte against 16-byte stores, every rank at once.

The FP8 dispatch that quantizes in its kernel (`NvlinkTransport`, ``quantized_rows_by="sm"``) stores each thread's
e4m3 bytes as two 8-byte halves, into this rank's own rows and into the peer's, and spends about 110 us on 20 SMs
for the 29.3 MB that cross NVLink (DeepSeek-V3 shape). This times that traffic alone: P programs read ``--mbytes``
of local data with 16-byte loads and store it into the peer's memory (and, with ``own``, into local memory too),
as 16-byte stores (``ptx.st_global_na_v4``) or as two 8-byte stores of adjacent halves (``ptx.st_global_na_v2``),
and checks the peer's copy after poisoning it. If 8-byte stores move fewer bytes per second across NVLink, the
quantize loop would gain from pairing its halves into 16-byte stores.

Run on 2 GPUs:  PYTHONPATH=src python3 bench/nvlink_store_width.py --programs 20 24
Writes bench/results/nvlink_store_width.json.
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
def push_kernel(src_ptr, peer_ptr, own_ptr, n_vec, WIDE: tl.constexpr, OWN: tl.constexpr, BLOCK: tl.constexpr):
    """Vectors ``v < n_vec`` (16 bytes each) of ``src`` into ``peer`` (and ``own`` with OWN), program p taking
    blocks p, p + P, ...; WIDE: one 16-byte store per vector, else two 8-byte stores."""
    for v0 in range(tl.program_id(0) * BLOCK, n_vec, tl.num_programs(0) * BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        m = v < n_vec
        w0, w1, w2, w3 = ptx.ld_global_nc_v4(src_ptr + 4 * v, m)
        if WIDE:
            ptx.st_global_na_v4(peer_ptr + 4 * v, w0, w1, w2, w3, m)
            if OWN:
                ptx.st_global_na_v4(own_ptr + 4 * v, w0, w1, w2, w3, m)
        else:
            ptx.st_global_na_v2(peer_ptr + 4 * v, w0, w1, m)
            ptx.st_global_na_v2(peer_ptr + 4 * v + 2, w2, w3, m)
            if OWN:
                ptx.st_global_na_v2(own_ptr + 4 * v, w0, w1, m)
                ptx.st_global_na_v2(own_ptr + 4 * v + 2, w2, w3, m)


def worker(rank, world, port, args, queue):
    dev = join_nccl(rank, world, port)
    n_words = args.mbytes * 2**20 // 16 * 4  # int32 words, whole 16-byte vectors
    buf, into_peer = symmetric_with_next(n_words, torch.int32, dev)
    g = torch.Generator(device="cpu").manual_seed(rank)
    src = torch.randint(-2**31, 2**31 - 1, (n_words,), generator=g, dtype=torch.int32).to(dev)
    own = torch.empty_like(src)
    n_vec = n_words // 4
    rows = []
    for P in args.programs:
        for wide in (True, False):
            for with_own in (False, True):
                def push():
                    push_kernel[(P,)](src, into_peer, own, n_vec, WIDE=wide, OWN=with_own, BLOCK=args.block,
                                      num_warps=args.warps)
                buf.fill_(-1)  # poison what the peer's push must overwrite
                own.fill_(-1)
                torch.cuda.synchronize()
                dist.barrier(device_ids=[rank])
                push()
                torch.cuda.synchronize()
                dist.barrier(device_ids=[rank])
                peer_src = torch.randint(-2**31, 2**31 - 1, (n_words,), dtype=torch.int32,
                                         generator=torch.Generator(device="cpu").manual_seed((rank - 1) % world))
                equal = bool(torch.equal(buf.cpu(), peer_src)) and (not with_own or bool(torch.equal(own, src)))
                equal = max_over_ranks(float(not equal), dev) == 0  # on every rank
                ms = max_over_ranks(time_ms(push, warmup=3, repeat=args.reps)["median_ms"], dev)
                row = {"programs": P, "store_bytes": 16 if wide else 8, "own_too": with_own, "ms": ms,
                       "peer_gb_s": n_words * 4 / ms / 1e6, "equal": equal}
                rows.append(row)
                if rank == 0:
                    print(f"P={P:2d} {row['store_bytes']:2d}-byte stores{' + own' if with_own else '       '}: "
                          f"{ms * 1e3:7.1f} us, {row['peer_gb_s']:6.1f} GB/s into the peer; equal {equal}",
                          flush=True)
    end_worker(rank, queue, {"rows": rows, "bytes_into_peer": n_words * 4})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mbytes", type=int, default=28, help="MiB each rank pushes (the FP8 dispatch: about 28)")
    parser.add_argument("--programs", type=int, nargs="+", default=[20, 24])
    parser.add_argument("--block", type=int, default=2048, help="16-byte vectors per program per step")
    parser.add_argument("--warps", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    run_and_write("nvlink_store_width", worker, args,
                  "both ranks push at once; max over ranks of per-rank CUDA-event medians")


if __name__ == "__main__":
    main()
