"""BENCHMARKS.md from bench/results/<script>.json: every table and every figure in its text is printed from the
stored result of the script that measured it.

    python bench/tables.py benchmarks > BENCHMARKS.md     # the whole page
    python bench/tables.py sm_split | ep | ep-buffer | pipeline | moe-overlap   # one section
    python bench/tables.py ep-rates                        # every EP time as GB/s and shares of the baselines
    python bench/tables.py ep-figure                       # bench/figures/ep.png from bench/results/ep.json

A field that an older result file lacks is printed "not recorded" (never filled in from elsewhere); a figure the
run recorded as not measured (null) is printed "n/a". DeepEP's figures were not measured by these scripts: they are
quoted from the project's design notes (the same 2x H200 machine, measured apart) and marked so.
"""

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
NOT_RECORDED = "not recorded"

# DeepEP V1 intranode, EP2, 4096 tokens, hidden 7168, top-8 of 256, eager calls on 2x H200 (NV18), us by comm SMs:
# quoted from the project's design notes, measured apart from bench/ (not by these scripts).
DEEPEP_QUOTED_US = {"dispatch_bf16": {20: 404, 24: 320}, "dispatch_fp8_input": {20: 285, 24: 241},
                    "combine": {20: 442, 24: 396}}
DEEPEP_SOURCE = "quoted from the design notes, measured apart"

# The machines the 2-GPU results were measured on are not lent now: each such section says so.
TWO_GPU_PENDING = "re-run on a 2-GPU machine pending"


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _num(x, spec):
    """``x`` formatted, "n/a" for a figure that was not measured (None, or NaN in older results)."""
    return format(x, spec) if x is not None and x == x else "n/a"


def cell(d: dict, key: str, spec: str = ".1f", scale: float = 1.0) -> str:
    """``d[key] * scale`` formatted; "not recorded" where the result has no such field, "n/a" where it is null."""
    if key not in d:
        return NOT_RECORDED
    x = d[key]
    return _num(None if x is None else x * scale, spec)


def cells(d: dict, keys, spec: str = ".1f", scale: float = 1.0) -> str:
    """Several `cell`s joined by " / "; "not recorded" once where the result has none of them."""
    if not any(k in d for k in keys):
        return NOT_RECORDED
    return " / ".join(cell(d, k, spec, scale) for k in keys)


def env_of(d: dict) -> dict:
    return d.get("env", d)  # bench/pipeline.py and bench/moe_overlap.py keep the environment at the top level


def env_line(env):
    return (f"{env.get('gpu', NOT_RECORDED)} x{env.get('gpu_count', '?')}, driver {env.get('driver', NOT_RECORDED)}, "
            f"torch {env.get('torch', NOT_RECORDED)}, triton {env.get('triton', NOT_RECORDED)}, "
            f"{env.get('date', NOT_RECORDED)}; command: `{env.get('command', NOT_RECORDED)}`")


def machine(d: dict, gpus_used: int) -> str:
    """The "Machine / Command" lines above a section's table."""
    env = env_of(d)
    gpu, count, date = env.get("gpu", NOT_RECORDED), env.get("gpu_count"), env.get("date", NOT_RECORDED)
    where = f"{gpu} x{count}" if count else gpu
    if gpus_used == 1 and count and count > 1:
        where += " (the benchmark uses one GPU)"
    pending = f"; {TWO_GPU_PENDING}" if gpus_used > 1 else ""
    return (f"Machine: {where}, driver {env.get('driver', NOT_RECORDED)}, torch {env.get('torch', NOT_RECORDED)}, "
            f"Triton {env.get('triton', NOT_RECORDED)}; measured {date}{pending}.  \n"
            f"Command: `{env.get('command', NOT_RECORDED)}` (result: `bench/results/{d['_name']}.json`)\n")


def _load_named(name):
    d = load(name)
    d["_name"] = name
    return d


def _load_optional(name):
    """The result file ``name`` where it exists, else None (a check that is not run on every machine)."""
    return _load_named(name) if (RESULTS / f"{name}.json").exists() else None


