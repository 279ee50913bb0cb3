"""MoE block forward(A) + backward(B): serial vs overlapped (DeepSeek-V3 F&B), per EP transport and comm SM count.

One block (RMSNorm, attention, RMSNorm, MoE with one shared expert) at DeepSeek-V3 width: hidden 7168, expert
intermediate 2048, 256 routed experts (128 per rank on 2 GPUs), top-8 from 4 of 8 groups, 4096 tokens per
micro-batch per rank, bf16, FP8 dispatch and BF16 combine. For each (transport, comm SMs):

  serial      forward of micro-batch A, then backward of micro-batch B (same pieces, same streams)
  overlapped  `overlapped_forward_backward`: A's compute pieces beside B's communication pieces and vice versa

Times are CUDA-event medians; ``exposed`` is the share of the step in which communication ran and no compute
did (from per-piece events). The best split is picked with `smsplit.autotune.autotune_split`.

Checked on each (transport, comm SMs), after its timed steps: one more serial and one more overlapped step on
fresh random micro-batches, gradients poisoned with NaN before each; A's output, B's input gradient and every
parameter gradient of the overlapped step must equal the serial step's within --tolerance on every rank
(``overlapped_equals_serial`` in each row). The script exits 1, after writing its result, when any differs.

Run on 2x H200:  PYTHONPATH=src python3 bench/moe_overlap.py
EP8:            PYTHONPATH=src python3 bench/moe_overlap.py --world 8
One GPU:         PYTHONPATH=src python3 bench/moe_overlap.py --world 1 --trace   (all experts local; the copy is local)
CPU smoke run:   PYTHONPATH=src python3 bench/moe_overlap.py --smoke [--world 4]   (gloo ranks, tiny shapes)
Writes bench/results/moe_overlap.json (moe_overlap_<N>ranks.json for other --world, *_smoke with --smoke) and, on GPU
with --trace, bench/figures/moe_overlap_trace.png (moe_overlap_trace_<N>ranks.png): the SM-by-time trace of one
overlapped step at the best split, whose exposed communication is recorded twice in ``best``: from that step's piece
events (``traced_step_exposed_fraction``, as the table) and from the trace's records (``trace_exposed_fraction``).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FIGURES, environment, max_difference, poison, poison_grads, write_result  # noqa: E402

from smsplit.launch import free_port  # noqa: E402
from smsplit.moe.layer import GROUPED_MM_PATH  # noqa: E402
from smsplit.moe.model import ModelConfig, Stage  # noqa: E402
from smsplit.moe.overlap import PieceRunner, overlapped_forward_backward, serial_forward_backward  # noqa: E402

FULL = dict(dim=7168, inter_dim=2048, n_experts=256, topk=8, n_groups=8, topk_groups=4, n_heads=56, tokens=4096,
            seq_len=4096, route_scale=2.5)
SMOKE = dict(dim=256, inter_dim=64, n_experts=16, topk=4, n_groups=4, topk_groups=2, n_heads=4, tokens=256,
             seq_len=128, route_scale=2.5)


class Case:
    """One block on this rank and the micro-batches it runs."""

    def __init__(self, shape: dict, rank: int, world: int, device, dtype):
        cfg = ModelConfig(vocab_size=8, dim=shape["dim"], n_layers=1, n_heads=shape["n_heads"],
                          inter_dim=shape["inter_dim"], n_experts=shape["n_experts"], topk=shape["topk"],
                          n_groups=shape["n_groups"], topk_groups=shape["topk_groups"],
                          route_scale=shape["route_scale"], seq_len=shape["seq_len"])
        torch.manual_seed(1 + rank)
        with torch.device(device):  # default init, drawn on the device: full-width experts are 45 GB in fp32
            self.block = Stage(cfg, [0], ep_rank=rank, ep_size=world, seed=None).to(dtype=dtype)
        moe = self.block.blocks[0].moe
        moe.router.to(torch.float32)
        moe.router.bias = moe.router.bias.float()
        moe.expert_alignment = 16 if device.type == "cuda" else 1
        moe.router.eval()  # no load counting in a benchmark
        batch = shape["tokens"] // shape["seq_len"]
        self.generator = g = torch.Generator().manual_seed(100 + rank)
        self.inputs = [torch.randn(batch, shape["seq_len"], shape["dim"], generator=g).to(device, dtype)
                       for _ in range(2)]
        self.grad = torch.randn(batch, shape["seq_len"], shape["dim"], generator=g).to(device, dtype) * 1e-2

    def set_split(self, buffer, runner):
        self.block.blocks[0].moe.buffer = buffer
        self.block.runner = runner

    def step(self, fb, runner, trace=None):
        """Forward micro-batch B (untimed), then time fb: forward of A with backward of B. With ``trace`` (an
        `smsplit.trace.Trace`), the timed part, and only it, is traced: the figure shows the step the table
        measures, not B's serial forward before it."""
        x_b = self.inputs[1].detach().requires_grad_()
        y_b = self.block(x_b)
        x_a = self.inputs[0].detach().requires_grad_()
        if runner.on_streams:
            torch.cuda.synchronize()
        runner.intervals.clear()
        runner.trace = trace
        start = _now(runner)
        try:
            (y_a,), _ = fb(self.block, [x_a], None, [], self.block, None, [y_b], [self.grad], runner=runner)
        finally:
            runner.trace = None
        end = _now(runner)
        seconds = _elapsed(start, end)
        del y_a
        return seconds, runner.exposed_comm()

    def fresh_inputs(self):
        """New random micro-batches A and B and B's output gradient, drawn as the timed ones are."""
        like = self.inputs[0]
        x_a, x_b, grad = (torch.randn(like.shape, generator=self.generator).to(like.device, like.dtype)
                          for _ in range(3))
        return x_a, x_b, grad * 1e-2

    def outcome(self, fb, runner, inputs) -> dict:
        """One step of ``fb`` on ``inputs`` (`fresh_inputs`), the gradients poisoned first: copies of A's output,
        B's input gradient and every parameter's gradient (``"gradient of <name>"``, None where none); the
        originals are poisoned and dropped (see `_taken`)."""
        x_a, x_b, grad = inputs
        poison_grads(self.block.parameters())
        x_b = x_b.detach().requires_grad_()
        y_b = self.block(x_b)
        (y_a,), _ = fb(self.block, [x_a.detach().requires_grad_()], None, [], self.block, None, [y_b], [grad],
                       runner=runner)
        result = {"output": y_a, "input gradient": x_b.grad}
        result.update((f"gradient of {n}", p.grad) for n, p in self.block.named_parameters())
        taken = _taken(result)
        self.block.zero_grad(set_to_none=True)
        return taken


