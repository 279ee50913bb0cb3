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

``--copy-method ldst tma`` measures both copy methods of ``sm_copy`` on the same budgets in one run
(rows carry ``copy_method``); any method list other than the default ``ldst`` writes
bench/results/sm_split_<methods>.json and figures named after the method instead.

``--interleave K`` (K > 0) measures each cell (method, mode, comm SMs) in K short rounds instead, each
round taking GEMM alone, copy alone and the concurrent pair back to back (the order reversed every
other round), so that the "alone" baselines and the concurrent figures of one round share the clocks,
power and temperature of that moment. Rows then also carry the per-round kept ratios, their median,
min and max, and medians of the absolute figures; the result file and figures get ``_interleaved``
appended to their names.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FIGURES, concurrent_run, environment, interleaved_rounds, time_ms, write_result  # noqa: E402

from smsplit.budget import SmBudget  # noqa: E402
from smsplit.copy import sm_copy  # noqa: E402
from smsplit.trace import Trace  # noqa: E402


def gemm_tflops(ms: float, n: int) -> float:
    return 2 * n**3 / (ms * 1e-3) / 1e12


def copy_gbps(ms: float, nbytes: int) -> float:
    return 2 * nbytes / (ms * 1e-3) / 1e9  # read + write


def parse_shape(method: str, text: str) -> dict:
    """``BLOCKxWARPS`` (ldst) or ``BLOCKxWARPSxSTAGES`` (tma) as ``sm_copy`` keyword arguments."""
    parts = [int(x) for x in text.split("x")]
    if len(parts) != (3 if method == "tma" else 2):
        raise SystemExit(f"copy shape {text!r} for method {method}: expected "
                         + ("BLOCKxWARPSxSTAGES" if method == "tma" else "BLOCKxWARPS"))
    shape = {"block": parts[0], "num_warps": parts[1]}
    if method == "tma":
        shape["stages"] = parts[2]
    return shape


# Shapes swept on the full GPU with 24 programs. ldst: BLOCKxWARPS, one tile of BLOCK 16-byte vectors
# in flight per program. tma: BLOCKxWARPSxSTAGES, STAGES - 1 tiles of BLOCK vectors being loaded per
# program (STAGES * BLOCK * 16 bytes of shared memory, at most 227 KiB).
SWEEP = {"ldst": ("2048x8", "4096x16", "8192x16", "8192x32"),
         "tma": ("1024x4x8", "1024x4x12", "512x4x16", "2048x4x6", "2048x8x4", "4096x4x3")}
DEFAULT_SHAPE = {"ldst": "4096x16", "tma": "1024x4x8"}


def spread(values) -> dict:
    """Median, min and max of ``values``, ``None`` entries left out (all ``None`` when none is left)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def concurrent_fields(gemm_alone_ms: float, gemm_conc: list, copy_alone_ms: float, copy_conc: list, windows: list,
                      n: int, nbytes: int) -> dict:
    """A cell's alone and concurrent figures: the GEMM (``n``^3) and the copy (``nbytes``) alone, the medians of the
    concurrent samples (None where no GEMM ran inside the copies, or no copy inside the GEMMs), the sample counts,
    the concurrent runs' ``windows`` and the kept ratios (concurrent rate over alone rate)."""
    row = {
        "gemm_alone_ms": gemm_alone_ms,
        "gemm_alone_tflops": gemm_tflops(gemm_alone_ms, n),
        "gemm_concurrent_ms": statistics.median(gemm_conc) if gemm_conc else None,
        "gemm_concurrent_tflops": gemm_tflops(statistics.median(gemm_conc), n) if gemm_conc else None,
        "gemm_concurrent_samples": len(gemm_conc),
        "copy_alone_ms": copy_alone_ms,
        "copy_alone_gbps": copy_gbps(copy_alone_ms, nbytes),
        "copy_concurrent_ms": statistics.median(copy_conc) if copy_conc else None,
        "copy_concurrent_gbps": copy_gbps(statistics.median(copy_conc), nbytes) if copy_conc else None,
        "copy_concurrent_samples": len(copy_conc),
        "windows": windows,
    }
    row["gemm_kept"] = (row["gemm_concurrent_tflops"] / row["gemm_alone_tflops"]) if gemm_conc else None
    row["copy_kept"] = (row["copy_concurrent_gbps"] / row["copy_alone_gbps"]) if copy_conc else None
    return row


