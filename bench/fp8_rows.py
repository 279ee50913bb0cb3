"""How fast a lean kernel quantizes rows on a few SMs: the FP8 dispatch's quantization with nothing else (no routing,
no metadata, one GPU), to know what a dispatch built around it could reach.

Each of ``--programs`` persistent programs walks (token step, chunk) pairs of a 4096 x 7168 bf16 x, quantizes each
chunk on packed bf16 words (`smsplit.fp8`) and stores the e4m3 rows twice (a
2-rank dispatch writes every row to two places) and the scales once. The loads come two ways:

* ``smem``: ``tl.load`` in a ``tl.range(num_stages=S)`` loop: Triton keeps S - 1 chunks in flight through shared
  memory (cp.async), few registers; one 16-byte vector per thread (`smsplit.fp8.quantize_e4m3_bf16_vectors`),
  8-byte stores, as ``tma`` and ``tma_io``;
* ``regs``: as the dispatch: `smsplit.ep.nvlink.load_chunk` (two 16-byte ``ld.global.nc`` per thread, vectors
  j and j + 8 of a group; the next chunk loaded into registers while this one is quantized),
  `smsplit.fp8.quantize_e4m3_bf16_vector_pairs`, two 8-byte stores per thread, the scales stored from the layout
  they were computed in (`smsplit.ep.nvlink.store_chunk_scales`: no shared memory, no barrier);
* ``tma``: the chunks loaded by the Hopper tensor memory accelerator (a tensor descriptor over x, the loop
  pipelined by Triton over S shared-memory buffers); ``tma_io``: the e4m3 rows stored by TMA as well.

Every configuration's output is checked against `smsplit.fp8.quantize_1x128` after poisoning it.

    PYTHONPATH=src python3 bench/fp8_rows.py --programs 20

Writes bench/results/fp8_rows.json.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, time_ms, write_result  # noqa: E402

from smsplit import ptx  # noqa: E402
from smsplit.ep.nvlink import load_chunk, store_chunk_scales  # noqa: E402
from smsplit.fp8 import quantize_1x128, quantize_e4m3_bf16_vector_pairs, quantize_e4m3_bf16_vectors  # noqa: E402


@triton.jit
def _store_chunk(out_ptr, out2_ptr, s_ptr, t, g0, T, NG: tl.constexpr, H: tl.constexpr, q0, q1, scale,
                 QG: tl.constexpr):
    t64 = t.to(tl.int64)[:, None, None]
    g3 = g0 + tl.arange(0, QG)[None, :, None]
    v3 = tl.arange(0, 16)[None, None, :]
    ok = (t < T)[:, None, None] & (g3 < NG) & (v3 < 16)
    ptx.st_global_na_v2(out_ptr + t64 * (H // 4) + g3 * 32 + 2 * v3, q0, q1, ok)
    ptx.st_global_na_v2(out2_ptr + t64 * (H // 4) + g3 * 32 + 2 * v3, q0, q1, ok)
    g2 = g0 + tl.arange(0, QG)[None, :]
    tl.store(s_ptr + t.to(tl.int64)[:, None] * NG + g2, scale, mask=(t < T)[:, None] & (g2 < NG))


@triton.jit
def quantize_rows_kernel(x_ptr, out_ptr, out2_ptr, s_ptr, T, H: tl.constexpr, TB: tl.constexpr, QG: tl.constexpr,
                         STAGES: tl.constexpr, SMEM: tl.constexpr):
    """x_ptr: the bf16 rows as int32 words; out_ptr, out2_ptr: e4m3 rows as int32 words; s_ptr: fp32 scales."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    NG: tl.constexpr = H // 128
    NC: tl.constexpr = (NG + QG - 1) // QG
    mine = tl.cdiv(tl.cdiv(T, TB) - pid, programs) * NC  # (token step, chunk) pairs of this program
    if SMEM:
        for i in tl.range(0, mine, num_stages=STAGES):
            t = (pid + (i // NC) * programs) * TB + tl.arange(0, TB)
            g0 = (i % NC) * QG
            g3 = g0 + tl.arange(0, QG)[None, :, None]
            c3 = tl.arange(0, 64)[None, None, :]
            words = tl.load(x_ptr + t.to(tl.int64)[:, None, None] * (H // 2) + g3 * 64 + c3,
                            mask=(t < T)[:, None, None] & (g3 < NG), other=0)
            even, odd = tl.split(tl.reshape(words, (TB, QG, 16, 2, 2)))  # word 4 v + 2 a + b: split b, then a
            w0, w2 = tl.split(even)
            w1, w3 = tl.split(odd)
            q0, q1, scale = quantize_e4m3_bf16_vectors(w0, w1, w2, w3)
            _store_chunk(out_ptr, out2_ptr, s_ptr, t, g0, T, NG, H, q0, q1, scale, QG)
    else:  # as the dispatch: two 16-byte vectors per thread, the next chunk in flight, 8-byte stores
        bf16_ptr = x_ptr.to(tl.pointer_type(tl.bfloat16))
        t = pid * TB + tl.arange(0, TB)
        n0, n1, n2, n3, n4, n5, n6, n7 = load_chunk(bf16_ptr, t.to(tl.int64)[:, None], t < T, 0, H, QG, TB)
        for i in range(0, mine):
            t = (pid + (i // NC) * programs) * TB + tl.arange(0, TB)
            g0 = (i % NC) * QG
            a0, a1, a2, a3, b0, b1, b2, b3 = n0, n1, n2, n3, n4, n5, n6, n7
            j = i + 1  # the next (step, chunk) pair, in flight while this one is quantized
            tn = (pid + (j // NC) * programs) * TB + tl.arange(0, TB)
            n0, n1, n2, n3, n4, n5, n6, n7 = load_chunk(bf16_ptr, tn.to(tl.int64)[:, None], (tn < T) & (j < mine),
                                                        (j % NC) * QG, H, QG, TB)
            q0, q1, q2, q3, scale = quantize_e4m3_bf16_vector_pairs(a0, a1, a2, a3, b0, b1, b2, b3)
            t64 = t.to(tl.int64)[:, None, None]
            g3 = g0 + tl.arange(0, QG)[None, :, None]
            u3 = tl.arange(0, 8)[None, None, :]
            ok = (t < T)[:, None, None] & (g3 < NG) & (u3 < 8)
            lo = t64 * (H // 4) + g3 * 32 + 2 * u3  # thread j: values 8 j .. and 64 + 8 j .. (load_chunk)
            ptx.st_global_na_v2(out_ptr + lo, q0, q1, ok)
            ptx.st_global_na_v2(out_ptr + lo + 16, q2, q3, ok)
            ptx.st_global_na_v2(out2_ptr + lo, q0, q1, ok)
            ptx.st_global_na_v2(out2_ptr + lo + 16, q2, q3, ok)
            store_chunk_scales(s_ptr + t.to(tl.int64)[:, None] * NG, g0, scale, (t < T)[:, None], NG, QG, TB)


@triton.jit
def quantize_rows_tma_kernel(x_desc, out_desc, out2_desc, out_ptr, out2_ptr, s_ptr, T, H: tl.constexpr,
                             TB: tl.constexpr, QG: tl.constexpr, STAGES: tl.constexpr, TMA_STORES: tl.constexpr):
    """As `quantize_rows_kernel`, the chunks loaded by TMA (``x_desc``: the rows as int32 words, block
    ``[TB, QG * 64]``) in a loop Triton pipelines over STAGES shared-memory buffers; TMA_STORES: the e4m3 words go
    out through ``out_desc``/``out2_desc`` (block ``[TB, QG * 32]``) too."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    NG: tl.constexpr = H // 128
    NC: tl.constexpr = (NG + QG - 1) // QG
    mine = tl.cdiv(tl.cdiv(T, TB) - pid, programs) * NC
    for i in tl.range(0, mine, num_stages=STAGES):
        t0 = (pid + (i // NC) * programs) * TB
        g0 = (i % NC) * QG
        words = x_desc.load([t0, g0 * 64])  # rows past T and groups past the row: zeros
        even, odd = tl.split(tl.reshape(words, (TB, QG, 16, 2, 2)))
        w0, w2 = tl.split(even)
        w1, w3 = tl.split(odd)
        q0, q1, scale = quantize_e4m3_bf16_vectors(w0, w1, w2, w3)
        t = t0 + tl.arange(0, TB)
        if TMA_STORES:  # TMA drops what falls outside the rows
            q = tl.reshape(tl.join(q0, q1), (TB, QG * 32))
            out_desc.store([t0, g0 * 32], q)
            out2_desc.store([t0, g0 * 32], q)
            g2 = g0 + tl.arange(0, QG)[None, :]
            tl.store(s_ptr + t.to(tl.int64)[:, None] * NG + g2, scale, mask=(t < T)[:, None] & (g2 < NG))
        else:
            _store_chunk(out_ptr, out2_ptr, s_ptr, t, g0, T, NG, H, q0, q1, scale, QG)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--programs", type=int, nargs="+", default=[20])
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--groups", type=int, nargs="+", default=[8])
    parser.add_argument("--warps", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--stages", type=int, nargs="*", default=[3, 4],
                        help="num_stages of the smem and TMA loads (none: registers only)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    T, H = args.tokens, args.hidden
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(T, H, generator=g) * torch.logspace(-2, 2, T)[:, None]).to("cuda", torch.bfloat16)
    ref_q, ref_s = quantize_1x128(x)
    out, out2 = (torch.empty(T, H // 4, dtype=torch.int32, device="cuda") for _ in range(2))
    scales = torch.empty(T, H // 128, device="cuda")
    nbytes = T * H * 2 + 2 * T * H + T * (H // 128) * 4  # read bf16, write e4m3 twice, scales
    rows = []
    configs = [("regs", None)] + [(mode, s) for mode in ("smem", "tma", "tma_io") for s in args.stages]
    for P, tb, qg, warps, (loads, stages) in itertools.product(args.programs, args.steps, args.groups, args.warps,
                                                               configs):
        xd = TensorDescriptor(x.view(torch.int32), shape=[T, H // 2], strides=[H // 2, 1], block_shape=[tb, qg * 64])
        od, od2 = (TensorDescriptor(o, shape=[T, H // 4], strides=[H // 4, 1], block_shape=[tb, qg * 32])
                   for o in (out, out2))

        def launch():
            if loads.startswith("tma"):
                quantize_rows_tma_kernel[(P,)](xd, od, od2, out, out2, scales, T, H=H, TB=tb, QG=qg, STAGES=stages,
                                               TMA_STORES=loads == "tma_io", num_warps=warps)
            else:
                quantize_rows_kernel[(P,)](x.view(torch.int32), out, out2, scales, T, H=H, TB=tb, QG=qg,
                                           STAGES=stages or 1, SMEM=loads == "smem", num_warps=warps)

        for t in (out, out2):
            t.fill_(-1)
        scales.fill_(float("nan"))
        try:
            launch()
        except triton.runtime.errors.OutOfResources as e:  # too many stages of too large chunks
            print(f"P={P} TB={tb} QG={qg} warps={warps} loads={loads} stages={stages}: does not fit ({e})")
            continue
        torch.cuda.synchronize()
        equal = (torch.equal(out.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(out2, out)
                 and torch.equal(scales, ref_s))
        ms = time_ms(launch, repeat=args.reps, inner=5)["median_ms"]  # 5 launches queued: no host gap between
        row = {"programs": P, "tokens_per_step": tb, "groups_per_step": qg, "warps": warps, "loads": loads,
               "stages": stages, "us": ms * 1e3, "gbps": nbytes / ms / 1e6, "equal": equal}
        rows.append(row)
        print(f"P={P} TB={tb} QG={qg} warps={warps} loads={loads}{'' if stages is None else f' stages={stages}'}: "
              f"{ms * 1e3:.1f} us ({row['gbps']:.0f} GB/s), equal to the reference: {equal}", flush=True)
    path = write_result("fp8_rows", {"env": environment(), "args": vars(args), "bytes": nbytes, "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
