"""Print the BENCHMARKS.md tables from bench/results/*.json (so the tables are the measured numbers)."""

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _num(x, spec):
    """``x`` formatted, "n/a" for a figure that was not measured (None, or NaN in older results)."""
    return format(x, spec) if x is not None and x == x else "n/a"


def env_line(env):
    return (f"{env.get('gpu')} x{env.get('gpu_count')}, driver {env.get('driver')}, torch {env['torch']}, "
            f"triton {env['triton']}, {env['date']}; command: `{env['command']}`")


def sm_split(name="sm_split"):
    d = json.loads((RESULTS / f"{name}.json").read_text())
    print(f"Measured: {env_line(d['env'])}\n")
    print(f"GEMM {d['gemm_n']}^3 bf16 on the full GPU: {d['gemm_full_gpu']['tflops']:.0f} TFLOP/s "
          f"(median of {d['gemm_full_gpu']['n']}). Copy shape {d['copy_shape']['block']}x{d['copy_shape']['num_warps']} "
          f"(sweep, GB/s with 24 programs: "
          + ", ".join(f"{k} {v:.0f}" for k, v in d["copy_shape_sweep_gbps_24_programs"].items()) + ").\n")
    if d.get("interleave"):
        return sm_split_interleaved(d)
    print("| mode | comm SMs asked → granted | compute SMs | GEMM alone on budget (TFLOP/s) | GEMM concurrent | kept | "
          "copy alone (GB/s) | copy concurrent | kept | SMs shared (trace) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in d["rows"]:
        shared = str(r.get("trace_shared_sm_count", "")) if "trace" in r else ""
        mode = r["mode"] + (" + L2 evict-first" if r.get("evict_first") else "")
        print(f"| {mode} | {r['requested_comm_sms']} → {r['comm_sms']} | {r['compute_sms']} | "
              f"{_num(r['gemm_alone_tflops'], '.0f')} | {_num(r['gemm_concurrent_tflops'], '.0f')} | "
              f"{_num(r['gemm_kept'], '.3f')} | {_num(r['copy_alone_gbps'], '.0f')} | "
              f"{_num(r['copy_concurrent_gbps'], '.0f')} | {_num(r['copy_kept'], '.3f')} | {shared} |")


def sm_split_interleaved(d):
    """Rows of a ``--interleave K`` run: medians over the K rounds of each round's own figures, and the
    rounds' kept range."""
    num = _num

    def kept(r, side):
        return (f"{num(r[f'{side}_kept_median'], '.3f')} ({num(r[f'{side}_kept_min'], '.3f')}–"
                f"{num(r[f'{side}_kept_max'], '.3f')})")

    print(f"Each cell: {d['interleave']} rounds of GEMM alone, copy alone and both concurrent, back to back; "
          "figures are medians over the rounds, kept is the median of the rounds' own ratios (min–max).\n")
    print("| mode | copy | comm SMs asked → granted | compute SMs | GEMM alone (TFLOP/s) | GEMM concurrent | kept | "
          "copy alone (GB/s) | copy concurrent | kept | SMs shared (trace) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in d["rows"]:
        shared = str(r.get("trace_shared_sm_count", "")) if "trace" in r else ""
        mode = r["mode"] + (" + L2 evict-first" if r.get("evict_first") else "")
        print(f"| {mode} | {r.get('copy_method', 'ldst')} | {r['requested_comm_sms']} → {r['comm_sms']} | {r['compute_sms']} | "
              f"{num(r['gemm_alone_tflops_median'], '.0f')} | {num(r['gemm_concurrent_tflops_median'], '.0f')} | {kept(r, 'gemm')} | "
              f"{num(r['copy_alone_gbps_median'], '.0f')} | {num(r['copy_concurrent_gbps_median'], '.0f')} | {kept(r, 'copy')} | {shared} |")


def ep():
    d = json.loads((RESULTS / "ep.json").read_text())
    print(f"Measured: {env_line(d['env'])}\n")
    print(f"Per rank: {d['shape']['tokens']} tokens, hidden {d['shape']['hidden']}, {d['shape']['experts']} experts, "
          f"top-{d['shape']['topk']}; rank 0 receives {d['num_recv']} rows ({d['recv_from_peers']} over NVLink).\n")
    print("| transport | comm SMs | dispatch BF16 (us) | uncached | DeepEP GB/s | NVLink GB/s | "
          "dispatch FP8 incl. quant (us) | combine (us) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in d["rows"]:
        print(f"| {r.get('transport', 'nvlink')} | {r['comm_sms']} | {r['dispatch_bf16_cached_ms'] * 1e3:.0f} | {r['dispatch_bf16_ms'] * 1e3:.0f} | "
              f"{r['dispatch_bf16_deepep_gbps']:.0f} | {r['dispatch_bf16_nvlink_gbps']:.0f} | "
              f"{r['dispatch_fp8_cached_ms'] * 1e3:.0f} | {r['combine_ms'] * 1e3:.0f} |")
    print(f"\nSame run: NCCL all_to_all_single of the same BF16 rows {d['nccl_all_to_all_ms'] * 1e3:.0f} us "
          f"({d['nccl_all_to_all_gbps_recv']:.0f} GB/s DeepEP convention); copy-engine peer copy of the "
          f"{d['copy_engine_bytes'] / 1e6:.1f} MB that cross NVLink {d['copy_engine_ms'] * 1e3:.0f} us "
          f"({d['copy_engine_gbps']:.0f} GB/s)."
          + (f" To every peer at once (its own rows each): {d['copy_engine_all_peers_ms'] * 1e3:.0f} us for "
             f"{d['copy_engine_all_peers_bytes'] / 1e6:.1f} MB." if "copy_engine_all_peers_ms" in d else "")
          + (f" With 5 calls queued: NCCL {d['nccl_all_to_all_queued_ms'] * 1e3:.0f} us, copy engine "
             f"{d['copy_engine_queued_ms'] * 1e3:.0f} us." if "copy_engine_queued_ms" in d else "")
          + (f" Started together: NCCL {d['nccl_all_to_all_aligned_ms'] * 1e3:.0f} us, copy engine "
             f"{d['copy_engine_aligned_ms'] * 1e3:.0f} us." if "copy_engine_aligned_ms" in d else "") + "\n")
    if any("dispatch_bf16_host_us" in r for r in d["rows"]):
        print("Host time of one call (Python and launches, no synchronization), median of 10:\n")
        print("| transport | comm SMs | dispatch (us) | combine (us) |")
        print("|---|---|---|---|")
        for r in d["rows"]:
            print(f"| {r.get('transport', 'nvlink')} | {r['comm_sms']} | {r['dispatch_bf16_host_us']:.0f} | "
                  f"{r['combine_host_us']:.0f} |")
        print()
    graph_rows = d.get("graph_rows") or [dict(r, transport="nvlink") for r in d.get("nvlink_graph_rows", [])]
    if graph_rows:
        print("Replayed from CUDA graphs (no host work per call). nvlink: uncached (the device-side count exchange "
              "inside); nvlink_copy_engine: a cached layout (its copies are planned on the host at the first call):\n")
        queued = "combine_graph_queued_ms" in graph_rows[0]
        aligned = "combine_graph_aligned_ms" in graph_rows[0]
        weighted = "combine_weighted_graph_ms" in graph_rows[0]  # bench/ep.py --combine-weights
        extra = (" BF16 / FP8 / combine, 5 queued (us) |" if queued else "") + (
            " same, started together (us) |" if aligned else "") + (
            " combine with top-k weights: one call / 5 queued / started together (us) |" if weighted else "")
        print("| transport | copy share | comm SMs | dispatch BF16 (us) | dispatch FP8 (us) | combine (us) |" + extra)
        print("|---|---|---|---|---|---|" + ("---|" if queued else "") + ("---|" if aligned else "")
              + ("---|" if weighted else ""))
        for r in graph_rows:
            share = "" if r.get("copy_share") is None else f"{r['copy_share']:g}"
            if r.get("combine_chunks"):
                share += " (combine chunks " + ", ".join(f"{f:g}" for f in r["combine_chunks"]) + ")"
            steady = (" " + " / ".join(f"{r[k + '_graph_queued_ms'] * 1e3:.0f}" for k in
                                       ("dispatch_bf16", "dispatch_fp8", "combine")) + " |") if queued else ""
            steady += (" " + " / ".join(f"{r[k + '_graph_aligned_ms'] * 1e3:.0f}" for k in
                                        ("dispatch_bf16", "dispatch_fp8", "combine")) + " |") if aligned else ""
            steady += (" " + " / ".join(f"{r[k] * 1e3:.0f}" for k in
                                        ("combine_weighted_graph_ms", "combine_weighted_graph_queued_ms",
                                         "combine_weighted_graph_aligned_ms") if k in r) + " |") if weighted else ""
            print(f"| {r['transport']} | {share} | {r['comm_sms']} | {r['dispatch_bf16_graph_ms'] * 1e3:.0f} | "
                  f"{r['dispatch_fp8_graph_ms'] * 1e3:.0f} | {r['combine_graph_ms'] * 1e3:.0f} |" + steady)
        print()
    if any("dispatch_fp8_input_cached_ms" in r for r in d["rows"]):
        print("FP8 dispatch of input quantized before the call (`dispatch((x_fp8, scales), ...)`: DeepEP's benchmark "
              "condition; e4m3 rows and one fp32 scale per 128 values moved as they are), same run:\n")
        print("| transport | copy share | comm SMs | eager, cached (us) | replayed: one call / 5 queued / started "
              "together (us) |")
        print("|---|---|---|---|---|")
        for r in d["rows"]:
            replays = [g for g in graph_rows if (g["transport"], g["comm_sms"]) == (r["transport"], r["comm_sms"])
                       and "dispatch_fp8_input_graph_ms" in g] or [{}]
            for g in replays:
                share = "" if g.get("copy_share") is None else f"{g['copy_share']:g}"
                replayed = " / ".join(f"{g[k] * 1e3:.1f}" for k in (
                    "dispatch_fp8_input_graph_ms", "dispatch_fp8_input_graph_queued_ms",
                    "dispatch_fp8_input_graph_aligned_ms")) if g else "(not captured)"
                print(f"| {r['transport']} | {share} | {r['comm_sms']} | {r['dispatch_fp8_input_cached_ms'] * 1e3:.0f} | "
                      f"{replayed} |")
        print()
    print("| programs | SM copy write to peer (GB/s) | SM copy read from peer (GB/s) |")
    print("|---|---|---|")
    for r in d.get("sm_copy_over_nvlink", []):
        print(f"| {r['programs']} | {r['write_gbps']:.0f} | {r['read_gbps']:.0f} |")
    for c in d.get("concurrent", []):
        print(f"\n{c.get('transport', 'nvlink')}, concurrent (green, asked {c['asked']} → {c['comm_sms']} comm SMs, {c['compute_sms']} compute SMs): "
              f"GEMM 8192^3 {c['gemm_full_gpu_ms']:.3f} ms on the full GPU, {c['gemm_alone_on_budget_ms']:.3f} ms alone "
              f"on its budget, {c['gemm_concurrent_ms']:.3f} ms beside FP8 dispatch + combine; dispatch + combine "
              f"{c['comm_alone_ms'] * 1e3:.0f} us alone, {c['comm_concurrent_ms'] * 1e3:.0f} us beside the GEMM."
              + (f" GEMM slowdown beside the comm, median of {len(c['rounds'])} rounds (each: GEMM alone, comm alone, "
                 f"both; odd rounds reversed): {c['gemm_slowdown'] * 100:+.1f}% (rounds "
                 + ", ".join(f"{x * 100:+.1f}" for x in c["gemm_slowdown_rounds"]) + "%); every call queued before "
                 f"the loops started: {'yes' if c['all_queued_before_start'] else 'NO (host-bound gaps possible)'}."
                 if "rounds" in c else "")
              + (f" Dispatch + combine alone timed {c['comm_alone_queued']} calls queued behind a sleep kernel, as "
                 f"beside the GEMM; its slowdown beside the GEMM, median of the rounds: {c['comm_slowdown'] * 100:+.1f}% (rounds "
                 + ", ".join(f"{x * 100:+.1f}" for x in c["comm_slowdown_rounds"]) + "%)."
                 if c.get("comm_slowdown") is not None else ""))


# bench/ep.py's operations and the bytes each moves, per rank (counts of the rank that reports, rank 0):
# DeepEP's convention counts recv_x, every received row (the rank's own included), BF16 2 bytes a value, FP8
# (1 + 4/128) / 2 of that (e4m3 values and one fp32 scale per 128); a combine counts the dispatch's received bytes.
# The NVLink bytes are those of the rows that cross NVLink: a dispatch's rows received from other ranks (FP8: e4m3
# values and their scales), a combine's rows sent back to them (BF16). Metadata (top-k ids, weights, source
# indices, counts) is counted in neither.
EP_OPS = {"dispatch_bf16": "bf16", "dispatch_fp8": "fp8", "dispatch_fp8_input": "fp8", "combine": "bf16",
          "combine_weighted": "bf16"}
EP_WAYS = {"": ("nccl_all_to_all_ms", "copy_engine_ms"),  # eager rows, and graph rows' one call
           "_queued": ("nccl_all_to_all_queued_ms", "copy_engine_queued_ms"),
           "_aligned": ("nccl_all_to_all_aligned_ms", "copy_engine_aligned_ms")}


def ep_bytes(d) -> dict:
    """Bytes of each operation of bench/ep.py per rank: ``{op: {"deepep": ..., "nvlink": ...}}`` from the result's
    ``num_recv`` (rows of recv_x) and ``recv_from_peers`` (rows that crossed NVLink) and the hidden size."""
    H = d["shape"]["hidden"]
    width = {"bf16": 2 * H, "fp8": H + H // 128 * 4}  # bytes per row: BF16; e4m3 and one fp32 scale per 128
    return {op: {"deepep": d["num_recv"] * width[kind], "nvlink": d["recv_from_peers"] * width[kind]}
            for op, kind in EP_OPS.items()}


def _gbps(nbytes, ms):
    return nbytes / ms / 1e6 if ms and ms == ms else None  # (None for a missing or NaN time)


def _ratio(a, b):
    return a / b if a and b and a == a and b == b else None


def add_ep_rates(d) -> dict:
    """Add to an ep.json result (in place; returned) every time's GB/s, DeepEP convention and NVLink, and its
    ratios to the baselines of the same run timed the same way (one call, 5 queued, started together):
    ``<time>_deepep_gbps``, ``<time>_nvlink_gbps``, ``<time>_of_ceiling`` (NVLink GB/s over the copy-engine peer
    copy's GB/s) and, where NCCL's all_to_all_single moved the same bytes (BF16 dispatch and combine),
    ``<time>_vs_nccl`` (NCCL's time over this one: above 1 is faster than NCCL). ``<time>`` is the time's key
    without ``_ms`` (eager rows: ``dispatch_bf16_cached`` etc.; graph rows: ``dispatch_bf16_graph_queued`` etc.);
    also ``dispatch_bf16_deepep_gbps`` etc. (eager, cached dispatch), as bench/ep.py has always written them."""
    nbytes = ep_bytes(d)
    d["bytes_per_rank"] = nbytes
    d["nccl_all_to_all_gbps_recv"] = _gbps(d["num_recv"] * 2 * d["shape"]["hidden"], d["nccl_all_to_all_ms"])
    d["copy_engine_gbps"] = _gbps(d["copy_engine_bytes"], d["copy_engine_ms"])
    ceiling = {way: _gbps(d["copy_engine_bytes"], d.get(ce)) for way, (_, ce) in EP_WAYS.items()}

    def rates(row, op, key, way):
        ms = row.get(key + "_ms")
        if ms is None:
            return
        nccl = d.get(EP_WAYS[way][0])
        row[key + "_deepep_gbps"] = _gbps(nbytes[op]["deepep"], ms)
        row[key + "_nvlink_gbps"] = _gbps(nbytes[op]["nvlink"], ms)
        row[key + "_of_ceiling"] = _ratio(row[key + "_nvlink_gbps"], ceiling[way])
        if op in ("dispatch_bf16", "combine"):  # NCCL moved these bytes (its recv buffer: recv_x's BF16 rows)
            row[key + "_vs_nccl"] = _ratio(nccl, ms)

    for row in d["rows"]:
        for op in EP_OPS:
            rates(row, op, op + ("" if op.startswith("combine") else "_cached"), "")
        if "dispatch_bf16_ms" in row:  # uncached
            rates(row, "dispatch_bf16", "dispatch_bf16", "")
        for op in ("dispatch_bf16", "dispatch_fp8", "combine"):  # the names tables.py and BENCHMARKS.md use
            key = op + ("" if op == "combine" else "_cached")
            row[op + "_deepep_gbps"] = row[key + "_deepep_gbps"]
            row[op + "_nvlink_gbps"] = row[key + "_nvlink_gbps"]
    for row in d.get("graph_rows", []):
        for op in EP_OPS:
            for way in EP_WAYS:
                rates(row, op, f"{op}_graph{way}", way)
    return d


def ep_rates(name="ep"):
    """GB/s of every time of bench/results/<name>.json (`add_ep_rates`): DeepEP convention, NVLink, the share of the
    copy-engine ceiling and, for BF16 dispatch and combine, NCCL's time over ours, each against the baselines
    timed the same way in the same run."""
    d = add_ep_rates(json.loads((RESULTS / f"{name}.json").read_text()))
    b = d["bytes_per_rank"]
    print(f"Bytes per rank (rank 0: {d['num_recv']} rows received, {d['recv_from_peers']} of them over NVLink): "
          + "; ".join(f"{op} {b[op]['deepep'] / 1e6:.1f} MB DeepEP convention, {b[op]['nvlink'] / 1e6:.1f} MB over "
                      f"NVLink" for op in ("dispatch_bf16", "dispatch_fp8", "combine"))
          + ". Baselines, one call / 5 queued / started together: NCCL all_to_all_single "
          + " / ".join(f"{d[n] * 1e3:.0f}" if d.get(n) == d.get(n) and d.get(n) else "n/a"
                       for n, _ in EP_WAYS.values())
          + " us, copy-engine peer copy of the NVLink bytes "
          + " / ".join(f"{_gbps(d['copy_engine_bytes'], d[c]):.0f}" if d.get(c) else "n/a" for _, c in EP_WAYS.values())
          + " GB/s (the ceiling).\n")
    print("Each cell: us / DeepEP GB/s / NVLink GB/s / NVLink GB/s over the ceiling's; BF16 dispatch and combine also "
          "NCCL's time over this one (x NCCL: above 1 is faster than NCCL). Times are bench/ep.py's (the slower "
          "rank's median); bytes are rank 0's.\n")
    print("| transport | copy share | comm SMs | timed | dispatch BF16 | x NCCL | dispatch FP8 (quantized in it) | "
          "dispatch FP8 input | combine | x NCCL |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def cell(row, key):
        if row.get(key + "_ms") is None:
            return ""
        ceiling = row.get(key + "_of_ceiling")
        return (f"{row[key + '_ms'] * 1e3:.0f} / {row[key + '_deepep_gbps']:.0f} / {row[key + '_nvlink_gbps']:.0f} / "
                + (f"{ceiling:.2f}" if ceiling else "n/a"))

    def nccl(row, key):
        r = row.get(key + "_vs_nccl")
        return f"{r:.2f}" if r else ""

    for row in d["rows"]:
        print(f"| {row['transport']} |  | {row['comm_sms']} | eager, cached | {cell(row, 'dispatch_bf16_cached')} | "
              f"{nccl(row, 'dispatch_bf16_cached')} | {cell(row, 'dispatch_fp8_cached')} | "
              f"{cell(row, 'dispatch_fp8_input_cached')} | {cell(row, 'combine')} | {nccl(row, 'combine')} |")
    for row in d.get("graph_rows", []):
        share = "" if row.get("copy_share") is None else f"{row['copy_share']:g}"
        for way, label in (("", "replayed, one call"), ("_queued", "replayed, 5 queued"),
                           ("_aligned", "replayed, started together")):
            if f"dispatch_bf16_graph{way}_ms" not in row:
                continue
            k = {op: f"{op}_graph{way}" for op in EP_OPS}
            print(f"| {row['transport']} | {share} | {row['comm_sms']} | {label} | {cell(row, k['dispatch_bf16'])} | "
                  f"{nccl(row, k['dispatch_bf16'])} | {cell(row, k['dispatch_fp8'])} | "
                  f"{cell(row, k['dispatch_fp8_input'])} | {cell(row, k['combine'])} | {nccl(row, k['combine'])} |")


def ep_figure(name="ep"):
    """bench/figures/ep.png from bench/results/ep.json: time against comm SMs per transport, eager and replayed
    from CUDA graphs, with NCCL all_to_all_single, the copy-engine ceiling and the EP issue's targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.loads((RESULTS / f"{name}.json").read_text())
    panels = [("dispatch_bf16", "dispatch BF16", "dispatch_bf16_cached_ms", 190),
              ("dispatch_fp8", "dispatch FP8 (quantization included)", "dispatch_fp8_cached_ms", 110),
              ("combine", "combine", "combine_ms", 200)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    for ax, (key, title, eager_key, target) in zip(axes, panels):
        for transport in dict.fromkeys(r["transport"] for r in d["rows"]):
            rows = [r for r in d["rows"] if r["transport"] == transport]
            ax.plot([r["comm_sms"] for r in rows], [r[eager_key] * 1e3 for r in rows], "o--", label=f"{transport} (eager)")
        graph_rows = d.get("graph_rows", [])

        def variant(r):  # rows of the default chunks (by SM count) form one line
            chunks = "default" if r.get("combine_chunks_by_sms") else tuple(r.get("combine_chunks") or ())
            return r["transport"], r.get("copy_share"), chunks

        variants = dict.fromkeys(variant(r) for r in graph_rows)
        for transport, share, chunks in variants:
            rows = [r for r in graph_rows if variant(r) == (transport, share, chunks)]
            label = f"{transport} (graph, {'uncached' if share is None else f'copy share {share:g}'}"
            if len({v[2] for v in variants if v[0] == transport}) > 1:
                label += ", chunks " + (chunks if chunks == "default" else ",".join(f"{f:g}" for f in chunks))
            label += ")"
            ax.plot([r["comm_sms"] for r in rows], [r[f"{key}_graph_ms"] * 1e3 for r in rows], "s-", label=label)
            if key == "dispatch_fp8" and all("dispatch_fp8_input_graph_ms" in r for r in rows):
                ax.plot([r["comm_sms"] for r in rows], [r["dispatch_fp8_input_graph_ms"] * 1e3 for r in rows], "^:",
                        color=ax.lines[-1].get_color(), label=f"{transport}: FP8 input, quantized before (graph)")
        if key == "dispatch_bf16":
            ax.axhline(d["nccl_all_to_all_ms"] * 1e3, color="gray", ls=":", label="NCCL all_to_all_single (all SMs)")
            ax.axhline(d["copy_engine_ms"] * 1e3, color="black", ls=":", label="copy-engine peer copy (ceiling)")
        ax.axhline(target, color="red", lw=0.8, label="EP issue's targets at <= 20 SMs" if key == "dispatch_bf16" else None)
        ax.set_title(title)
        ax.set_xlabel("comm SMs")
        ax.set_xticks(sorted({r["comm_sms"] for r in d["rows"]}))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("us (slower rank's median)")
    axes[0].set_ylim(0, 1000)
    legend = {}  # every panel's lines, each label once
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"EP dispatch/combine, DeepSeek-V3 shape, 2x {d['env'].get('gpu')} ({d['env']['date'][:16]})")
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    out = Path(__file__).resolve().parent / "figures" / f"{name}.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def ep_buffer(*names):
    """The eager Buffer table from bench/results/<name>.json files of `bench/ep_buffer.py` (each a labelled
    column set: ``label=name``, or the name alone), one row per backend and file."""
    keys = ["buffer_dispatch_bf16_ms", "buffer_dispatch_bf16_cached_ms", "buffer_dispatch_fp8_cached_ms",
            "buffer_dispatch_fp8_input_cached_ms", "buffer_combine_ms", "transport_dispatch_bf16_cached_ms",
            "transport_dispatch_fp8_cached_ms", "transport_combine_ms"]
    runs = [(n.split("=", 1) if "=" in n else (n, n)) for n in (names or ["ep_buffer"])]
    print("| backend | code, round | Buffer dispatch BF16 (us) | cached BF16 | cached FP8 (quantized in it) | cached FP8 "
          "input | Buffer combine | transport dispatch BF16, cached | transport FP8, cached | transport combine |")
    print("|---|---|" + "---|" * len(keys))
    loaded = [(label, json.loads((RESULTS / f"{name}.json").read_text())) for label, name in runs]
    for backend in dict.fromkeys(r["backend"] for _, d in loaded for r in d["rows"]):
        for label, d in loaded:
            for r in d["rows"]:
                if r["backend"] == backend:
                    print(f"| {backend} | {label} | " + " | ".join(f"{r[k] * 1e3:.0f}" for k in keys) + " |")


def _schedule_name(name):
    return name.replace(".", " ", 1)  # "torch.Schedule1F1B" -> "torch Schedule1F1B"


def _diff(x):
    """A checked max |difference| / max |reference|; null in a result file is an infinite one (a missing result,
    or a NaN in it)."""
    return "inf" if x is None else f"{x:.1e}"


def _pipeline_check(check):
    """A `bench/pipeline.py` schedule's check (its "check" entry) as a table cell."""
    verdict = "equal" if check["equals_reference"] else "DIFFER"
    return f"{verdict} (loss {_diff(check['loss_max_rel_diff'])}, gradients {_diff(check['grad_max_rel_diff'])})"


def pipeline(*names):
    """BENCHMARKS §3 from bench/results/<name>.json files of `bench/pipeline.py` (default: pipeline and
    pipeline_run2, the section's two runs): the first run's schedules (every one in the file; with the checked
    step's max |diff| / max |reference| where the run checked them), the others' step times, and the DualPipeV
    bubble of each run."""
    runs = [json.loads((RESULTS / f"{name}.json").read_text()) for name in names or ("pipeline", "pipeline_run2")]
    d = runs[0]
    print(f"Measured: {env_line(d)}\n")
    checked = any("check" in e for e in d["schedules"].values())
    print("| schedule | step (ms) | per rank (ms) | tokens/s | peak memory per rank (GiB) |"
          + (" losses, gradients vs one process |" if checked else ""))
    print("|---|---|---|---|---|" + ("---|" if checked else ""))
    for name, e in d["schedules"].items():
        cells = ([f"{e['median_ms']:.1f}", ", ".join(f"{t:.1f}" for t in e["median_ms_per_rank"]),
                  f"{e['tokens_per_s']:.0f}", ", ".join(_num(m, ".2f") for m in e["peak_memory_gib_per_rank"])]
                 if "median_ms" in e else [e.get("skipped") or f"error: {e.get('error')}", "", "", ""])
        if checked:
            cells.append(_pipeline_check(e["check"]) if "check" in e else "")
        print(f"| {_schedule_name(name)} | " + " | ".join(cells) + " |")
    for i, run in enumerate(runs[1:], 2):
        print(f"\nRun {i} ({run['date']}): " + "; ".join(
            f"{_schedule_name(name)} " + (f"{e['median_ms']:.1f} ms" if "median_ms" in e else "n/a")
            for name, e in run["schedules"].items()) + ".")
    ranks = len(d["dualpipev_timeline"]["measured_bubble_in_schedule_ms"])
    print(f"\n| run | measured bubble, rank {' / '.join(map(str, range(ranks)))} (ms) | predicted (ms) | "
          "measured / predicted | previous model (ms) |")
    print("|---|---|---|---|---|")
    for i, run in enumerate(runs, 1):
        t = run["dualpipev_timeline"]
        previous = t["predictions"].get("previous: inputs, Bi = B - W", {}).get("bubble_ms_per_rank")

        def per_rank(xs):
            return " / ".join(_num(x, ".2f") for x in xs) if xs else "n/a"

        print(f"| {i} | {per_rank(t['measured_bubble_in_schedule_ms'])} | {per_rank(t['predicted']['bubble_ms_per_rank'])} | "
              f"{per_rank(t['predicted']['measured_over_predicted'])} | {per_rank(previous)} |")


def moe_overlap(*names):
    """BENCHMARKS §4 from bench/results/<name>.json files of `bench/moe_overlap.py` (default: moe_overlap and
    moe_overlap_transports, the section's two runs), one table each: a transport column where the file has more
    than one transport, and the check of the overlapped step against the serial one where the run made it."""
    for name in names or ("moe_overlap", "moe_overlap_transports"):
        d = json.loads((RESULTS / f"{name}.json").read_text())
        rows = d["rows"]
        several = len({r["transport"] for r in rows}) > 1
        checked = any("overlapped_equals_serial" in r for r in rows)
        print(f"Measured ({name}.json): {env_line(d)}\n")
        print(("| transport " if several else "") + "| comm SMs | serial (ms) | exposed | overlapped (ms) | exposed | "
              "speed-up |" + (" overlapped = serial (max rel diff) |" if checked else ""))
        print(("|---" if several else "") + "|---|---|---|---|---|---|" + ("---|" if checked else ""))
        for r in rows:
            if "error" in r:
                cells = [f"error: {r['error']}", "", "", "", ""]
            else:
                s, o = r["serial"], r["overlapped"]
                cells = [f"{s['ms']:.2f}", f"{100 * s['exposed_fraction']:.1f}%", f"{o['ms']:.2f}",
                         f"{100 * o['exposed_fraction']:.1f}%", f"{r['speedup']:.2f}x"]
            if checked:
                cells.append(("yes" if r["overlapped_equals_serial"] else "NO")
                             + f" ({_diff(r['check']['max_rel_diff'])})" if "check" in r else "")
            print(("| " + r["transport"] + " " if several else "") + f"| {r['comm_sms']} | " + " | ".join(cells) + " |")
        best = d.get("best") or {}
        if "transport" in best:
            print(f"\n`autotune_split` picked {best['transport']} with {best['comm_sms']} comm SMs.")
        print()


if __name__ == "__main__":
    {"sm_split": sm_split, "ep": ep, "ep-rates": ep_rates, "ep-figure": ep_figure, "ep-buffer": ep_buffer,
     "pipeline": pipeline, "moe-overlap": moe_overlap}[sys.argv[1]](*sys.argv[2:])