def interleaved_row(rounds: list[dict], n: int, nbytes: int) -> dict:
    """The row fields of one cell measured by ``interleaved_rounds``: the existing fields (alone:
    median of the rounds' alone medians; concurrent: median of every round's samples pooled; kept:
    their ratio) and the per-round fields (``*_kept_rounds`` and their median/min/max, medians of the
    rounds' absolute figures, and the rounds themselves)."""
    row = concurrent_fields(statistics.median(r["gemm_alone_ms"] for r in rounds),
                            [t for r in rounds for t in r["_samples"][0]],
                            statistics.median(r["copy_alone_ms"] for r in rounds),
                            [t for r in rounds for t in r["_samples"][1]], [r["window"] for r in rounds], n, nbytes)
    row["interleave_rounds"] = len(rounds)
    for side in ("gemm", "copy"):
        kept = [r[f"{side}_kept"] for r in rounds]
        row[f"{side}_kept_rounds"] = kept
        s = spread(kept)
        row[f"{side}_kept_median"], row[f"{side}_kept_min"], row[f"{side}_kept_max"] = s["median"], s["min"], s["max"]
    row["gemm_alone_tflops_median"] = spread([gemm_tflops(r["gemm_alone_ms"], n) for r in rounds])["median"]
    row["gemm_concurrent_tflops_median"] = spread(
        [gemm_tflops(r["gemm_concurrent_ms"], n) if r["gemm_concurrent_ms"] else None for r in rounds])["median"]
    row["copy_alone_gbps_median"] = spread([copy_gbps(r["copy_alone_ms"], nbytes) for r in rounds])["median"]
    row["copy_concurrent_gbps_median"] = spread(
        [copy_gbps(r["copy_concurrent_ms"], nbytes) if r["copy_concurrent_ms"] else None for r in rounds])["median"]
    row["rounds"] = [{k: v for k, v in r.items() if k != "_samples"} for r in rounds]
    return row


def interleaved_line(label: str, asked: int, granted: int, row: dict) -> str:
    """One compact line of an interleaved cell: per side the median kept ratio over the rounds
    [min-max] and the medians of the rounds' alone and concurrent figures."""
    def f(x, spec):
        return format(x, spec) if x is not None else "  n/a"
    return (f"{label:13s} comm {asked:2d}->{granted:2d} | GEMM kept {f(row['gemm_kept_median'], '.3f')} "
            f"[{f(row['gemm_kept_min'], '.3f')}-{f(row['gemm_kept_max'], '.3f')}] "
            f"alone {f(row['gemm_alone_tflops_median'], '6.1f')} conc {f(row['gemm_concurrent_tflops_median'], '6.1f')} TFLOP/s"
            f" | copy kept {f(row['copy_kept_median'], '.3f')} "
            f"[{f(row['copy_kept_min'], '.3f')}-{f(row['copy_kept_max'], '.3f')}] "
            f"alone {f(row['copy_alone_gbps_median'], '7.1f')} conc {f(row['copy_concurrent_gbps_median'], '7.1f')} GB/s"
            f" | {row['interleave_rounds']} rounds, {row['copy_concurrent_samples']} copy samples"
            + (f" | shared SMs {row['trace_shared_sm_count']}" if "trace" in row else ""))


