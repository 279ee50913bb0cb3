"""Does a TMA-fed quantize loop beat the FP8 staging launch? One GPU, DeepSeek-V3 shape (4096 x 7168 bf16, top-8 of
256 experts over 2 ranks).

`bench/sm_bandwidth.py` showed the per-SM read rate is latency-bound: 16-byte loads with 64 KiB in flight per SM read
~49 GB/s, TMA bulk loads with 160 KiB in flight ~111 GB/s. The staging launch of the NVLink dispatch keeps ~32 KiB of
bf16 in flight per program. Here a prototype loop reads ``[TB, QG * 128]`` tiles of x through a TMA descriptor,
software-pipelined ``STAGES`` deep, quantizes them (`smsplit.fp8.quantize_e4m3_groups`, bit for bit
`quantize_1x128`) and stores each token's e4m3 row and scales to its row on both "ranks" (this rank's receive rows
and the staging rows), as the staging launch does; against it, on the same programs and data, the staging launch
itself (`bench/fp8_stage.py`). Two quantize paths: ``tma_stage_kernel`` on fp32 values (`quantize_e4m3_groups`) and
``tma_words_stage_kernel`` on the packed bf16 words of the staging launch (`nvlink.quantize_chunk`, the tile read from
shared memory straight into each thread's two 16-byte vectors). Times: 10 launches queued, divided.

Measured (session 12, `bench/results/fp8_tma_stage_session12.log`, `fp8_tma_words_session12.log`): at 20 programs the
staging launch 97.4-98.8 us, the fp32 TMA loop 168.7 us at best, the packed-word TMA loop 125.1 us at best (3 stages,
16 warps): the loop is not bound by how many bytes of x are in flight.

    PYTHONPATH=src python3 bench/fp8_tma_stage.py --programs 20 24 32 [--words-only]

Writes bench/results/fp8_tma_stage.json.
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
from smsplit.ep.nvlink import chunk_halves, quantize_chunk, store_chunk_scales  # noqa: E402
from smsplit.fp8 import quantize_e4m3_groups  # noqa: E402


@triton.jit
def _tiles(T, H, TB: tl.constexpr, QG: tl.constexpr):
    """This program's tiles (``[TB tokens, QG groups of 128]``: token blocks p, p + P, ..., each in chunks of QG
    groups) and the chunks per token block."""
    n_chunks = tl.cdiv(H // 128, QG)
    pid = tl.program_id(0)
    return tl.cdiv(tl.cdiv(T, TB) - pid, tl.num_programs(0)) * n_chunks, n_chunks


@triton.jit
def _tile(it, n_chunks, TB: tl.constexpr, QG: tl.constexpr):
    """The first token and group of this program's tile ``it``."""
    return (tl.program_id(0) + (it // n_chunks) * tl.num_programs(0)) * TB, (it % n_chunks) * QG


@triton.jit
def tma_stage_kernel(x_desc, pos_ptr, dst_ptr, scales_ptr, T, H, rows_per_dest, R: tl.constexpr, TB: tl.constexpr,
                     QG: tl.constexpr, STAGES: tl.constexpr):
    """Token t's e4m3 row to row ``d * rows_per_dest + pos[t, d]`` of ``dst`` for each d with pos >= 0 (scales the
    same in ``scales``); program p takes token blocks p, p + P, ..., each in chunks of QG groups of 128."""
    n_groups = H // 128
    n_tiles, n_chunks = _tiles(T, H, TB, QG)
    for it in tl.range(0, n_tiles, num_stages=STAGES):
        t0, g0 = _tile(it, n_chunks, TB, QG)
        tile = x_desc.load([t0, g0 * 128])
        q, scale = quantize_e4m3_groups(tl.reshape(tile, (TB, QG, 128)).to(tl.float32), 2)
        q = tl.reshape(q, (TB, QG * 128))
        t = t0 + tl.arange(0, TB)
        cols = g0 * 128 + tl.arange(0, QG * 128)
        grp = g0 + tl.arange(0, QG)
        for d in tl.static_range(R):
            p = tl.load(pos_ptr + t * R + d, mask=t < T, other=-1)
            row = (d * rows_per_dest + p).to(tl.int64)
            ok = (p >= 0)[:, None]
            tl.store(dst_ptr + row[:, None] * H + cols[None, :], q, mask=ok & (cols < H)[None, :])
            tl.store(scales_ptr + row[:, None] * n_groups + grp[None, :], scale, mask=ok & (grp < n_groups)[None, :])


@triton.jit
def tma_words_stage_kernel(xw_desc, x_ptr, pos_ptr, dst_ptr, scales_ptr, T, H, rows_per_dest, R: tl.constexpr,
                           TB: tl.constexpr, QG: tl.constexpr, STAGES: tl.constexpr):
    """`tma_stage_kernel` quantizing on packed words as the staging launch does: x as int32 words (``xw_desc``,
    ``[T, H / 2]``, block ``[TB, QG * 64]``), each thread the words of two 16-byte vectors of a group
    (`nvlink.quantize_chunk`), the e4m3 bytes stored as two 8-byte halves per thread (``dst`` as int32 words)."""
    n_groups = H // 128
    n_tiles, n_chunks = _tiles(T, H, TB, QG)
    row_words = H // 4
    for it in tl.range(0, n_tiles, num_stages=STAGES):
        t0, g0 = _tile(it, n_chunks, TB, QG)
        tile = xw_desc.load([t0, g0 * 64])  # [TB, QG * 64]: group g's words are [a/b vector half, thread j, word]
        w = tl.reshape(tl.permute(tl.reshape(tile, (TB, QG, 2, 8, 4)), (0, 1, 3, 2, 4)), (TB, QG, 8, 2, 2, 2))
        even, odd = tl.split(w)  # words 0, 2 / 1, 3 of each vector
        w0, w2 = tl.split(even)
        w1, w3 = tl.split(odd)
        a0, b0 = tl.split(w0)
        a1, b1 = tl.split(w1)
        a2, b2 = tl.split(w2)
        a3, b3 = tl.split(w3)
        t = t0 + tl.arange(0, TB)
        t64 = t.to(tl.int64)[:, None]
        q0, q1, q2, q3, scale = quantize_chunk(x_ptr, t64, t < T, g0, H, a0, a1, a2, a3, b0, b1, b2, b3, QG, TB)
        lo, hi = chunk_halves(g0, QG)
        for d in tl.static_range(R):
            p = tl.load(pos_ptr + t * R + d, mask=t < T, other=-1)
            row = (d * rows_per_dest + p).to(tl.int64)[:, None]
            ok = (p >= 0)[:, None]
            dst = dst_ptr + row * row_words
            ptx.st_global_na_v2(dst + lo, q0, q1, ok & (lo < row_words))
            ptx.st_global_na_v2(dst + hi, q2, q3, ok & (hi < row_words))
            store_chunk_scales(scales_ptr + row * n_groups, g0, scale, ok, n_groups, QG, TB)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, nargs="+", default=[20, 24])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--words-only", action="store_true", help="of the fp32-path loops, one config only")
    args = parser.parse_args()
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fp8_stage import setup, stage_launch
    from smsplit.fp8 import quantize_1x128

    T, H, E, K, R = 4096, 7168, 256, 8, 2
    s = setup(T, H, E, K, R)
    x, pos = s["x"], s["pos"]
    dev = x.device
    dst = torch.empty(R * T, H, dtype=torch.float8_e4m3fn, device=dev)
    scales = torch.empty(R * T, H // 128, dtype=torch.float32, device=dev)
    ref_q, ref_s = quantize_1x128(x)
    configs = [dict(TB=16, QG=8, STAGES=4, warps=16)] if args.words_only else [
        dict(TB=16, QG=8, STAGES=4, warps=8), dict(TB=16, QG=8, STAGES=3, warps=8),
        dict(TB=16, QG=8, STAGES=5, warps=8), dict(TB=16, QG=8, STAGES=4, warps=4),
        dict(TB=16, QG=8, STAGES=4, warps=16), dict(TB=8, QG=8, STAGES=8, warps=4),
        dict(TB=32, QG=4, STAGES=4, warps=8), dict(TB=16, QG=4, STAGES=8, warps=8)]
    words_configs = [dict(TB=16, QG=8, STAGES=4, warps=16), dict(TB=16, QG=8, STAGES=3, warps=16),
                     dict(TB=16, QG=8, STAGES=6, warps=16), dict(TB=16, QG=8, STAGES=4, warps=8),
                     dict(TB=32, QG=4, STAGES=4, warps=16), dict(TB=8, QG=8, STAGES=8, warps=8)]
    xw = x.view(torch.int32)

    def check(fn):
        dst.view(torch.uint8).fill_(0x7F)  # poison: e4m3 NaN
        scales.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        ok = True
        for d in range(R):
            sel = pos[:, d] >= 0
            rows_d = d * T + pos[sel, d].long()
            ok &= bool(torch.equal(dst[rows_d].view(torch.uint8), ref_q[sel].view(torch.uint8)))
            ok &= bool(torch.equal(scales[rows_d], ref_s[sel]))
        return ok

    rows = []

    def measure(kernel, label, P, cfg, fn):  # check, time, print and record one configuration
        ok = check(fn)
        t = time_ms(fn, warmup=3, repeat=args.reps, inner=10)["median_ms"]
        name = " ".join(f"{k}={v}" for k, v in cfg.items())
        print(f"P={P:3d} {label} {name:35s} {t * 1e3:8.1f} us  {'equal' if ok else 'WRONG'}", flush=True)
        rows.append(dict(kernel=kernel, programs=P, us=t * 1e3, equal=ok, **cfg))

    for P in args.programs:
        t_stage = time_ms(lambda: stage_launch(s, P, 16, 16, True), warmup=3, repeat=args.reps, inner=10)["median_ms"]
        print(f"P={P:3d} staging launch (main)                      {t_stage * 1e3:8.1f} us", flush=True)
        rows.append(dict(kernel="staging_launch", programs=P, us=t_stage * 1e3))
        for cfg in configs:
            desc = TensorDescriptor(x, shape=[T, H], strides=[H, 1], block_shape=[cfg["TB"], cfg["QG"] * 128])

            def fn(cfg=cfg, desc=desc, P=P):
                tma_stage_kernel[(P,)](desc, pos, dst, scales, T, H, T, R=R, TB=cfg["TB"], QG=cfg["QG"],
                                       STAGES=cfg["STAGES"], num_warps=cfg["warps"])
            measure("tma_loop", "tma loop ", P, cfg, fn)
        for cfg in words_configs:
            desc = TensorDescriptor(xw, shape=[T, H // 2], strides=[H // 2, 1], block_shape=[cfg["TB"], cfg["QG"] * 64])

            def fn(cfg=cfg, desc=desc, P=P):
                tma_words_stage_kernel[(P,)](desc, x, pos, dst.view(torch.int32), scales, T, H, T, R=R, TB=cfg["TB"],
                                             QG=cfg["QG"], STAGES=cfg["STAGES"], num_warps=cfg["warps"])
            measure("tma_words", "tma words", P, cfg, fn)
    write_result("fp8_tma_stage", dict(environment(), rows=rows))


if __name__ == "__main__":
    main()