def _span(xs, spec=".3f"):
    xs = [x for x in xs if x is not None and x == x]
    return f"{min(xs):{spec}}-{max(xs):{spec}}" if xs else "n/a"


# ----------------------------------------------------------------------------------------------------- SM budget


def sm_split(name="sm_split"):
    """The SM-budget section: `bench/sm_split.py`'s rows (medians over the rounds of an ``--interleave`` run, a single
    round's figures otherwise), the full-GPU GEMM as the ceiling."""
    d = _load_named(name)
    rows = d["rows"]
    inter = bool(d.get("interleave"))
    med = "_median" if inter else ""
    print("## SM budget\n")
    print(machine(d, 1))
    print("A copy kernel (`smsplit.copy.sm_copy`, one persistent program per comm SM) runs on the comm budget while a "
          f"{d.get('gemm_n', '?')}^3 bf16 GEMM (cuBLAS) runs on the compute budget. \"kept\" is concurrent over alone on "
          "the same budget" + (f", the median of {d['interleave']} interleaved rounds (min-max)" if inter else "")
          + "; copy GB/s count bytes read plus written; \"SMs shared\" comes from the SM-by-time trace of one round "
          "(every copy program's `%smid`, probes on the GEMM's stream).\n")
    print("| mode | copy | comm SMs asked → granted | compute SMs | GEMM alone (TFLOP/s) | GEMM concurrent | kept | "
          "copy alone (GB/s) | copy concurrent | kept | SMs shared (trace) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def kept(r, side):
        if not inter:
            return cell(r, f"{side}_kept", ".3f")
        return (f"{cell(r, f'{side}_kept_median', '.3f')} ({cell(r, f'{side}_kept_min', '.3f')}–"
                f"{cell(r, f'{side}_kept_max', '.3f')})")

    for r in rows:
        mode = r["mode"] + (" + L2 evict-first" if r.get("evict_first") else "")
        shared = str(r["trace_shared_sm_count"]) if "trace_shared_sm_count" in r else ""
        print(f"| {mode} | {r.get('copy_method', NOT_RECORDED)} | {r['requested_comm_sms']} → {r['comm_sms']} | "
              f"{r['compute_sms']} | {cell(r, 'gemm_alone_tflops' + med, '.0f')} | "
              f"{cell(r, 'gemm_concurrent_tflops' + med, '.0f')} | {kept(r, 'gemm')} | "
              f"{cell(r, 'copy_alone_gbps' + med, '.0f')} | {cell(r, 'copy_concurrent_gbps' + med, '.0f')} | "
              f"{kept(r, 'copy')} | {shared} |")
    full = d.get("gemm_full_gpu") or {}
    print(f"\nCeiling, same run: the GEMM on the full GPU {cell(full, 'tflops', '.0f')} TFLOP/s (median of "
          f"{full.get('n', '?')}).\n")
    key = "_kept_median" if inter else "_kept"
    green_tma = [r for r in rows if r["mode"] == "green" and not r.get("evict_first") and r.get("copy_method") == "tma"]
    green = [r for r in rows if r["mode"] == "green"]
    grid = [r for r in rows if r["mode"] == "grid"]
    shared_green = sorted({r["trace_shared_sm_count"] for r in green if "trace_shared_sm_count" in r})
    shared_grid = sorted({r["trace_shared_sm_count"] for r in grid if "trace_shared_sm_count" in r})
    best = green_tma or green
    print(f"In green mode (two complementary green contexts) the traced rounds share "
          f"{' / '.join(map(str, shared_green)) or 'n/a'} SMs between comm and compute; with the "
          f"{'TMA' if green_tma else best[0].get('copy_method', '')} copy the copy keeps "
          f"{_span([r.get('copy' + key) for r in best])} of its bandwidth and the GEMM "
          f"{_span([r.get('gemm' + key) for r in best])} of its own. Without a partition (grid mode) the copy's "
          f"programs share {' / '.join(map(str, shared_grid)) or 'n/a'} SMs with the GEMM's blocks and keep only "
          f"{_span([r.get('copy' + key) for r in grid])} of their bandwidth: the case green contexts exist for. The "
          "SMs are isolated, HBM bandwidth and power are not, so \"kept\" can dip below 1 in green mode too.\n")


# ------------------------------------------------------------------------------------------- EP dispatch/combine

_WAYS = ("", "_queued", "_aligned")  # one call / 5 queued / started together
EP_TABLE_OPS = [("dispatch_bf16", "BF16 dispatch (cached layout)", "dispatch_bf16_cached_ms"),
                ("dispatch_fp8", "FP8 dispatch, quantized in it", "dispatch_fp8_cached_ms"),
                ("dispatch_fp8_input", "FP8 dispatch of FP8 input (DeepEP's FP8 condition)", "dispatch_fp8_input_cached_ms"),
                ("combine", "combine (BF16)", "combine_ms"),
                ("combine_weighted", "combine summing top-k weights", "combine_weighted_ms")]
_NCCL = ("nccl_all_to_all_ms", "nccl_all_to_all_queued_ms", "nccl_all_to_all_aligned_ms")
_CEILING = ("copy_engine_ms", "copy_engine_queued_ms", "copy_engine_aligned_ms")


def _at(rows, transport, sms):
    found = [r for r in rows if r.get("transport", "nvlink") == transport and r["comm_sms"] == sms]
    return found[0] if found else None


def ep(name="ep", comm_sms="20"):
    """The EP section: one table at ``comm_sms`` comm SMs with the transports, NCCL and the copy-engine ceiling of
    the same run and DeepEP's quoted figures; the concurrent GEMM and host time lines; the figure."""
    sms = int(comm_sms)
    d = _load_named(name)
    graph_rows = d.get("graph_rows", [])
    print("## EP dispatch and combine\n")
    print(machine(d, 2))
    shape = d.get("shape", {})
    print(f"DeepSeek-V3 shape per rank: {shape.get('tokens')} tokens, hidden {shape.get('hidden')}, "
          f"{shape.get('experts')} experts, top-{shape.get('topk')}, uniform random routing; rank 0 receives "
          f"{d.get('num_recv')} rows, {d.get('recv_from_peers')} of them over NVLink. At {sms} comm SMs, in us, the "
          "slower rank's median; replayed from CUDA graphs each cell is one call / 5 queued / started together "
          "(after a device-side barrier, on the GPU clock); `nvlink_copy_engine` replays a cached layout, `nvlink` "
          "exchanges the layout on the device inside each call; `copy_engine` is not captured, its cells are eager "
          "calls (one call). NCCL and the copy-engine peer copy of the bytes that cross NVLink (the ceiling, no SM) "
          "were timed the same three ways in the same run.\n")
    print(f"| operation | `nvlink_copy_engine`, replayed | `nvlink`, replayed | `copy_engine`, eager | NCCL "
          f"`all_to_all_single` (all SMs) | copy-engine peer copy (ceiling) | DeepEP, {sms} SMs ({DEEPEP_SOURCE}) |")
    print("|---|---|---|---|---|---|---|")
    eager_ce = _at(d["rows"], "copy_engine", sms) or {}
    for op, label, eager_key in EP_TABLE_OPS:
        graph = [cells(_at(graph_rows, t, sms) or {}, [f"{op}_graph{w}_ms" for w in _WAYS], scale=1e3)
                 for t in ("nvlink_copy_engine", "nvlink")]
        same_bytes = op in ("dispatch_bf16", "combine")  # NCCL and the ceiling moved these BF16 rows
        base = [cells(d, _NCCL, scale=1e3), cells(d, _CEILING, scale=1e3)] if same_bytes else ["—", "—"]
        deepep = DEEPEP_QUOTED_US.get(op, {}).get(sms)
        print(f"| {label} | {graph[0]} | {graph[1]} | {cell(eager_ce, eager_key, '.1f', 1e3)} | {base[0]} | {base[1]} | "
              f"{deepep if deepep is not None else '—'} |")
    print()
    conc = d.get("concurrent", [])
    if conc:
        c0 = conc[0]
        print(f"Beside a GEMM 8192^3 on the other {c0.get('compute_sms')} SMs (green, {c0.get('asked')} comm SMs asked, "
              f"{c0.get('comm_sms')} granted; FP8 dispatch + combine; median of {len(c0.get('rounds', [])) or '?'} "
              "interleaved rounds of GEMM alone, comm alone, both) the GEMM took longer by "
              + ", ".join(f"{cell(c, 'gemm_slowdown', '+.1%')} (`{c.get('transport', 'nvlink')}`)"
                          for c in conc) + ". ", end="")
    host = [r for r in d["rows"] if r["comm_sms"] == sms]
    if host:
        print(f"Host time of one eager call at {sms} SMs (Python and launches), dispatch / combine: "
              + ", ".join(f"{cells(r, ['dispatch_bf16_host_us', 'combine_host_us'], '.0f')} us "
                          f"(`{r.get('transport', 'nvlink')}`)" for r in host) + ".\n")
    else:
        print()
    nce = _at(graph_rows, "nvlink_copy_engine", sms) or {}
    a = lambda k: nce.get(k)  # noqa: E731
    if nce and all(d.get(k) for k in _NCCL + _CEILING):
        bf16, comb = a("dispatch_bf16_graph_aligned_ms"), a("combine_graph_aligned_ms")
        fp8in = a("dispatch_fp8_input_graph_aligned_ms")
        nbytes = ep_bytes(d)["dispatch_bf16"]["nvlink"]
        q = {op: DEEPEP_QUOTED_US[op].get(sms) for op in DEEPEP_QUOTED_US}
        print(f"Started together at {sms} SMs, `nvlink_copy_engine` moves the BF16 dispatch in {bf16 * 1e3:.1f} us, "
              f"{d['nccl_all_to_all_aligned_ms'] / bf16:.2f} times faster than NCCL's all-to-all of the same rows on "
              f"every SM and at {nbytes / bf16 / 1e6:.0f} GB/s over NVLink, "
              f"{d['copy_engine_aligned_ms'] / bf16:.2f} of the rate of the copy engine's bare peer copy; the combine takes "
              f"{comb * 1e3:.1f} us ({d['nccl_all_to_all_aligned_ms'] / comb:.2f}x NCCL). "
              + (f"DeepEP's eager figures at {sms} SMs ({q['dispatch_bf16']} / {q['dispatch_fp8_input']} / "
                 f"{q['combine']} us) were measured apart and are quoted, not re-measured; replayed, FP8 input takes "
                 f"{fp8in * 1e3:.1f} us here, {q['dispatch_fp8_input'] / (fp8in * 1e3):.1f} times less, while eager "
                 "calls through `Buffer` add the host work of the next section. " if all(q.values()) else "")
              + "The figure draws every comm SM count of the same run (`python bench/tables.py ep-figure`).\n")
    print("![EP dispatch and combine by comm SMs](bench/figures/ep.png)\n")


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


# ------------------------------------------------------------------------------------------- eager Buffer calls

EP_BUFFER_OPS = [("BF16 dispatch, cached layout", "dispatch_bf16_cached", "dispatch_bf16_cached", "dispatch_bf16"),
                 ("FP8 dispatch, quantized in it, cached", "dispatch_fp8_cached", "dispatch_fp8_cached", None),
                 ("FP8 dispatch of FP8 input, cached", "dispatch_fp8_input_cached", "dispatch_fp8_input_cached",
                  "dispatch_fp8_input"),
                 ("combine", "combine", "combine", "combine"),
                 ("BF16 dispatch, layout exchanged (uncached)", "dispatch_bf16", "dispatch_bf16", None)]


def ep_buffer(name="ep_buffer"):
    """The eager-Buffer section: each call through `smsplit.ep.Buffer` and, in the same run, the transport call
    alone, one call at a time and queued back to back, beside DeepEP's quoted eager figures."""
    d = _load_named(name)
    args = d.get("args", {})
    backends = list(dict.fromkeys(r["backend"] for r in d["rows"]))
    sms = sorted({r["comm_sms"] for r in d["rows"]})
    print("## Eager Buffer calls\n")
    print(machine(d, args.get("world", 2)))
    print("What a user's eager call costs: `Buffer.dispatch` / `Buffer.combine` check their arguments on every rank "
          "(a header exchanged with every rank before any token moves), make the transport call, and copy the "
          "received rows out of the transport's buffer. DeepSeek-V3 shape, "
          f"{' / '.join(map(str, sms))} comm SMs, us, the slower rank's median; each cell is one call between two "
          f"CUDA events after a barrier / {args.get('queued', NOT_RECORDED)} calls queued back to back between two "
          "events, divided (as DeepEP's benchmark times its calls).\n")
    head = "| call | " + " | ".join(f"`{b}` Buffer | `{b}` transport alone" for b in backends)
    q = sms[0] if len(sms) == 1 else None
    print(head + f" | DeepEP{f', {q} SMs' if q else ''} ({DEEPEP_SOURCE}) |")
    print("|---|" + "---|---|" * len(backends) + "---|")
    for label, buf, tr, deepep_op in EP_BUFFER_OPS:
        out = []
        for b in backends:
            r = next(r for r in d["rows"] if r["backend"] == b)
            out.append(cells(r, [f"buffer_{buf}_ms", f"buffer_{buf}_queued_ms"], ".0f", 1e3))
            out.append(cells(r, [f"transport_{tr}_ms", f"transport_{tr}_queued_ms"], ".0f", 1e3))
        deepep = DEEPEP_QUOTED_US.get(deepep_op, {}).get(q) if deepep_op else None
        print(f"| {label} | " + " | ".join(out) + f" | {deepep if deepep is not None else '—'} |")
    print()
    nv = next((r for r in d["rows"] if r["backend"] == "nvlink"), None)
    if nv and q in DEEPEP_QUOTED_US["dispatch_bf16"] and "buffer_combine_queued_ms" in nv:
        print(f"Queued, `nvlink`'s cached BF16 dispatch through the Buffer takes "
              f"{nv['buffer_dispatch_bf16_cached_queued_ms'] * 1e3:.0f} us and its combine "
              f"{nv['buffer_combine_queued_ms'] * 1e3:.0f} us, against DeepEP's {DEEPEP_QUOTED_US['dispatch_bf16'][q]} "
              f"/ {DEEPEP_QUOTED_US['combine'][q]} us for its eager calls (quoted); the transport calls alone take "
              f"{nv['transport_dispatch_bf16_cached_queued_ms'] * 1e3:.0f} / {nv['transport_combine_queued_ms'] * 1e3:.0f}"
              " us. One call at a time, the header exchange and the copies out add a host round trip to every call, "
              "so eager calls do not reach the transport's speed; replayed from CUDA graphs (previous section) no "
              "host work is left. Eager timings move by up to 2x between machine leases; the code's host path has "
              "changed since this run (measured at one rank only).\n")


# ------------------------------------------------------------------------------------------------ pipeline


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


def pipeline(name="pipeline"):
    """The pipeline section from `bench/pipeline.py`'s result: every schedule (with the checked step's max |diff| /
    max |reference| where the run checked them) and the DualPipeV bubble, measured and simulated."""
    d = _load_named(name)
    cfg = d.get("config", {})
    print("## Pipeline schedules\n")
    print(machine(d, 2))
    print(f"A stack of transformer blocks (hidden {cfg.get('hidden', NOT_RECORDED)}, {cfg.get('heads', NOT_RECORDED)} "
          f"heads, {cfg.get('blocks_per_stage', NOT_RECORDED)} blocks per stage, {cfg.get('stages', NOT_RECORDED)} "
          f"stages, {cfg.get('dtype', NOT_RECORDED)}), {cfg.get('chunks', NOT_RECORDED)} micro-batches of "
          f"{cfg.get('micro_batch', NOT_RECORDED)} x {cfg.get('seq', NOT_RECORDED)} tokens per step, the same model "
          f"and data for every schedule; step time is the slower rank's median over {cfg.get('steps', NOT_RECORDED)} "
          f"steps after {cfg.get('warmup', NOT_RECORDED)} warm-up steps.\n")
    checked = any("check" in e for e in d["schedules"].values())
    print("| schedule | step (ms) | per rank (ms) | tokens/s | peak memory per rank (GiB) |"
          + (" losses, gradients vs one process |" if checked else ""))
    print("|---|---|---|---|---|" + ("---|" if checked else ""))
    for sname, e in d["schedules"].items():
        row = ([f"{e['median_ms']:.1f}", ", ".join(f"{t:.1f}" for t in e["median_ms_per_rank"]),
                f"{e['tokens_per_s']:.0f}", ", ".join(_num(m, ".2f") for m in e["peak_memory_gib_per_rank"])]
               if "median_ms" in e else [e.get("skipped") or f"error: {e.get('error')}", "", "", ""])
        if checked:
            row.append(_pipeline_check(e["check"]) if "check" in e else NOT_RECORDED if "median_ms" in e else "")
        print(f"| {_schedule_name(sname)} | " + " | ".join(row) + " |")
    print()
    ours = d["schedules"].get("smsplit.DualPipeV", {})
    torch_best = [(e["median_ms"], n) for n, e in d["schedules"].items() if n.startswith("torch.") and "median_ms" in e]
    if "median_ms" in ours and torch_best:
        ms, n = min(torch_best)
        print(f"smsplit's DualPipeV step is {100 * (1 - ours['median_ms'] / ms):.1f}% shorter than the fastest of "
              f"torch's schedules on the same work ({_schedule_name(n)}, {ms:.1f} ms). ", end="")
    t = d.get("dualpipev_timeline")
    if t:
        per = lambda xs: " / ".join(_num(x, ".2f") for x in xs) if xs else "n/a"  # noqa: E731
        print(f"Its bubble, from CUDA events around every op of one more step: measured "
              f"{per(t['measured_bubble_in_schedule_ms'])} ms on ranks "
              f"{' / '.join(map(str, range(len(t['measured_bubble_in_schedule_ms']))))}, predicted "
              f"{per(t['predicted']['bubble_ms_per_rank'])} ms by `simulate(\"dualpipev\", ..., sync=\"batches\")` fed the "
              f"measured op times (measured / predicted {per(t['predicted']['measured_over_predicted'])}); each batch "
              "of point-to-point messages is one NCCL rendezvous, which the simulator models. "
              "`python bench/pipeline.py --reanalyse bench/results/pipeline.json` redoes the analysis on a CPU.\n")
    print("| measured | simulated from the measured op times |\n|---|---|\n"
          "| ![measured](bench/figures/pipeline_measured.png) | ![simulated](bench/figures/pipeline_simulated.png) |\n")


# --------------------------------------------------------------------------------------------------- MoE overlap


def moe_overlap(name="moe_overlap"):
    """The MoE-overlap section from `bench/moe_overlap.py`'s result: serial against overlapped forward + backward,
    a transport column where the file has more than one transport, and the check of the overlapped step against
    the serial one where the run made it."""
    d = _load_named(name)
    rows = d["rows"]
    shape = d.get("shape", {})
    several = len({r["transport"] for r in rows}) > 1
    checked = any("overlapped_equals_serial" in r for r in rows)
    print("## MoE overlap\n")
    print(machine(d, d.get("world", 2)))
    print(f"One block at DeepSeek-V3 width (hidden {shape.get('dim', NOT_RECORDED)}, expert intermediate "
          f"{shape.get('inter_dim', NOT_RECORDED)}, {shape.get('n_experts', NOT_RECORDED)} routed experts, top-"
          f"{shape.get('topk', NOT_RECORDED)}, {shape.get('tokens', NOT_RECORDED)} tokens per micro-batch per rank), "
          "forward of one micro-batch and backward of another, serial or overlapped in the DeepSeek-V3 order; "
          "communication on the green comm stream, compute on the compute stream. \"exposed\" is the share of the "
          "step in which communication ran and no compute did.\n")
    print(("| transport " if several else "") + "| comm SMs | serial (ms) | exposed | overlapped (ms) | exposed | "
          "speed-up |" + (" overlapped = serial (max rel diff) |" if checked else ""))
    print(("|---" if several else "") + "|---|---|---|---|---|---|" + ("---|" if checked else ""))
    for r in rows:
        if "error" in r:
            row = [f"error: {r['error']}", "", "", "", ""]
        else:
            s, o = r["serial"], r["overlapped"]
            row = [f"{s['ms']:.2f}", cell(s, "exposed_fraction", ".1%"), f"{o['ms']:.2f}",
                   cell(o, "exposed_fraction", ".1%"), f"{r['speedup']:.2f}x"]
        if checked:
            row.append(("yes" if r["overlapped_equals_serial"] else "NO")
                       + f" ({_diff(r['check']['max_rel_diff'])})" if "check" in r
                       else "" if "error" in r else NOT_RECORDED)
        print(("| " + r["transport"] + " " if several else "") + f"| {r['comm_sms']} | " + " | ".join(row) + " |")
    best = d.get("best") or {}
    if "transport" in best:
        print(f"\n`autotune_split` picked {best['transport']} with {best['comm_sms']} comm SMs.")
    print()
    ok = [r for r in rows if "error" not in r]
    if ok:
        print(f"The overlapped step is {_span([r['speedup'] for r in ok], '.2f')}x faster than the serial one; the "
              "faster transports leave less communication to hide, so their overlapped step is bound by compute. "
              "\"exposed\" counts a compute piece from its start event, recorded after every wait its stream needs, "
              "to its end event. The SM trace once drawn beside this table showed communication running alone for "
              "about 11 ms: it covered the untimed serial forward before the step too, not the step the table "
              "measures (docs/design-notes.md). These 2-GPU figures wait for a re-run with the corrected trace.\n")
    check = _load_optional(f"{name}_1ranks")
    if check:
        best = check.get("best") or {}
        print(f"Figure and table checked on one GPU ({check.get('gpu', NOT_RECORDED)}, {check.get('date', NOT_RECORDED)[:10]}; "
              f"`{check.get('command', NOT_RECORDED)}`, result `bench/results/{name}_1ranks.json`): the traced step "
              f"took {_num(best.get('traced_step_ms'), '.1f')} ms, exposed "
              f"{cell(best, 'traced_step_exposed_fraction', '.1%')} from the piece events and "
              f"{cell(best, 'trace_exposed_fraction', '.1%')} from the SM trace's records "
              f"([figure](bench/figures/{name}_trace_1ranks.png)).\n")


# ------------------------------------------------------------------------------------------------- the page


def benchmarks():
    """BENCHMARKS.md: every section, printed from its script's result file."""
    print("# Benchmarks\n")
    print("Every table and every figure in its text below is printed from the result file of the script that measured "
          "it (`python bench/tables.py benchmarks > BENCHMARKS.md`); [bench/README.md](bench/README.md) lists each "
          "claim's script, exact command, machine and result file. Times are CUDA-event medians after warm-up on "
          "random inputs unless a section says otherwise. DeepEP's figures were not measured by these scripts: they "
          "are quoted from the project's design notes (same 2x H200 machine, measured apart) in columns of their own. "
          "Decisions and negative results behind these designs: [docs/design-notes.md](docs/design-notes.md).\n")
    for section in (sm_split, ep, ep_buffer, pipeline, moe_overlap):
        section()


SECTIONS = {"benchmarks": benchmarks, "sm_split": sm_split, "ep": ep, "ep-buffer": ep_buffer, "pipeline": pipeline,
            "moe-overlap": moe_overlap, "ep-rates": ep_rates, "ep-figure": ep_figure}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in SECTIONS:
        sys.exit(f"usage: python bench/tables.py {{{'|'.join(SECTIONS)}}} [result name]")
    SECTIONS[sys.argv[1]](*sys.argv[2:])
