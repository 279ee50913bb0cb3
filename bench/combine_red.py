"""Can the combine's sum after the copies land be cheaper? One GPU, 2-rank combine of the DeepSeek-V3 shape
(4096 tokens x 7168 bf16).

Now (``combine_sum``: the combine's own `nvlink.sum_returned_rows`; ``sum``: the same in explicit 16-byte vectors):
once the peer's rows have landed, each token's own row and landed row are read and their sum written
(``ptx.bf16x2_add_as_fp32``): 2 rows in and 1 out through the SM per token, all after the landing.
Proposed (``pre`` then ``red``): before the rows land (the SMs wait for the first chunk anyway) each token's own row
goes to ``out`` (``+0 + own``); once the peer's row has landed it is read and added into ``out`` by the L2
(``red.global.add.noftz.v4.bf16x2``, one 16-byte reduction per 8 values, rounded to nearest once: the same bits as
the fp32 sum of two bf16 values rounded to bf16). After the landing the SM moves 1 row in and 1 out per token.
Every result is compared with the fp32 sum rounded to bf16 (torch) after poisoning ``out``.

Measured (session 13, `bench/results/combine_red_session13.log`, 20 programs, 16 warps): the combine's sum 110.7 us,
in explicit 16-byte vectors 92.9, own rows first 82.6 then the L2 reduction 86.0: the reduction is no cheaper than
the whole sum. (The vector sum made the combines slower in the transports: BENCHMARKS.md §2, session 13.)

    PYTHONPATH=src python3 bench/combine_red.py --programs 20 24
Writes bench/results/combine_red.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, time_ms, write_result  # noqa: E402

from smsplit import ptx  # noqa: E402
from smsplit.ep.nvlink import sum_returned_rows  # noqa: E402


@triton.jit
def red_add_bf16x8(ptr, w0, w1, w2, w3, mask):
    """``red.global.add.noftz.v4.bf16x2``: add the 8 bf16 values of words ``w0..w3`` to the 16 bytes at ``ptr``."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .pred p;
        setp.ne.b32 p, $6, 0;
        @p red.global.add.noftz.v4.bf16x2 [$1], {$2, $3, $4, $5};
        mov.b32 $0, 0;
        }
        """,
        "=r,l,r,r,r,r,r",
        [ptr, w0, w1, w2, w3, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _rows(t0, T, pos_ptr, TB: tl.constexpr):
    t = t0 + tl.arange(0, TB)
    ok = t < T
    p_own = tl.load(pos_ptr + t * 2, mask=ok, other=-1).to(tl.int64)[:, None]
    p_peer = tl.load(pos_ptr + t * 2 + 1, mask=ok, other=-1).to(tl.int64)[:, None]
    return t.to(tl.int64)[:, None], ok[:, None], p_own, p_peer


@triton.jit
def sum_kernel(pos_ptr, own_ptr, peer_ptr, out_ptr, T, H, TB: tl.constexpr, VEC: tl.constexpr):
    """The combine's sum now: out = (+0 + own) + peer, 16-byte vectors (int32 words of bf16 pairs)."""
    v = tl.arange(0, VEC)[None, :]
    vm = v < H // 8
    for t0 in range(tl.program_id(0) * TB, T, tl.num_programs(0) * TB):
        t, ok, p_own, p_peer = _rows(t0, T, pos_ptr, TB)
        a0, a1, a2, a3 = ptx.ld_global_nc_v4(own_ptr + p_own * (H // 2) + 4 * v, (p_own >= 0) & vm)
        b0, b1, b2, b3 = ptx.ld_global_nc_v4(peer_ptr + p_peer * (H // 2) + 4 * v, (p_peer >= 0) & vm)
        ptx.st_global_na_v4(out_ptr + t * (H // 2) + 4 * v, ptx.bf16x2_add_as_fp32(a0, b0),
                            ptx.bf16x2_add_as_fp32(a1, b1), ptx.bf16x2_add_as_fp32(a2, b2),
                            ptx.bf16x2_add_as_fp32(a3, b3), ok & vm)


@triton.jit
def combine_sum_kernel(pos_ptr, own_ptr, peer_ptr, out_ptr, T, H, TB: tl.constexpr, HB: tl.constexpr):
    """The sum as the combine kernel runs it (`nvlink.sum_returned_rows`, 2 ranks, this rank 0, no weights)."""
    for t0 in range(tl.program_id(0) * TB, T, tl.num_programs(0) * TB):
        t = t0 + tl.arange(0, TB)
        sum_returned_rows(t, t < T, pos_ptr, 2, 0, 0, own_ptr, out_ptr, peer_ptr, out_ptr, 0, out_ptr, out_ptr, H, 1,
                          HB, 2, 2, TB, False)


@triton.jit
def pre_kernel(pos_ptr, own_ptr, out_ptr, T, H, TB: tl.constexpr, VEC: tl.constexpr):
    """out = +0 + own (zeros where the token has no own row): before the peer's rows land."""
    v = tl.arange(0, VEC)[None, :]
    vm = v < H // 8
    z = tl.zeros((TB, VEC), dtype=tl.int32)
    for t0 in range(tl.program_id(0) * TB, T, tl.num_programs(0) * TB):
        t, ok, p_own, p_peer = _rows(t0, T, pos_ptr, TB)
        a0, a1, a2, a3 = ptx.ld_global_nc_v4(own_ptr + p_own * (H // 2) + 4 * v, (p_own >= 0) & vm)
        ptx.st_global_na_v4(out_ptr + t * (H // 2) + 4 * v, ptx.bf16x2_add_as_fp32(z, a0),
                            ptx.bf16x2_add_as_fp32(z, a1), ptx.bf16x2_add_as_fp32(z, a2),
                            ptx.bf16x2_add_as_fp32(z, a3), ok & vm)


@triton.jit
def red_kernel(pos_ptr, peer_ptr, out_ptr, T, H, TB: tl.constexpr, VEC: tl.constexpr):
    """out += peer (in the L2), once the peer's rows have landed."""
    v = tl.arange(0, VEC)[None, :]
    vm = v < H // 8
    for t0 in range(tl.program_id(0) * TB, T, tl.num_programs(0) * TB):
        t, ok, p_own, p_peer = _rows(t0, T, pos_ptr, TB)
        m = (p_peer >= 0) & ok & vm
        b0, b1, b2, b3 = ptx.ld_global_nc_v4(peer_ptr + p_peer * (H // 2) + 4 * v, m)
        red_add_bf16x8(out_ptr + t * (H // 2) + 4 * v, b0, b1, b2, b3, m)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, nargs="+", default=[20, 24])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    dev = torch.device("cuda", 0)
    T, H = 4096, 7168
    g = torch.Generator(device="cpu").manual_seed(0)
    keep = torch.rand(T, 2, generator=g) < 0.99  # a token not sent to a rank leaves a gap in its rows
    pos = torch.stack([torch.cumsum(keep[:, c].int(), 0) - 1 for c in range(2)], 1)
    pos = torch.where(keep, pos, torch.full_like(pos, -1)).to(torch.int32).to(dev).contiguous()
    own = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    peer = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    own[0, :64] = -0.0  # signed zeros: -0 + -0 must come out +0 as the fp32 sum does
    peer[0, :64] = -0.0
    po, pp = pos[:, 0].long(), pos[:, 1].long()
    ref = (torch.zeros(T, H, device=dev) + torch.where((po >= 0)[:, None], own[po.clamp(min=0)].float(), 0.0)
           + torch.where((pp >= 0)[:, None], peer[pp.clamp(min=0)].float(), 0.0)).to(torch.bfloat16)  # fp32 from +0
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    ow, pw, outw = own.view(torch.int32), peer.view(torch.int32), out.view(torch.int32)
    VEC = triton.next_power_of_2(H // 8)
    row_bytes = T * H * 2
    rows = []
    for P in args.programs:
        for TB in (2, 4):
            for warps in (8, 16):
                kw = dict(TB=TB, VEC=VEC, num_warps=warps)
                runs = {"sum": lambda: sum_kernel[(P,)](pos, ow, pw, outw, T, H, **kw),
                        "combine_sum": lambda: combine_sum_kernel[(P,)](pos, own, peer, out, T, H, TB=2 * TB,
                                                                        HB=triton.next_power_of_2(H), num_warps=warps),
                        "pre": lambda: pre_kernel[(P,)](pos, ow, outw, T, H, **kw),
                        "red": lambda: red_kernel[(P,)](pos, pw, outw, T, H, **kw)}
                out.view(torch.int16).fill_(-1)  # poison: bf16 NaN
                runs["sum"]()
                torch.cuda.synchronize()
                sum_equal = bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
                out.view(torch.int16).fill_(-1)
                runs["combine_sum"]()
                torch.cuda.synchronize()
                lib_equal = bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
                out.view(torch.int16).fill_(-1)
                runs["pre"]()
                runs["red"]()
                torch.cuda.synchronize()
                red_equal = bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
                times = {name: time_ms(fn, warmup=3, repeat=args.reps, inner=5)["median_ms"] * 1e3
                         for name, fn in runs.items()}
                row = dict(programs=P, TB=TB, warps=warps, sum_equal=sum_equal, pre_red_equal=red_equal,
                           combine_sum_equal=lib_equal, combine_sum_TB=2 * TB,
                           **{f"{k}_us": v for k, v in times.items()},
                           sum_gbps=3 * row_bytes / times["sum"] / 1e3, red_gbps=2 * row_bytes / times["red"] / 1e3)
                rows.append(row)
                print(f"P={P:3d} TB={TB} warps={warps:2d}: sum {times['sum']:6.1f} us ({row['sum_gbps']:5.0f} GB/s), "
                      f"pre {times['pre']:6.1f}, red {times['red']:6.1f} ({row['red_gbps']:5.0f} GB/s), "
                      f"combine's sum (TB {2 * TB}) {times['combine_sum']:6.1f}; "
                      f"equal: sum {sum_equal}, pre+red {red_equal}, combine's sum {lib_equal}", flush=True)
    path = write_result("combine_red", {"env": environment(), "args": vars(args), "rows": rows,
                                        "notes": "sum: 2 rows in, 1 out per token; red: 1 in, 1 reduced into out"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