# Largest accepted max |difference| / max |serial's| of a checked tensor. The two steps run the same ops on the
# same inputs (the overlapped one in another order, its weight gradients deferred), so float32 agrees to rounding;
# bf16 leaves room for kernels that sum in a varying order (atomics).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _taken(tensors: dict) -> dict:
    """Copies of ``tensors`` (None stays None); the originals are poisoned (`common.poison`)."""
    copies = {k: None if t is None else t.detach().clone() for k, t in tensors.items()}
    poison(tensors.values())
    return copies


GROUPS = ("output", "input gradient", "parameter gradients")  # what a check compares, in this order


def differences(got: dict, want: dict) -> dict:
    """Per group of GROUPS, the largest `max_difference` of the tensors of ``got`` and ``want`` (`Case.outcome`s):
    ``{group: (max |diff|, max |diff| / max |want|)}``; "parameter gradients" are the "gradient of ..." entries. A
    name in only one of them counts as an infinite difference."""
    out = {group: (0.0, 0.0) for group in GROUPS}
    for name in set(got) | set(want):
        group = "parameter gradients" if name.startswith("gradient of ") else name
        if name not in got or name not in want:
            diff = (math.inf, math.inf)
        else:
            diff = max_difference(got[name], want[name])
        out[group] = tuple(max(a, b) for a, b in zip(out[group], diff))
    return out


