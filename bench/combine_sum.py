"""The combine's local sum on a comm budget: out[t] = y[self_start + pos[t, 0]] + cx[pos[t, 1]] (bf16 rows, fp32 sum),
the SM work a combine does once the rows are back, for 4096 tokens x 7168 (the DeepSeek-V3 shape: 2 rows read and
1 written per token, 176 MB). Kernel shapes against a plain SM copy of the same rows (the rate one program can
move) on the same number of programs; one GPU.

    PYTHONPATH=src python3 bench/combine_sum.py --programs 20

Shapes: ``rows`` (whole rows per step, [TB, pow2(H)] tiles: the combine kernel's shape), ``blocks`` ([TB, BH] tiles,
one work item per (token block, column block)), with the work loop software-pipelined by Triton (``stages``) or by
hand (``prefetch``: the next item's loads issue before this item's sum is stored), ``tma`` (each row one TMA load,
pipelined by Triton; added after the 22:15 run, not yet run). Writes
bench/results/combine_sum.json.
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


@triton.jit
def sum_rows_kernel(pos_ptr, y_ptr, cx_ptr, out_ptr, T, H, self_start, TB: tl.constexpr, HB: tl.constexpr):
    h = tl.arange(0, HB)[None, :]
    for t0 in range(tl.program_id(0) * TB, T, tl.num_programs(0) * TB):
        t = (t0 + tl.arange(0, TB)).to(tl.int64)
        ok = (t < T)[:, None]
        p0 = tl.load(pos_ptr + t * 2, mask=t < T, other=0).to(tl.int64)[:, None]
        p1 = tl.load(pos_ptr + t * 2 + 1, mask=t < T, other=0).to(tl.int64)[:, None]
        a = tl.load(y_ptr + (self_start + p0) * H + h, mask=ok & (h < H), other=0.0).to(tl.float32)
        b = tl.load(cx_ptr + p1 * H + h, mask=ok & (h < H), other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + t[:, None] * H + h, (a + b).to(tl.bfloat16), mask=ok & (h < H))


@triton.jit
def _item(w, n_cb, pos_ptr, y_ptr, cx_ptr, T, H, self_start, TB: tl.constexpr, BH: tl.constexpr):
    t = ((w // n_cb) * TB + tl.arange(0, TB)).to(tl.int64)
    h = ((w % n_cb) * BH + tl.arange(0, BH))[None, :]
    ok = (t < T)[:, None] & (h < H)
    p0 = tl.load(pos_ptr + t * 2, mask=t < T, other=0).to(tl.int64)[:, None]
    p1 = tl.load(pos_ptr + t * 2 + 1, mask=t < T, other=0).to(tl.int64)[:, None]
    a = tl.load(y_ptr + (self_start + p0) * H + h, mask=ok, other=0.0)
    b = tl.load(cx_ptr + p1 * H + h, mask=ok, other=0.0, cache_modifier=".cg")
    return a, b, t, h, ok


@triton.jit
def sum_blocks_kernel(pos_ptr, y_ptr, cx_ptr, out_ptr, T, H, self_start, TB: tl.constexpr, BH: tl.constexpr,
                      STAGES: tl.constexpr, PREFETCH: tl.constexpr):
    n_cb = tl.cdiv(H, BH)
    n_items = tl.cdiv(T, TB) * n_cb
    pid, P = tl.program_id(0), tl.num_programs(0)
    if PREFETCH:
        a, b, t, h, ok = _item(pid, n_cb, pos_ptr, y_ptr, cx_ptr, T, H, self_start, TB, BH)
        for w in range(pid, n_items, P):
            a_next, b_next, t_next, h_next, ok_next = _item(w + P, n_cb, pos_ptr, y_ptr, cx_ptr, T, H, self_start, TB, BH)
            tl.store(out_ptr + t[:, None] * H + h, (a.to(tl.float32) + b.to(tl.float32)).to(tl.bfloat16), mask=ok)
            a, b, t, h, ok = a_next, b_next, t_next, h_next, ok_next
    else:
        for w in tl.range(pid, n_items, P, num_stages=STAGES):
            a, b, t, h, ok = _item(w, n_cb, pos_ptr, y_ptr, cx_ptr, T, H, self_start, TB, BH)
            tl.store(out_ptr + t[:, None] * H + h, (a.to(tl.float32) + b.to(tl.float32)).to(tl.bfloat16), mask=ok)


@triton.jit
def sum_tma_kernel(pos_ptr, y_desc, cx_desc, out_desc, T, self_start, STAGES: tl.constexpr):
    """One token per step, each row one TMA load (descriptor block ``[1, pow2(H)]``: the part past H is zero-filled
    on load and dropped on store), software-pipelined by Triton with ``STAGES`` shared-memory buffers."""
    for t in tl.range(tl.program_id(0), T, tl.num_programs(0), num_stages=STAGES):
        p0 = tl.load(pos_ptr + t * 2)
        p1 = tl.load(pos_ptr + t * 2 + 1)
        a = y_desc.load([self_start + p0, 0]).to(tl.float32)
        b = cx_desc.load([p1, 0]).to(tl.float32)
        out_desc.store([t, 0], (a + b).to(tl.bfloat16))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, nargs="+", default=[20])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--kinds", nargs="+", default=["rows", "blocks", "tma"], choices=["rows", "blocks", "tma"])
    args = parser.parse_args()
    from smsplit.copy import sm_copy

    dev = torch.device("cuda", 0)
    T, H = args.tokens, args.hidden
    g = torch.Generator(device="cpu").manual_seed(0)
    keep = torch.rand(T, 2, generator=g) < 0.99  # a token not sent to a rank leaves a gap in its rows
    pos = torch.stack([torch.cumsum(keep[:, c].int(), 0) - 1 for c in range(2)], 1)
    pos = torch.where(keep, pos, torch.zeros_like(pos)).to(torch.int32).to(dev).contiguous()
    self_start = 5
    y = torch.randn(T + self_start, H, generator=g).to(dev, torch.bfloat16)
    cx = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    ref = (y[self_start + pos[:, 0].long()].float() + cx[pos[:, 1].long()].float()).to(torch.bfloat16)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    nbytes = 3 * T * H * 2  # two rows read, one written per token
    shapes = [("rows", dict(TB=tb), w) for tb in (1, 2, 4) for w in (8, 16)]
    shapes += [("blocks", dict(TB=tb, BH=bh, STAGES=s, PREFETCH=False), w)
               for tb, bh in ((8, 1024), (16, 512), (4, 2048)) for s in (1, 3) for w in (8, 16)]
    shapes += [("blocks", dict(TB=tb, BH=bh, STAGES=1, PREFETCH=True), w)
               for tb, bh in ((8, 1024), (16, 1024), (16, 512), (32, 512)) for w in (8, 16)]
    shapes += [("tma", dict(STAGES=s), w) for s in (2, 3, 4) for w in (4, 8)]
    shapes = [shape for shape in shapes if shape[0] in args.kinds]
    from triton.tools.tensor_descriptor import TensorDescriptor

    HB = triton.next_power_of_2(H)

    def row_desc(t):  # one row per box; the box's part past H lies outside the tensor
        return TensorDescriptor(t, shape=list(t.shape), strides=list(t.stride()), block_shape=[1, HB])

    rows = []
    for P in args.programs:
        copy_src = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
        copy_ms = time_ms(lambda: sm_copy(out, copy_src, P, block=4096, num_warps=16), warmup=3, repeat=args.reps)["median_ms"]
        print(f"P={P}: SM copy of the rows {T * H * 2 * 2 / copy_ms / 1e6:.0f} GB/s (read + written), {copy_ms * 1e3:.1f} us",
              flush=True)
        for kind, kw, warps in shapes:
            if kind == "rows":
                def run():
                    sum_rows_kernel[(P,)](pos, y, cx, out, T, H, self_start, HB=triton.next_power_of_2(H), num_warps=warps, **kw)
            elif kind == "blocks":
                def run():
                    sum_blocks_kernel[(P,)](pos, y, cx, out, T, H, self_start, num_warps=warps, **kw)
            else:
                def run():
                    sum_tma_kernel[(P,)](pos, row_desc(y), row_desc(cx), row_desc(out), T, self_start, num_warps=warps, **kw)
            try:
                out.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
                ok = bool(torch.equal(out, ref))
                ms = time_ms(run, warmup=3, repeat=args.reps)["median_ms"]
            except Exception as e:  # a shape that does not compile (registers, shared memory): noted, skipped
                print(f"P={P} {kind} {kw} w{warps}: failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            rows.append({"programs": P, "kind": kind, **kw, "num_warps": warps, "ms": ms, "equal": ok,
                         "gbps": nbytes / ms / 1e6, "copy_ms": copy_ms})
            print(f"P={P} {kind:6s} {kw} w{warps}: {ms * 1e3:7.1f} us, {nbytes / ms / 1e6:6.0f} GB/s, equal {ok}", flush=True)
    path = write_result("combine_sum", {"env": environment(), "args": vars(args), "bytes": nbytes, "rows": rows,
                                        "notes": "GB/s counts 2 rows read + 1 written per token"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