def traced_round(budget, a, b, src, dst, programs, copy_kw, title, png, chrome):
    warm = Trace(budget.device)  # compile the traced kernels before the timed launches
    with torch.cuda.stream(budget.comm_stream):
        sm_copy(dst, src, programs, trace=warm, **copy_kw)
    warm.probe(budget.compute_stream, "warm-up")
    torch.cuda.synchronize()
    trace = Trace(budget.device)
    gate = torch.cuda.Event()
    torch.cuda._sleep(20_000_000)
    gate.record()
    budget.compute_stream.wait_event(gate)
    budget.comm_stream.wait_event(gate)
    with trace.span(budget.compute_stream, "gemm (cuBLAS)", kind="compute"), torch.cuda.stream(budget.compute_stream):
        for _ in range(3):
            torch.matmul(a, b)
    with torch.cuda.stream(budget.comm_stream):
        for _ in range(6):
            sm_copy(dst, src, programs, trace=trace, name="copy", kind="comm", **copy_kw)
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
    parser.add_argument("--copy-method", nargs="+", choices=["ldst", "tma"], default=["ldst"],
                        help="sm_copy method(s), each measured on the same budgets: ldst (16-byte ld/st per "
                             "thread) or tma (pipelined TMA bulk copies through shared memory; sm_90+)")
    parser.add_argument("--copy-shape", default=DEFAULT_SHAPE["ldst"],
                        help="BLOCKxWARPS of the ldst copy for the split rows ('best': fastest of the sweep)")
    parser.add_argument("--tma-shape", default=DEFAULT_SHAPE["tma"],
                        help="BLOCKxWARPSxSTAGES of the tma copy for the split rows ('best': fastest of the sweep)")
    parser.add_argument("--interleave", type=int, default=0, metavar="K",
                        help="measure each cell in K rounds of GEMM alone, copy alone and concurrent back to back "
                             "and report per-round kept ratios (median, min, max); 0: one alone measurement "
                             "then three concurrent rounds (default). Writes <name>_interleaved.json")
    parser.add_argument("--round-repeat", type=int, default=10,
                        help="with --interleave: timed calls of each alone measurement per round")
    parser.add_argument("--round-gemms", type=int, default=30,
                        help="with --interleave: GEMMs queued in each round's concurrent run")
    args = parser.parse_args()
    if args.interleave < 0 or args.round_repeat < 1 or args.round_gemms < 1:
        parser.error("--interleave must be >= 0, --round-repeat and --round-gemms >= 1")
    suffix = "_interleaved" if args.interleave else ""
    methods = list(dict.fromkeys(args.copy_method))
    requested_shape = {"ldst": args.copy_shape, "tma": args.tma_shape}
    stem = ("sm_split" if methods == ["ldst"] else "sm_split_" + "_".join(methods)) + suffix

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    n = args.n
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    src = torch.randn(args.copy_mib * 2**20 // 4, device=dev)
    dst = torch.full_like(src, float("nan"))
    nbytes = src.nbytes
    gemm = lambda: torch.matmul(a, b)  # noqa: E731

    # check the kernels against references once
    ref = (a[:256].float() @ b.float())
    err = ((gemm()[:256].float() - ref).norm() / ref.norm()).item()
    for method in methods:
        dst.fill_(float("nan"))
        sm_copy(dst, src, 24, method=method)
        torch.cuda.synchronize()
        assert torch.equal(dst, src), f"sm_copy(method={method!r}) produced wrong bytes"
    assert err < 1e-2, f"GEMM relative error {err}"

    env = environment()
    result = {"env": env, "gemm_n": n, "copy_bytes": nbytes, "green_programs_per_sm": args.green_programs_per_sm,
              "copy_methods": methods,
              "notes": "copy GB/s counts bytes read plus bytes written; GEMM on random bf16 inputs",
              "gemm_relative_error": err}
    if args.interleave:
        result.update({"interleave": args.interleave, "round_repeat": args.round_repeat, "round_gemms": args.round_gemms})
        result["notes"] += ("; interleaved: each cell in `interleave` rounds of GEMM alone, copy alone, concurrent "
                            "(reversed every other round); *_kept_median/min/max over the rounds' own ratios; "
                            "*_alone_*: median of the rounds' alone medians, *_concurrent_*: median of all rounds' "
                            "samples pooled, gemm_kept/copy_kept: their ratio")
    full = time_ms(gemm, warmup=5, repeat=20)
    result["gemm_full_gpu"] = {**full, "tflops": gemm_tflops(full["median_ms"], n)}
    print(f"GEMM full GPU: {full['median_ms']:.3f} ms, {gemm_tflops(full['median_ms'], n):.0f} TFLOP/s", flush=True)

    # copy kernel shape: a short sweep on the full GPU with 24 programs. The split rows use
    # --copy-shape (ldst, default 4096x16, ~1.2 TB/s on 24 SMs; the widest shape moves ~2 TB/s and so
    # takes more of the HBM bandwidth and power the GEMM needs) and --tma-shape (tma).
    copy_kw, sweeps = {}, {}
    for method in methods:
        shapes = {}
        for text in SWEEP[method]:
            kw = {"method": method, **parse_shape(method, text)}
            t = time_ms(lambda: sm_copy(dst, src, 24, **kw), warmup=3, repeat=10)  # noqa: B023
            shapes[text] = copy_gbps(t["median_ms"], nbytes)
        best = max(shapes, key=shapes.get) if requested_shape[method] == "best" else requested_shape[method]
        copy_kw[method] = {"method": method, **parse_shape(method, best)}
        dst.fill_(float("nan"))
        sm_copy(dst, src, 24, **copy_kw[method])
        torch.cuda.synchronize()
        assert torch.equal(dst, src), f"sm_copy({copy_kw[method]}) produced wrong bytes"
        sweeps[method] = shapes
        print(f"{'' if methods == ['ldst'] else method + ' '}copy shapes (24 programs, GB/s): {shapes}; using {best}",
              flush=True)
    result["copy_shape_sweep_gbps_24_programs"] = sweeps[methods[0]]
    result["copy_shape"] = {k: v for k, v in copy_kw[methods[0]].items() if k != "method"}
    result["copy_shape_sweeps_gbps_24_programs"] = sweeps
    result["copy_shapes"] = {m: {k: v for k, v in kw.items() if k != "method"} for m, kw in copy_kw.items()}

    rows = []
    variants = [(mode, False) for mode in args.modes] + [(mode, True) for mode in args.evict_first_modes]
    if "ldst" not in methods:
        variants = [(mode, ef) for mode, ef in variants if not ef]
        if args.evict_first_modes:
            print("evict-first rows skipped: only the ldst copy has an evict-first variant", flush=True)
    for mode, evict_first in variants:
        for comm_sms in args.comm_sms:
            with SmBudget(comm_sms, device=dev, mode=mode) as budget:
                for method in (["ldst"] if evict_first else methods):
                    kw = copy_kw[method]
                    programs = budget.comm_sms * (args.green_programs_per_sm if mode == "green" else 1)
                    copy = lambda: sm_copy(dst, src, programs, evict_first=evict_first, **kw)  # noqa: E731,B023
                    head = {
                        "mode": mode, "copy_method": method, "evict_first": evict_first, "requested_comm_sms": comm_sms, "comm_sms": budget.comm_sms,
                        "compute_sms": budget.compute_sms, "copy_programs": programs,
                    }
                    if args.interleave:
                        rounds = interleaved_rounds(budget, gemm, copy, args.interleave, args.round_repeat, args.round_gemms)
                        row = {**head, **interleaved_row(rounds, n, nbytes)}
                    else:
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
                        row = {**head, **concurrent_fields(gemm_alone["median_ms"], gemm_conc, copy_alone["median_ms"],
                                                           copy_conc, windows, n, nbytes)}
                    if comm_sms == args.trace_at and not evict_first:
                        FIGURES.mkdir(parents=True, exist_ok=True)
                        fig = f"sm_split_{mode}_{comm_sms}" if method == "ldst" else f"sm_split_{method}_{mode}_{comm_sms}"
                        fig += suffix
                        png = FIGURES / f"{fig}.png"
                        row["trace"] = traced_round(
                            budget, a, b, src, dst, programs, kw,
                            f"{mode} mode, comm_sms={comm_sms} (granted {budget.comm_sms}): {method} copy (comm) + cuBLAS GEMM (compute)"
                            if method != "ldst" else
                            f"{mode} mode, comm_sms={comm_sms} (granted {budget.comm_sms}): copy (comm) + cuBLAS GEMM (compute)",
                            png, FIGURES / f"{fig}_trace.json")
                        row["trace_shared_sm_count"] = len(row["trace"]["shared_sms"])
                    rows.append(row)
                    label = mode + ("+ef" if evict_first else "") + ("" if methods == ["ldst"] else f" {method}")
                    if args.interleave:
                        print(interleaved_line(label, comm_sms, budget.comm_sms, row), flush=True)
                        continue
                    print(f"{label:{8 if methods == ['ldst'] else 13}s} comm {comm_sms:2d}->{budget.comm_sms:2d} | GEMM alone {row['gemm_alone_tflops']:6.1f} "
                          f"conc {row['gemm_concurrent_tflops'] or float('nan'):6.1f} TFLOP/s ({row['gemm_kept'] or float('nan'):.3f}) | copy alone "
                          f"{row['copy_alone_gbps']:7.1f} conc {row['copy_concurrent_gbps'] or float('nan'):7.1f} GB/s "
                          f"({row['copy_kept'] or float('nan'):.3f})" + (f" | shared SMs {row['trace_shared_sm_count']}" if "trace" in row else ""),
                          flush=True)
    result["rows"] = rows
    path = write_result(stem, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