def _check(case, runner, tolerance: float, device) -> dict:
    """One serial and one overlapped step on the same fresh inputs on this split; the largest differences over
    every rank, and ``overlapped_equals_serial``: all within ``tolerance`` (max |diff| / max |serial's|)."""
    inputs = case.fresh_inputs()
    serial = case.outcome(serial_forward_backward, runner, inputs)
    overlapped = case.outcome(overlapped_forward_backward, runner, inputs)
    mine = differences(overlapped, serial)
    worst = torch.tensor([x for group in GROUPS for x in mine[group]], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    worst = worst.tolist()
    groups = {group: dict(max_abs_diff=worst[2 * i], max_rel_diff=worst[2 * i + 1]) for i, group in enumerate(GROUPS)}
    rel = max(g["max_rel_diff"] for g in groups.values())
    return dict(overlapped_equals_serial=rel <= tolerance,
                check=dict(max_rel_diff=rel, max_abs_diff=max(g["max_abs_diff"] for g in groups.values()),
                           exact=all(g["max_abs_diff"] == 0 for g in groups.values()), tolerance=tolerance,
                           **groups))


def mismatched(rows) -> list[str]:
    """The rows (``"<transport> comm_sms=<n>"``) whose overlapped step differed from the serial one."""
    return [f"{r['transport']} comm_sms={r['comm_sms']}" for r in rows if r.get("overlapped_equals_serial") is False]


def exit_if_mismatched(bad: list[str]) -> None:
    """Exit with status 1, naming them, when any row's overlapped step differed from its serial step."""
    if bad:
        sys.exit(f"moe_overlap.py: the overlapped step differs from the serial step: {', '.join(bad)}")


def _now(runner):
    if runner.on_streams:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed(start, end) -> float:
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _measure(case, runner, iters, warmup):
    out = {}
    for name, fn in (("serial", serial_forward_backward), ("overlapped", overlapped_forward_backward)):
        for _ in range(warmup):
            case.step(fn, runner)
        runs = [case.step(fn, runner) for _ in range(iters)]
        times = [t for t, _ in runs]
        median = statistics.median(times)
        shares = min(runs, key=lambda r: abs(r[0] - median))[1]
        out[name] = dict(ms=1e3 * median, min_ms=1e3 * min(times), exposed_fraction=shares["exposed_fraction"],
                         comm_ms=1e3 * shares["comm_s"], compute_ms=1e3 * shares["compute_s"])
        case.block.zero_grad(set_to_none=True)
    out["speedup"] = out["serial"]["ms"] / out["overlapped"]["ms"]
    return out


def _buffer(Buffer, shape, world, budget, transport, timeout_s, dtype):
    # sized for the largest message: the backward's gradients (activation dtype) with top-k weights
    nbytes = Buffer.get_buffer_size_hint(shape["tokens"], shape["dim"], world, shape["topk"], x_dtype=dtype,
                                         fp8=False, combine_dtype=dtype,
                                         backend=transport if transport != "auto" else "reference")
    return Buffer(dist.group.WORLD, num_nvl_bytes=nbytes, budget=budget, backend=transport, timeout_s=timeout_s)


def _worker(rank, world, port, args, queue):
    from smsplit.ep import Buffer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    on_gpu = not args.smoke
    if on_gpu:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        shape = dict(SMOKE if args.smoke else FULL)
        if args.experts:
            shape["n_experts"] = args.experts
        device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
        dtype = torch.bfloat16 if on_gpu else torch.float32
        tolerance = args.tolerance if args.tolerance is not None else TOLERANCE[dtype]
        case = Case(shape, rank, world, device, dtype)
        rows = []
        splits = [(t, n) for t in args.transports for n in (args.comm_sms if on_gpu else [0])]
        for transport, comm_sms in splits:
            row = dict(transport=transport, comm_sms=comm_sms)
            budget = None
            try:
                if on_gpu:
                    from smsplit.budget import SmBudget, SmBudgetError

                    try:
                        budget = SmBudget(comm_sms, device=device, mode="green")
                    except SmBudgetError:
                        budget = SmBudget(comm_sms, device=device, mode="grid")
                    row.update(granted_comm_sms=budget.comm_sms, mode=budget.mode)
                buffer = _buffer(Buffer, shape, world, budget, transport, args.timeout_s, dtype)
                runner = PieceRunner(budget.comm_stream if budget else None,
                                     budget.compute_stream if budget else None, record=True)
                case.set_split(buffer, runner)
                row.update(_measure(case, runner, args.iters, args.warmup))
                row.update(_check(case, runner, tolerance, device))
            except Exception as e:  # noqa: BLE001 - an unavailable transport is a row, not a crash
                row["error"] = f"{type(e).__name__}: {e}"
            finally:
                if budget is not None:
                    budget.close()
            rows.append(row)
            if rank == 0:
                print(_format_row(row), flush=True)

        def write(best):
            if rank != 0:
                return
            valid = [r for r in rows if "error" not in r]
            payload = dict(
                environment(), benchmark="moe_overlap", smoke=args.smoke, world=world, shape=shape,
                dtype=str(dtype), note=("expert count as DeepSeek-V3 (256)" if shape["n_experts"] == 256 else
                                        f"expert count shrunk to {shape['n_experts']}"),
                grouped_mm_path={f"{k[0]} {k[1]} {k[2]}": v for k, v in GROUPED_MM_PATH.items()},
                rows=rows, best=best,
                best_speedup=max((r["speedup"] for r in valid), default=None),
                best_overlapped_exposed_fraction=min((r["overlapped"]["exposed_fraction"] for r in valid),
                                                     default=None),
                targets=dict(speedup=">= 1.3", exposed_fraction="< 0.05"))
            name = "moe_overlap" + ("" if world == 2 else f"_{world}ranks") + ("_smoke" if args.smoke else "")
            path = write_result(name, payload)
            print(f"wrote {path}", flush=True)

        write(None)  # the measured rows are kept even if tuning or tracing fails below
        ok = [(r["transport"], r["comm_sms"]) for r in rows if "error" not in r]
        if on_gpu and ok:
            state = {}
            try:
                best = _tune_and_trace(case, ok, state, args, shape, world, device, dtype, rank)
            except Exception as e:  # noqa: BLE001
                best = dict(error=f"{type(e).__name__}: {e}")
            finally:
                if state.get("budget") is not None:
                    state["budget"].close()
            if rank == 0:
                print(f"autotuned best split: {best}", flush=True)
            write(best)
        if rank == 0:
            queue.put(mismatched(rows))
    finally:
        dist.destroy_process_group()


def _tune_and_trace(case, splits, state, args, shape, world, device, dtype, rank):
    """Pick the fastest (transport, comm SMs) of ``splits`` for the overlapped step with `autotune_split`;
    with ``--trace`` draw an SM trace of one overlapped step at that split."""
    from smsplit.autotune import autotune_split
    from smsplit.budget import SmBudget, SmBudgetError
    from smsplit.ep import Buffer

    def overlapped_step(split):
        if state.get("split") != split:
            if state.get("budget") is not None:
                state["budget"].close()
            try:
                budget = SmBudget(split[1], device=device, mode="green")
            except SmBudgetError:
                budget = SmBudget(split[1], device=device, mode="grid")
            buffer = _buffer(Buffer, shape, world, budget, split[0], args.timeout_s, dtype)
            state.update(split=split, budget=budget,
                         runner=PieceRunner(budget.comm_stream, budget.compute_stream, record=True))
            case.set_split(buffer, state["runner"])
        case.step(overlapped_forward_backward, state["runner"])

    choice, table = autotune_split(overlapped_step, splits, warmup=1, iters=args.iters, group=dist.group.WORLD)
    best = dict(transport=choice[0], comm_sms=choice[1],
                autotune=[dict(split=list(r["candidate"]), ms=r["ms"], error=r["error"]) for r in table])
    if args.trace:
        from smsplit.trace import Trace

        overlapped_step(choice)
        # A traced step first, into a scratch trace: the probe kernels' first launch (compile or cache load) would
        # otherwise stall the measured one.
        case.step(overlapped_forward_backward, state["runner"], trace=Trace(device))
        trace = Trace(device)
        seconds, shares = case.step(overlapped_forward_backward, state["runner"], trace=trace)
        # The same step two ways: per-piece CUDA events (as the table) and the SM trace's records (as the figure)
        best.update(traced_step_ms=1e3 * seconds, traced_step_exposed_fraction=shares["exposed_fraction"],
                    trace_exposed_fraction=trace.alone_ns() / 1e9 / seconds if seconds > 0 else 0.0)
        if rank == 0:
            FIGURES.mkdir(parents=True, exist_ok=True)
            name = "moe_overlap_trace" + ("" if world == 2 else f"_{world}ranks")
            title = (f"MoE block F&B overlapped, {choice[0]}, {state['budget']!r}\n{world} rank(s); this step "
                     f"{1e3 * seconds:.1f} ms, exposed comm {100 * shares['exposed_fraction']:.1f}% (piece events)")
            trace.save_png(FIGURES / f"{name}.png", title=title, num_sms=state["budget"].total_sms)
            trace.save_chrome(FIGURES / f"{name}.json")
            best["trace"] = f"bench/figures/{name}.png"
    return best


def _format_row(row) -> str:
    if "error" in row:
        return f"{row['transport']:>10} comm_sms={row['comm_sms']:>3}: {row['error']}"
    s, o, c = row["serial"], row["overlapped"], row["check"]
    return (f"{row['transport']:>10} comm_sms={row['comm_sms']:>3}: serial {s['ms']:8.2f} ms "
            f"(exposed {100 * s['exposed_fraction']:4.1f}%)  overlapped {o['ms']:8.2f} ms "
            f"(exposed {100 * o['exposed_fraction']:4.1f}%)  speedup {row['speedup']:.2f}x; overlapped "
            + ("= serial" if row["overlapped_equals_serial"] else "DIFFERS from serial")
            + f" (max |diff| / max |serial| {c['max_rel_diff']:.2g}, tolerance {c['tolerance']:.2g})")


def main(argv=None):
    from smsplit.ep.buffer import BACKENDS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU run: gloo ranks, tiny shapes")
    parser.add_argument("--world", type=int, default=2, help="EP ranks, one GPU each (EP8: 8)")
    parser.add_argument("--comm-sms", type=int, nargs="+", default=[8, 16, 24, 32])
    parser.add_argument("--transports", nargs="+",
                        default=[b for b in BACKENDS if b not in ("auto", "hierarchical")],
                        help=f"EP transports (Buffer backends); this build has {BACKENDS}")
    parser.add_argument("--experts", type=int, default=0, help="routed experts (default 256; shrink only for memory)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--trace", action="store_true", help="write an SM trace of one overlapped step (GPU)")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="bound on every wait for the peer")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest accepted max |difference| / max |serial's| of the checked overlapped step's "
                        "output and gradients (default 1e-4 in float32, 2e-2 in bfloat16)")
    args = parser.parse_args(argv)
    world = args.world
    if world < 1:
        parser.error(f"--world must be >= 1, got {world}")
    if not args.smoke and torch.cuda.device_count() < world:
        parser.error(f"needs {world} GPUs (found {torch.cuda.device_count()}); use --smoke on a CPU")
    queue = mp.get_context("spawn").Queue()
    mp.spawn(_worker, args=(world, free_port(), args, queue), nprocs=world, join=True)
    exit_if_mismatched(queue.get(timeout=10))


if __name__ == "__main__":
    main()
