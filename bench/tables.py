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
          f"({d['copy_engine_gbps']:.0f} GB/s).\n")
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
        print("| transport | copy share | comm SMs | dispatch BF16 (us) | dispatch FP8 (us) | combine (us) |")
        print("|---|---|---|---|---|---|")
        for r in graph_rows:
            share = "" if r.get("copy_share") is None else f"{r['copy_share']:g}"
            print(f"| {r['transport']} | {share} | {r['comm_sms']} | {r['dispatch_bf16_graph_ms'] * 1e3:.0f} | "
                  f"{r['dispatch_fp8_graph_ms'] * 1e3:.0f} | {r['combine_graph_ms'] * 1e3:.0f} |")
        print()
    print("| programs | SM copy write to peer (GB/s) | SM copy read from peer (GB/s) |")
    print("|---|---|---|")
    for r in d.get("sm_copy_over_nvlink", []):
        print(f"| {r['programs']} | {r['write_gbps']:.0f} | {r['read_gbps']:.0f} |")
    for c in d.get("concurrent", []):
        print(f"\n{c.get('transport', 'nvlink')}, concurrent (green, asked {c['asked']} → {c['comm_sms']} comm SMs, {c['compute_sms']} compute SMs): "
              f"GEMM 8192^3 {c['gemm_full_gpu_ms']:.3f} ms on the full GPU, {c['gemm_alone_on_budget_ms']:.3f} ms alone "
              f"on its budget, {c['gemm_concurrent_ms']:.3f} ms beside FP8 dispatch + combine; dispatch + combine "
              f"{c['comm_alone_ms'] * 1e3:.0f} us alone, {c['comm_concurrent_ms'] * 1e3:.0f} us beside the GEMM.")


if __name__ == "__main__":
    {"sm_split": sm_split, "ep": ep}[sys.argv[1]](*sys.argv[2:])
