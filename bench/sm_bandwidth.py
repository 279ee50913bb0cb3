"""What a few SMs can read and write of HBM: the per-SM rates that bound every comm kernel on an SM budget.

Each kernel is persistent (exactly ``P`` programs, one per SM) and streams a buffer much larger than L2:

* ``read``: 16-byte non-caching loads (``ptx.ld_global_nc_v4``), XOR-folded into registers, one store per thread at
  the end; ``block`` vectors per program per step (``block * 16`` bytes in flight per SM);
* ``read_tma``: TMA bulk tensor loads into a shared-memory ring (``stages - 1`` tiles in flight), summed;
* ``write``: 16-byte stores of a constant (``ptx.st_global_na_v4``);
* ``copy`` / ``copy_tma``: `smsplit.copy.sm_copy` (``ldst`` / ``tma``), counted as bytes read plus written.

The FP8 dispatch reads 58.7 MB of bf16 rows and writes ~60 MB of e4m3 rows (DeepSeek-V3 shape); the combine reads
~117 MB and writes 58.7 MB: at a per-SM read rate of r GB/s, P programs need at least ``bytes / (P r)``.

Times: 5 launches queued, divided (median of ``--reps``); each result is checked (reads: the XOR of all words; writes
and copies: equal to the expected buffer).

    PYTHONPATH=src python3 bench/sm_bandwidth.py --programs 1 8 20 24 32

Writes bench/results/sm_bandwidth.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, time_ms, write_result  # noqa: E402

from smsplit import ptx  # noqa: E402


@triton.jit
def read_kernel(src, out, n_vec, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for tile in range(pid, tl.cdiv(n_vec, BLOCK), tl.num_programs(0)):
        offs = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        w0, w1, w2, w3 = ptx.ld_global_nc_v4(src + 4 * offs, offs < n_vec)
        acc = acc ^ w0 ^ w1 ^ w2 ^ w3
    tl.store(out + pid * BLOCK + tl.arange(0, BLOCK), acc)


@triton.jit
def read_tma_kernel(src_desc, out, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int64)
    n_tiles = tl.cdiv(src_desc.shape[0], BLOCK)
    for tile in tl.range(pid, n_tiles, tl.num_programs(0), num_stages=STAGES):
        acc = acc ^ src_desc.load([tile * BLOCK])
    tl.store(out + pid * BLOCK + tl.arange(0, BLOCK), acc)


@triton.jit
def write_kernel(dst, n_vec, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for tile in range(pid, tl.cdiv(n_vec, BLOCK), tl.num_programs(0)):
        offs = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        w = offs.to(tl.int32)
        ptx.st_global_na_v4(dst + 4 * offs, w, w, w, w, offs < n_vec)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, nargs="+", default=[1, 8, 20, 24, 32])
    parser.add_argument("--mbytes", type=int, default=1024, help="bytes streamed per kernel (MiB)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    from triton.tools.tensor_descriptor import TensorDescriptor

    from smsplit.copy import sm_copy

    dev = torch.device("cuda")
    nbytes = args.mbytes * 2**20
    g = torch.Generator(device=dev).manual_seed(0)
    src = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=dev, generator=g)
    dst = torch.empty_like(src)
    n_vec = nbytes // 16
    out = torch.empty(2**22, dtype=torch.int64, device=dev)
    # correctness: a read folds every word once (XOR of all programs' accumulators = XOR of src); a write stores
    # each vector's index in its four words; a copy equals src
    xor_all = int(np.bitwise_xor.reduce(src.cpu().numpy()))
    written = torch.arange(n_vec, device=dev, dtype=torch.int64).to(torch.int32).repeat_interleave(4)
    rows = []
    cases = [("read", dict(block=4096, warps=16)), ("read", dict(block=8192, warps=16)),
             ("read_tma", dict(block=1024, stages=8, warps=4)), ("read_tma", dict(block=2048, stages=6, warps=4)),
             ("write", dict(block=4096, warps=16)), ("copy", dict(method="ldst", block=4096, num_warps=16)),
             ("copy_tma", dict(method="tma", block=1024, stages=8, num_warps=4))]
    for P in args.programs:
        for kind, kw in cases:
            moved = nbytes
            if kind == "read":
                o32 = out.view(torch.int32)

                def fn(P=P, kw=kw, o32=o32):
                    read_kernel[(P,)](src, o32, n_vec, BLOCK=kw["block"], num_warps=kw["warps"])
                fn()
                ok = int(np.bitwise_xor.reduce(o32[: P * kw["block"]].cpu().numpy())) == xor_all
            elif kind == "read_tma":
                el = src.view(torch.int64)
                tile = 2 * kw["block"]
                desc = TensorDescriptor(el, shape=[el.numel()], strides=[1], block_shape=[tile])

                def fn(P=P, kw=kw, desc=desc, tile=tile):
                    read_tma_kernel[(P,)](desc, out, BLOCK=tile, STAGES=kw["stages"], num_warps=kw["warps"])
                fn()
                folded = np.bitwise_xor.reduce(out[: P * tile].cpu().numpy())  # two words per element
                ok = int(np.bitwise_xor(folded & 0xFFFFFFFF, (folded >> 32) & 0xFFFFFFFF).astype(np.uint32)
                         .astype(np.int32)) == xor_all
            elif kind == "write":
                def fn(P=P, kw=kw):
                    write_kernel[(P,)](dst, n_vec, BLOCK=kw["block"], num_warps=kw["warps"])
                dst.fill_(-1)
                fn()
                ok = bool(torch.equal(dst, written))
            else:
                def fn(P=P, kw=kw):
                    sm_copy(dst, src, P, **kw)
                dst.fill_(-1)
                fn()
                ok = bool(torch.equal(dst, src))
                moved = 2 * nbytes
            t = time_ms(fn, warmup=3, repeat=args.reps, inner=5)["median_ms"]
            gbps = moved / t / 1e6
            name = f"{kind} " + " ".join(f"{k}={v}" for k, v in kw.items())
            rows.append(dict(kind=kind, config=kw, programs=P, ms=t, gbps=gbps, per_sm_gbps=gbps / P, correct=ok))
            print(f"P={P:3d} {name:45s} {t * 1e3:9.1f} us  {gbps:8.1f} GB/s  {gbps / P:6.1f} GB/s per SM  "
                  f"{'ok' if ok else 'WRONG'}", flush=True)
    write_result("sm_bandwidth", dict(environment(), mbytes=args.mbytes, rows=rows))


if __name__ == "__main__":
    main()
