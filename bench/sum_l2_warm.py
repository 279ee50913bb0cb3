"""Does the combine's sum run faster when its own rows are already in L2? One GPU, the combine's own sum
(`smsplit.ep.nvlink.sum_returned_rows`, two ranks, 8 tokens a step, 16 warps) over a range of tokens on a comm
budget of programs, DeepSeek-V3 shape (4096 tokens x 7168).

A 2-GPU combine waits about 70 us for its first chunk with its SMs idle, then sums to the end; after its last chunk's
flag it still sums that chunk's tokens (17-19 us at 20 SMs, BENCHMARKS.md section 2, session 23). If the own rows (from
``y``) of the later chunks were read into L2 in the idle wait, the sum after the flags would read them from L2. Here,
before each timed sum, L2 is flushed (a 256 MB write), the peer rows of the range are written (as a landing copy
leaves them), and then, per case: nothing more (``cold``), the own rows of the range read with an evict-last hint
(``own_in_l2``), or the sum already run once over the range (``all_in_l2``). Output checked against torch.

    PYTHONPATH=src python3 bench/sum_l2_warm.py --programs 20 24
Writes bench/results/sum_l2_warm.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402

from smsplit.ep.nvlink import sum_returned_rows  # noqa: E402


@triton.jit
def sum_range_kernel(pos_ptr, y_ptr, cx_ptr, out_ptr, dummy_ptr, t_begin, t_end, H, slots,
                     HB: tl.constexpr, TB: tl.constexpr):
    y_bf16 = y_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    cx = cx_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    for t0 in range(t_begin + tl.program_id(0) * TB, t_end, tl.num_programs(0) * TB):
        t = t0 + tl.arange(0, TB)
        sum_returned_rows(t, t < t_end, pos_ptr, 2, 0, 0, y_bf16, dummy_ptr, cx, dummy_ptr, slots, out_ptr, dummy_ptr,
                          H, 1, HB, 2, 2, TB, False)


@triton.jit
def touch_rows_kernel(src_ptr, sink_ptr, r_begin, r_end, H, HB: tl.constexpr, TB: tl.constexpr):
    """Read rows [r_begin, r_end) of a bf16 matrix with an evict-last hint (what a combine's idle SMs would do)."""
    h = tl.arange(0, HB)[None, :]
    acc = tl.zeros((TB, HB), dtype=tl.float32)
    for r0 in range(r_begin + tl.program_id(0) * TB, r_end, tl.num_programs(0) * TB):
        r = (r0 + tl.arange(0, TB)).to(tl.int64)[:, None]
        acc += tl.load(src_ptr + r * H + h, mask=(r < r_end) & (h < H), other=0.0,
                       eviction_policy="evict_last").to(tl.float32)
    tl.store(sink_ptr + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, nargs="+", default=[20])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--ranges", nargs="+", default=["0.9,1", "0.7,1", "0,1"],
                        help="token ranges as fractions 'begin,end'")
    args = parser.parse_args()
    dev = torch.device("cuda")
    T, H = args.tokens, args.hidden
    HB = triton.next_power_of_2(H)
    g = torch.Generator(device=dev).manual_seed(0)
    y = (torch.randn(T, H, device=dev, generator=g)).to(torch.bfloat16)  # own rows: row t for token t
    peer_rows = (torch.randn(T, H, device=dev, generator=g)).to(torch.bfloat16)
    cx = torch.empty(2 * T, H, dtype=torch.bfloat16, device=dev)  # slot (1 - rank) * T + t: token t's peer row
    pos = torch.arange(T, device=dev, dtype=torch.int32)[:, None].repeat(1, 2).contiguous()
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    sink = torch.empty(1024, dtype=torch.float32, device=dev)
    dummy = torch.empty(16, dtype=torch.float32, device=dev)
    ref = (y.float() + peer_rows.float()).to(torch.bfloat16)
    rows = []
    for P in args.programs:
        for text in args.ranges:
            a, b = (float(f) for f in text.split(","))
            t_begin, t_end = int(round(a * T)), int(round(b * T))

            def run_sum():
                sum_range_kernel[(P,)](pos, y, cx, out, dummy, t_begin, t_end, H, T, HB=HB, TB=8, num_warps=16)

            for case in ("cold", "own_in_l2", "all_in_l2"):
                times = []
                for rep in range(args.reps + 3):
                    out.fill_(float("nan"))
                    flush.fill_(rep % 251)
                    cx[T + t_begin:T + t_end].copy_(peer_rows[t_begin:t_end])
                    if case == "own_in_l2":
                        touch_rows_kernel[(P,)](y, sink, t_begin, t_end, H, HB=HB, TB=2, num_warps=16)
                    elif case == "all_in_l2":
                        run_sum()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    run_sum()
                    end.record()
                    end.synchronize()
                    if rep >= 3:
                        times.append(start.elapsed_time(end) * 1e3)
                equal = torch.equal(out[t_begin:t_end], ref[t_begin:t_end])
                us = statistics.median(times)
                nbytes = (t_end - t_begin) * H * 2 * 3
                rows.append({"programs": P, "range": [a, b], "case": case, "median_us": us, "min_us": min(times),
                             "max_us": max(times), "gb_per_s": nbytes / us / 1e3, "equal": equal})
                print(f"P={P:2d} tokens [{t_begin}, {t_end}) {case:9s}: {us:7.1f} us (min {min(times):.1f}, max "
                      f"{max(times):.1f}), {nbytes / us / 1e3:6.0f} GB/s, equal {equal}", flush=True)
    write_result("sum_l2_warm", {"environment": environment(), "command": " ".join(sys.argv), "rows": rows})


if __name__ == "__main__":
    main()
