"""Why does the FP8 dispatch that quantizes and pushes its rows get slower with more comm SMs, when plain pushes of
the same bytes get faster? Its stores without its arithmetic, every rank at once.

Session 25: plain 16-byte pushes of 28 MiB into the peer take 110.0 us from 20 programs and 98.9-104.8 from 32
(`bench/nvlink_push_pull.py`), while the pushed FP8 dispatch's kernel ends 114.0-114.5 us after the ranks meet at 20
SMs and 125.6-125.9 at 32 (`bench/ep_timeline.py`). Here ``P`` programs move 4096 rows of bf16 x (7168 values, the
DeepSeek-V3 shape) as the dispatch does, minus the quantization: each step reads ``TB`` tokens' rows in chunks of
``QG`` groups of 128 values (two 16-byte loads per thread, vectors j and j + 8 of a group: `nvlink.load_chunk`) and
stores 7168 bytes per row (the size of its e4m3 row: the first 8 bytes of each loaded vector stand in for the e4m3
bytes) into the peer's rows and into this rank's own rows, as

* ``halves``: two 8-byte stores per thread per chunk at the dispatch's offsets (`nvlink.chunk_halves`);
* ``wide``: one 16-byte store per thread per chunk (its 16 bytes contiguous: values 16 j .. of the group);

with or without the dispatch's other stores (``scales``: one fp32 per 128 values by the first thread of each group,
`nvlink.store_chunk_scales`; ``meta``: 8 int64 ids, 8 fp32 weights and an int32 source index per row). Every rank
at once, times the max over ranks of per-rank CUDA-event medians; the peer's rows checked after poisoning.

    PYTHONPATH=src python3 bench/nvlink_fp8_pattern.py --programs 20 32

Writes bench/results/nvlink_fp8_pattern.json.
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
from smsplit.ep.nvlink import chunk_halves, load_chunk  # noqa: E402


@triton.jit
def fp8_pattern_kernel(x_ptr, peer_ptr, own_ptr, peer_s_ptr, own_s_ptr, peer_m_ptr, own_m_ptr, T, H,
                       WIDE: tl.constexpr, SCALES: tl.constexpr, META: tl.constexpr, TB: tl.constexpr,
                       QG: tl.constexpr):
    """Rows of x (bf16 ``[T, H]``) to ``H``-byte rows at ``peer_ptr`` and ``own_ptr`` (int32 words), the dispatch's
    way (see the module docstring); scales (``[T, H // 128]`` words) and metadata (int32 words ``[T, 16]`` for the
    ids, then ``[T, 8]`` for the weights, then ``[T]`` for the source, as three regions like the dispatch's) beside
    them."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    n_groups = H // 128
    row_words = H // 4
    f = tl.arange(0, QG * 8)[None, :]
    k16 = tl.arange(0, 16)[None, :]
    for t0 in range(pid * TB, T, programs * TB):
        t = t0 + tl.arange(0, TB)
        tmask = t < T
        t64 = t.to(tl.int64)[:, None]
        if META:
            for dst in tl.static_range(2):
                m_base = peer_m_ptr if dst == 0 else own_m_ptr
                tl.store(m_base + t64 * 16 + k16, t[:, None] + k16, mask=tmask[:, None])
                tl.store(m_base + T * 16 + t64 * 8 + k16, t[:, None] - k16, mask=tmask[:, None] & (k16 < 8))
                tl.store(m_base + T * 24 + t64, t[:, None], mask=tmask[:, None])
        for g0 in range(0, n_groups, QG):
            a0, a1, a2, a3, b0, b1, b2, b3 = load_chunk(x_ptr, t64, tmask, g0, H, QG, TB)
            q0, q1 = tl.reshape(a0, (TB, QG * 8)), tl.reshape(a1, (TB, QG * 8))
            q2, q3 = tl.reshape(b0, (TB, QG * 8)), tl.reshape(b1, (TB, QG * 8))
            g = g0 + f // 8
            ok = tmask[:, None] & (g < n_groups)
            lo, hi = chunk_halves(g0, QG)
            for dst in tl.static_range(2):
                row = (peer_ptr if dst == 0 else own_ptr) + t64 * row_words
                if WIDE:
                    ptx.st_global_na_v4(row + 32 * g + 4 * (f % 8), q0, q1, q2, q3, ok)
                else:
                    ptx.st_global_na_v2(row + lo, q0, q1, ok)
                    ptx.st_global_na_v2(row + hi, q2, q3, ok)
                if SCALES:
                    s_base = peer_s_ptr if dst == 0 else own_s_ptr
                    ptx.st_global_b32(s_base + t64 * n_groups + g, q0, ok & (f % 8 == 0))


def expected_rows(x: torch.Tensor, wide: bool) -> torch.Tensor:
    """The bytes the kernel stores per row (int32 words ``[T, H // 4]``), computed on the host from x."""
    T, H = x.shape
    v = x.view(torch.int32).view(T, H // 128, 16, 4)  # 16-byte vectors of each group
    if wide:  # thread j: words 0-1 of vector j, then words 0-1 of vector j + 8
        rows = torch.cat([v[:, :, :8, :2], v[:, :, 8:, :2]], dim=3)  # [T, G, 8, 4]
    else:  # thread j: words 0-1 of vector j at 8 j, words 0-1 of vector j + 8 at 64 + 8 j
        rows = torch.cat([v[:, :, :8, :2], v[:, :, 8:, :2]], dim=2)  # [T, G, 16, 2]
    return rows.reshape(T, H // 4)


def worker(rank, world, port, args, queue):
    dev = join_nccl(rank, world, port)
    T, H = args.tokens, args.hidden
    G = H // 128
    words = T * H // 4 + T * G + T * 25
    buf, peer_buf = symmetric_with_next(words, torch.int32, dev)  # [rows | scales | meta] received from the peer
    peer = (rank + 1) % world

    def regions(b):
        return b[: T * H // 4], b[T * H // 4: T * H // 4 + T * G], b[T * H // 4 + T * G:]

    peer_rows, peer_s, peer_m = regions(peer_buf)
    own = torch.empty(words, dtype=torch.int32, device=dev)
    own_rows, own_s, own_m = regions(own)
    g = torch.Generator(device="cpu").manual_seed(200 + rank)
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    x_peer = torch.randn(T, H, generator=torch.Generator(device="cpu").manual_seed(200 + peer)).to(torch.bfloat16)
    expected = {wide: expected_rows(x_peer, wide) for wide in (False, True)}
    rows = []
    for P in args.programs:
        for wide in (False, True):
            for scales, meta in ((False, False), (True, False), (True, True)):
                def move():
                    fp8_pattern_kernel[(P,)](x, peer_rows, own_rows, peer_s, own_s, peer_m, own_m, T, H, WIDE=wide,
                                             SCALES=scales, META=meta, TB=args.tb, QG=args.qg, num_warps=args.warps)
                buf.fill_(-1)
                torch.cuda.synchronize()
                dist.barrier(device_ids=[rank])
                move()
                torch.cuda.synchronize()
                dist.barrier(device_ids=[rank])
                got = regions(buf)[0].view(T, H // 4).cpu()
                equal = bool(torch.equal(got, expected[wide]))
                equal = max_over_ranks(float(not equal), dev) == 0
                ms = max_over_ranks(time_ms(move, warmup=3, repeat=args.reps)["median_ms"], dev)
                name = ("wide" if wide else "halves") + (" + scales" if scales else "") + (" + meta" if meta else "")
                row = {"programs": P, "stores": name, "ms": ms, "peer_rows_gb_s": T * H / ms / 1e6, "equal": equal}
                rows.append(row)
                if rank == 0:
                    print(f"P={P:2d} {name:24s}: {ms * 1e3:7.1f} us, {row['peer_rows_gb_s']:6.1f} GB/s of rows into "
                          f"the peer; rows equal {equal}", flush=True)
    end_worker(rank, queue, {"rows": rows})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, nargs="+", default=[20, 32])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--tb", type=int, default=16, help="tokens per step (the dispatch's quantize step: 16)")
    parser.add_argument("--qg", type=int, default=8, help="groups of 128 values per chunk (the dispatch's: 8)")
    parser.add_argument("--warps", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    run_and_write("nvlink_fp8_pattern", worker, args,
                  "every rank at once; max over ranks of per-rank CUDA-event medians; rows: every token to the peer")


if __name__ == "__main__":
    main()
