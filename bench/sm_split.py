"""SM budget benchmark: a bandwidth-bound comm kernel beside a large GEMM, on split SMs.

For comm_sms in {8, 16, 24, 32} and modes green (hardware partition) and grid (no partition):
  * GEMM TFLOP/s (bf16 8192^3, torch.matmul) on the full GPU, alone on its budget, and concurrent
    with the comm kernel;
  * the comm kernel's GB/s (smsplit.copy.sm_copy, persistent, one program per comm SM; bytes read
    plus bytes written) alone on its budget and concurrent;
  * the SM sets each ran on, from an SM-level trace (the copy records every program; the GEMM is
    covered by probe kernels on its stream), and the trace picture.

Run on one H200:  PYTHONPATH=src python3 bench/sm_split.py
Writes bench/results/sm_split.json and bench/figures/sm_split_*.png / *_trace.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FIGURES, concurrent_run, environment, time_ms, write_result  # noqa: E402

from smsplit.budget import SmBudget  # noqa: E402
from smsplit.copy import sm_copy  # noqa: E402
from smsplit.trace import Trace  # noqa: E402


def gemm_tflops(ms: float, n: int) -> float:
    return 2 * n**3 / (ms * 1e-3) / 1e12


def copy_gbps(ms: float, nbytes: int) -> float:
    return 2 * nbytes / (ms * 1e-3) / 1e9  # read + write


def traced_round(budget, a, b, src, dst, programs, block, warps, title, png, chrome):
    warm = Trace(budget.device)  # compile the traced kernels before the timed launches
    with torch.cuda.stream(budget.comm_stream):
        sm_copy(dst, src, programs, trace=warm, block=block, num_warps=warps)
    warm.probe(budget.compute_stream, "warm-up")
    torch.cuda.synchronize()
    trace = Trace(budget.device)
    gate = torch.cuda.Event()
    torch.cuda._sleep(20_000_000)
    gate.record()
    budget.compute_stream.wait_event(gate)
    budget.comm_stream.wait_event(gate)
    with trace.span(budget.compute_stream, "gemm (cuBLAS)", kind="compute"):
        with torch.cuda.stream(budget.compute_stream):
            for _ in range(3):
                torch.matmul(a, b)
    with torch.cuda.stream(budget.comm_stream):
        for _ in range(6):
            sm_copy(dst, src, programs, trace=trace, name="copy", kind="comm", block=block, num_warps=warps)
    torch.cuda.synchronize()
    trace.save_png(png, title=title, num_sms=budget.total_sms)
    trace.save_chrome(chrome)
    comm, compute = trace.sms(kind="comm"), trace.sms(kind="compute")
    return {"comm_sms_used": sorted(comm), "compute_sms_used": sorted(compute),
            "shared_sms": sorted(comm & compute), "png": str(png.relative_to(png.parents[1]))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=8192, help="GEMM size n (n x n x n, bf16)")
    parser.add_argument("--copy-mib", type=int, default=512, help="bytes the comm kernel copies, MiB")
    parser.add_argument("--comm-sms", type=int, nargs="+", default=[8, 16, 24, 32])
    parser.add_argument("--modes", nargs="+", default=["green", "grid"])
    parser.add_argument("--trace-at", type=int, default=24, help="comm_sms of the traced round")
    parser.add_argument("--evict-first-modes", nargs="*", default=["green"],
                        help="modes also measured with the copy's lines marked evict-first in L2")
    parser.add_argument("--green-programs-per-sm", type=int, default=1,
                        help="copy programs per comm SM in green mode (grid mode always runs one per comm SM)")
    parser.add_argument("--copy-shape", default="4096x16",
                        help="BLOCKxWARPS of the comm copy for the split rows ('best': fastest of the sweep)")
    args = parser.parse_args()

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    n = args.n
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    src = torch.randn(args.copy_mib * 2**20 // 4, device=dev)
    dst = torch.full_like(src, float("nan"))
    nbytes = src.nbytes
    gemm = lambda: torch.matmul(a, b)  # noqa: E731

    # check both kernels against references once
    ref = (a[:256].float() @ b.float())
    err = ((gemm()[:256].float() - ref).norm() / ref.norm()).item()
    sm_copy(dst, src, 24)
    torch.cuda.synchronize()
    assert torch.equal(dst, src), "sm_copy produced wrong bytes"
    assert err < 1e-2, f"GEMM relative error {err}"

    env = environment()
    result = {"env": env, "gemm_n": n, "copy_bytes": nbytes, "green_programs_per_sm": args.green_programs_per_sm,
              "notes": "copy GB/s counts bytes read plus bytes written; GEMM on random bf16 inputs",
              "gemm_relative_error": err}
    full = time_ms(gemm, warmup=5, repeat=20)
    result["gemm_full_gpu"] = {**full, "tflops": gemm_tflops(full["median_ms"], n)}
    print(f"GEMM full GPU: {full['median_ms']:.3f} ms, {gemm_tflops(full['median_ms'], n):.0f} TFLOP/s", flush=True)

    # copy kernel shape: a short sweep on the full GPU with 24 programs. The split rows use
    # --copy-shape (default 4096x16, ~1.2 TB/s on 24 SMs); the widest shape moves ~2 TB/s and so
    # takes more of the HBM bandwidth and power the GEMM needs.
    shapes = {}
    for block, warps in ((2048, 8), (4096, 16), (8192, 16), (8192, 32)):
        t = time_ms(lambda: sm_copy(dst, src, 24, block=block, num_warps=warps), warmup=3, repeat=10)
        shapes[f"{block}x{warps}"] = copy_gbps(t["median_ms"], nbytes)
    best = max(shapes, key=shapes.get) if args.copy_shape == "best" else args.copy_shape
    block, warps = map(int, best.split("x"))
    result["copy_shape_sweep_gbps_24_programs"] = shapes
    result["copy_shape"] = {"block": block, "num_warps": warps}
    print(f"copy shapes (24 programs, GB/s): {shapes}; using {best}", flush=True)

    rows = []
    variants = [(mode, False) for mode in args.modes] + [(mode, True) for mode in args.evict_first_modes]
    for mode, evict_first in variants:
        for comm_sms in args.comm_sms:
            with SmBudget(comm_sms, device=dev, mode=mode) as budget:
                programs = budget.comm_sms * (args.green_programs_per_sm if mode == "green" else 1)
                copy = lambda: sm_copy(dst, src, programs, block=block, num_warps=warps,  # noqa: E731
                                       evict_first=evict_first)
                copy_alone = time_ms(copy, stream=budget.comm_stream, warmup=3, repeat=15)
                gemm_alone = time_ms(gemm, stream=budget.compute_stream, warmup=3, repeat=15)
                n_gemm = 30
                n_copy = max(4, int(1.4 * n_gemm * gemm_alone["median_ms"] / copy_alone["median_ms"]))
                gemm_conc, copy_conc, windows = [], [], []
                for _ in range(3):  # three concurrent rounds; every kernel that overlapped counts
                    g, c, w = concurrent_run(budget, gemm, copy, n_gemm, n_copy)
                    gemm_conc += g
                    copy_conc += c
                    windows.append(w)
                windows = {"windows": windows}
                row = {
                    "mode": mode, "evict_first": evict_first, "requested_comm_sms": comm_sms, "comm_sms": budget.comm_sms,
                    "compute_sms": budget.compute_sms, "copy_programs": programs,
                    "gemm_alone_ms": gemm_alone["median_ms"],
                    "gemm_alone_tflops": gemm_tflops(gemm_alone["median_ms"], n),
                    "gemm_concurrent_ms": statistics.median(gemm_conc),
                    "gemm_concurrent_tflops": gemm_tflops(statistics.median(gemm_conc), n),
                    "gemm_concurrent_samples": len(gemm_conc),
                    "copy_alone_ms": copy_alone["median_ms"],
                    "copy_alone_gbps": copy_gbps(copy_alone["median_ms"], nbytes),
                    "copy_concurrent_ms": statistics.median(copy_conc) if copy_conc else None,
                    "copy_concurrent_gbps": copy_gbps(statistics.median(copy_conc), nbytes) if copy_conc else None,
                    "copy_concurrent_samples": len(copy_conc),
                    **windows,
                }
                row["gemm_kept"] = row["gemm_concurrent_tflops"] / row["gemm_alone_tflops"]
                row["copy_kept"] = (row["copy_concurrent_gbps"] / row["copy_alone_gbps"]) if copy_conc else None
                if comm_sms == args.trace_at and not evict_first:
                    FIGURES.mkdir(parents=True, exist_ok=True)
                    png = FIGURES / f"sm_split_{mode}_{comm_sms}.png"
                    row["trace"] = traced_round(
                        budget, a, b, src, dst, programs, block, warps,
                        f"{mode} mode, comm_sms={comm_sms} (granted {budget.comm_sms}): copy (comm) + cuBLAS GEMM (compute)",
                        png, FIGURES / f"sm_split_{mode}_{comm_sms}_trace.json")
                    row["trace_shared_sm_count"] = len(row["trace"]["shared_sms"])
                rows.append(row)
                print(f"{mode + ('+ef' if evict_first else ''):8s} comm {comm_sms:2d}->{budget.comm_sms:2d} | GEMM alone {row['gemm_alone_tflops']:6.1f} "
                      f"conc {row['gemm_concurrent_tflops']:6.1f} TFLOP/s ({row['gemm_kept']:.3f}) | copy alone "
                      f"{row['copy_alone_gbps']:7.1f} conc {row['copy_concurrent_gbps'] or float('nan'):7.1f} GB/s "
                      f"({row['copy_kept'] or float('nan'):.3f})" + (f" | shared SMs {row['trace_shared_sm_count']}" if "trace" in row else ""),
                      flush=True)
    result["rows"] = rows
    path = write_result("sm_split", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
