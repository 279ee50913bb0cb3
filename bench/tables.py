"""Print the BENCHMARKS.md tables from bench/results/*.json (so the tables are the measured numbers)."""

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


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
              f"{r['gemm_alone_tflops']:.0f} | {r['gemm_concurrent_tflops']:.0f} | {r['gemm_kept']:.3f} | "
              f"{r['copy_alone_gbps']:.0f} | {r['copy_concurrent_gbps']:.0f} | {r['copy_kept']:.3f} | {shared} |")


def sm_split_interleaved(d):
    """Rows of a ``--interleave K`` run: medians over the K rounds of each round's own figures, and the
    rounds' kept range."""
    def num(x, spec):
        return format(x, spec) if x is not None else "n/a"

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
                 if "rounds" in c else ""))


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


if __name__ == "__main__":
    {"sm_split": sm_split, "ep": ep, "ep-figure": ep_figure, "ep-buffer": ep_buffer}[sys.argv[1]](*sys.argv[2:])
