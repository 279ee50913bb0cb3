"""The FP8 staging launch of the NVLink dispatch on one GPU: what limits an FP8 dispatch with ``bulk="copy_engine"``.

``dispatch_kernel`` with STAGE (no SYNC) reads each token's bf16 row, quantizes it to e4m3 (one fp32 scale per 128)
and stores it to this rank's receive rows and to the staging rows of its peer, with top-k, weights, source index and
scales. Here both "ranks" are this GPU (the peer's base address is this rank's buffer), so the launch runs alone, with
no peer, on ``--programs`` programs (4096 tokens x 7168, top-8 of 256 experts over 2 ranks, DeepSeek-V3 shape).
Against, on the same programs: the same launch without quantization (bf16 rows staged), and a plain SM copy of x
(``smsplit.copy.sm_copy``: the rate the programs move bytes at).

    PYTHONPATH=src python3 bench/fp8_stage.py --programs 20
    PYTHONPATH=src python3 bench/fp8_stage.py --programs 20 --peer-only   # each row written once
    ncu -k regex:dispatch_kernel --launch-skip 3 --launch-count 1 python3 bench/fp8_stage.py --once

Writes bench/results/fp8_stage.json (not with --once).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, time_ms, write_result  # noqa: E402


def setup(T, H, E, K, R=2, peer_only=False):
    from smsplit.ep import nvlink
    from smsplit.ep.layout import region_offsets, token_positions

    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(dev)
    weights = torch.rand(T, K, generator=g).to(dev)
    num_local = E // R
    in_rank = torch.stack([((topk >= r * num_local) & (topk < (r + 1) * num_local)).any(1) for r in range(R)], 1)
    if peer_only:  # no token stays here: each quantized row is written once, to the staging rows
        in_rank[:, 0] = False
    offsets, total = region_offsets(nvlink._region_bytes(R, T, H, K), nvlink.ALIGN)  # NvlinkTransport's layout
    buf = torch.zeros(total, dtype=torch.uint8, device=dev)
    layout = torch.zeros(2 * R + 2, dtype=torch.int32, device=dev)
    layout[1] = T  # the "peer's" rows start after this rank's own
    return dict(x=x, topk=topk, weights=weights, pos=token_positions(in_rank), layout=layout, buf=buf,
                bases=torch.tensor([buf.data_ptr()] * R, dtype=torch.int64, device=dev),
                state=torch.zeros(nvlink.STATE_WORDS, dtype=torch.int32, device=dev),
                status=torch.zeros(4, dtype=torch.int32, pin_memory=True), copied=torch.zeros(R, dtype=torch.int32,
                                                                                              device=dev),
                offsets=offsets, num_local=num_local, in_rank=in_rank, R=R)


def stage_launch_args(s, tb, quantize, qg=8):
    """``(positional, keyword)`` arguments of `nvlink.dispatch_kernel` for one staging launch over every token of
    `setup`'s ``s`` (TB ``tb``, QG ``qg``; quantized in the kernel or not), ``num_warps`` and the grid left out."""
    from smsplit.ep import nvlink

    x, o, R = s["x"], s["offsets"], s["R"]
    T, H = x.shape
    K = s["topk"].size(1)
    x_bytes = 1 if quantize else 2
    positional = (
        x if quantize else x.view(torch.uint8).view(torch.int32), s["layout"], s["topk"], s["weights"], s["pos"],
        s["layout"], s["bases"], s["state"], s["status"].data_ptr(), T, H, K, R, 0, s["num_local"], 0,
        o["x"], o["scales"], o["topk"], o["weights"], o["src"], o["signals"], o["copied"], s["copied"], T, T,
        int(1e9), o["cx"], 0, T, 0)  # (fill_from = fill_to = T: no hole fillers)
    keyword = dict(
        X_BYTES=x_bytes, QUANTIZE=quantize, HAS_SCALES=False, WAIT_COPIES=True, STAGE=True, SYNC=False, GATE=False,
        HAS_TOPK=True, HAS_WEIGHTS=True, VEC=nvlink._pow2(H * x_bytes // 16), GROUPS=nvlink._pow2(H // 128),
        KP=nvlink._pow2(K), RP=nvlink._pow2(R), TB=tb, QG=qg, WIDE_E4M3=False, TRACE=False, trace_ptr=s["layout"], trace_tag=0)
    return positional, keyword


def stage_launch(s, programs, tb, warps, quantize, qg=8):
    from smsplit.ep import nvlink

    positional, keyword = stage_launch_args(s, tb, quantize, qg)
    nvlink.dispatch_kernel[(programs,)](*positional, **keyword, num_warps=warps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, nargs="+", default=[20])
    parser.add_argument("--steps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--groups", type=int, nargs="+", default=[8],
                        help="groups of 128 values quantized at a time (quantize_groups_per_step)")
    parser.add_argument("--warps", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--once", action="store_true", help="one staging launch per config (for ncu), no timing")
    parser.add_argument("--peer-only", action="store_true",
                        help="route no token to this rank: each row quantized and written once (to the staging rows), "
                             "the cost of a staging launch that writes every row once")
    args = parser.parse_args()
    T, H, E, K = 4096, 7168, 256, 8
    s = setup(T, H, E, K, peer_only=args.peer_only)
    sent = s["in_rank"].sum(0).tolist()
    fp8_bytes = T * H * 2 + sum(sent) * (H + H // 128 * 4 + K * 12 + 4)  # read bf16; e4m3 rows, scales, metadata
    rows = []
    if args.once:
        for _ in range(4):  # (launch 4 of the first config is the one ncu --launch-skip 3 takes)
            stage_launch(s, args.programs[0], args.steps[0], args.warps[0], True, args.groups[0])
        torch.cuda.synchronize()
        return
    from smsplit.copy import sm_copy

    tmp = torch.empty_like(s["x"])
    for P in args.programs:
        copy_ms = time_ms(lambda: sm_copy(tmp, s["x"], P), warmup=3, repeat=args.reps, inner=5)["median_ms"]
        rows.append({"programs": P, "kind": "sm_copy", "us": copy_ms * 1e3, "gbps": 2 * T * H * 2 / copy_ms / 1e6})
        print(f"P={P} SM copy of x: {copy_ms * 1e3:.1f} us ({rows[-1]['gbps']:.0f} GB/s read + written)", flush=True)
        for tb, warps, quantize, qg in [(tb, w, q, g) for tb in args.steps for w in args.warps for q in (True, False)
                                        for g in (args.groups if q else [8])]:
            # poison, then check the staged e4m3 rows against the reference quantization once
            s["buf"].fill_(0x7F)
            stage_launch(s, P, tb, warps, quantize, qg)
            ms = time_ms(lambda: stage_launch(s, P, tb, warps, quantize, qg), warmup=3, repeat=args.reps,
                         inner=5)["median_ms"]  # 5 launches queued: the launch's host time between them hidden
            row = {"programs": P, "kind": "stage_fp8" if quantize else "stage_bf16", "tokens_per_step": tb,
                   "num_warps": warps, "quantize_groups": qg if quantize else None, "us": ms * 1e3}
            if quantize:
                from smsplit.fp8 import quantize_1x128

                q, _ = quantize_1x128(s["x"])
                peer = s["in_rank"][:, 1]
                staged = s["buf"][s["offsets"]["cx"]:].view(torch.uint8)[: T * 2 * H].view(2 * T, H)
                rows_there = T + s["pos"][peer, 1].long()
                row["staged_equal"] = bool(torch.equal(staged[rows_there, :H], q[peer].view(torch.uint8)))
                row["gbps"] = fp8_bytes / ms / 1e6
            rows.append(row)
            print(f"P={P} TB={tb} warps={warps}{f' QG={qg}' if quantize else ''} {row['kind']}: {row['us']:.1f} us"
                  + (f" ({row['gbps']:.0f} GB/s, staged rows equal: {row['staged_equal']})" if quantize else ""),
                  flush=True)
    write_result("fp8_stage_peer_only" if args.peer_only else "fp8_stage", {"env": environment(),
                               "shape": {"tokens": T, "hidden": H, "experts": E, "topk": K, "sent": sent},
                               "fp8_bytes": fp8_bytes, "rows": rows})


if __name__ == "__main__":
    main()
