"""Pipeline schedules on 2 (or --ranks) GPUs: smsplit DualPipeV and DualPipe vs torch.distributed.pipelining.

    python bench/pipeline.py                     # 2 GPUs, NCCL (spawns its own 2 processes)
    python bench/pipeline.py --ranks 4           # 4 GPUs
    python bench/pipeline.py --smoke [--ranks 4] # tiny, CPU, gloo: checks the script end to end

Model: a stack of transformer blocks (RMSNorm, causal attention, GELU MLP; bf16), split in 2 x ranks
stages of --blocks-per-stage blocks. smsplit DualPipeV and torch's ScheduleDualPipeV put stages
(r, 2 x ranks - 1 - r) on rank r; torch's Schedule1F1B and ScheduleGPipe put two consecutive stages on
each rank; smsplit DualPipe holds two of those pairs on each rank (ranks r and ranks-1-r's: every pair twice)
and feeds half of the micro-batches at each end.
Every schedule runs the same micro-batches (--chunks of --micro-batch x --seq tokens).

Measured: step time (median of --steps after --warmup, the slower rank's), peak memory; for
smsplit DualPipeV also, in one more step, each op's start and end (CUDA events, and host times).
Bubble of a rank = the schedule's span (rank 0's first op start to the last op end anywhere) minus
the rank's op times. Predicted: simulate("dualpipev", ...) fed each rank's mean F, B, Bi, W and F&B,
its op overhead (mean gap between ops with no p2p batch between them) and the time of one activation
message (ping-pong), with sync="inputs" and sync="batches" (NCCL's batched p2p: a rendezvous), with
and without the overhead; the main prediction is sync="batches" with the overhead.
Checked: one more step of every schedule on fresh random data (gradients poisoned with NaN first), its
per-micro-batch losses and its gradients against the whole model run in one process, micro-batch after
micro-batch (gradients of the summed losses; torch's scale_grads divides them by --chunks), within
--tolerance; the script exits 1, after writing its result, when any schedule differs.
Writes bench/results/pipeline.json and bench/figures/pipeline_{measured,simulated}.png
(other rank counts: pipeline_<N>ranks*; --smoke: *_smoke.* instead). --reanalyse FILE redoes the analysis from a results file's raw times.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from common import FIGURES, call_times_ms, environment, max_difference, poison_grads, write_result  # noqa: E402

from smsplit.pipeline import (  # noqa: E402
    DualPipe,
    DualPipeV,
    Linear,
    Op,
    Simulation,
    comm_plans,
    schedule,
    simulate,
    sum_stage_copies,
)
from smsplit.pipeline.schedule import TimedOp, _batch_peers, stage_of  # noqa: E402

RANKS = 2  # set from --ranks in main() and in every worker
STAGES = 2 * RANKS


def set_ranks(ranks: int) -> None:
    global RANKS, STAGES
    RANKS, STAGES = ranks, 2 * ranks


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, linear=nn.Linear):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(hidden)
        self.qkv = linear(hidden, 3 * hidden, bias=False)
        self.proj = linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden)
        self.up = linear(hidden, 4 * hidden, bias=False)
        self.down = linear(4 * hidden, hidden, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def make_stage(args, stage: int, device, dtype, linear=nn.Linear) -> nn.Sequential:
    blocks = []
    with torch.device(device):  # initialise on the GPU: CPU init of 200M-parameter blocks is slow
        for i in range(args.blocks_per_stage):
            torch.manual_seed(1000 + stage * args.blocks_per_stage + i)
            blocks.append(Block(args.hidden, args.heads, linear).to(dtype))
    return nn.Sequential(*blocks)


def loss_fn(out, target):
    return F.mse_loss(out.float(), target.float())


# Largest accepted max |difference| / max |reference| of a checked tensor: float32 (CPU) schedules differ from
# the reference only in the order of sums; bf16 gradients also round each micro-batch's sum (8 by default).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def stage_params(stage_ids, module, blocks_per_stage: int):
    """``((stage, name), parameter)`` for ``module``, the blocks of make_stage(s) for each s of ``stage_ids`` in a
    row; ``name`` is the parameter's name in make_stage(s) (the reference's key)."""
    for name, p in module.named_parameters():
        block, rest = name.split(".", 1)
        stage, block = divmod(int(block), blocks_per_stage)
        yield (stage_ids[stage], f"{block}.{rest}"), p


class Check:
    """The reference every schedule's checked step must give: the whole model (stages 0 .. STAGES-1, make_stage's
    initial weights) in this process on a fresh random batch, one micro-batch after another.

    Args:
        args: the script's arguments (model shape, --chunks, --micro-batch, --seq).
        device, dtype: where and in what the reference runs (as the schedules).
        tolerance: largest accepted max |difference| / max |reference| of a loss vector or a gradient.
    """

    def __init__(self, args, device, dtype, tolerance: float):
        self.blocks_per_stage, self.tolerance, self.device = args.blocks_per_stage, tolerance, device
        g = torch.Generator(device="cpu").manual_seed(1)  # the timed steps' data is seed 0's
        shape = (args.chunks * args.micro_batch, args.seq, args.hidden)
        # kept on the CPU: held on the device, it would count in every schedule's peak memory
        self.batch = tuple(torch.randn(shape, generator=g).to(dtype=dtype) for _ in range(2))
        stages = [make_stage(args, s, device, dtype) for s in range(STAGES)]
        model = nn.Sequential(*stages)
        losses = []
        for x, y in zip(*(t.to(device).chunk(args.chunks) for t in self.batch)):
            loss = loss_fn(model(x), y)
            loss.backward()
            losses.append(loss.detach())
        self.losses = torch.stack(losses).cpu()
        self.grads = {(s, n): p.grad.cpu() for s, m in enumerate(stages) for n, p in m.named_parameters()}

    def run(self, step, held, loss_chunks, grad_scale: float = 1.0) -> dict:
        """Poison the gradients of ``held`` and run ``step(batch)`` (one step of a schedule on ``self.batch``, given
        on the device); compare the losses it returns (a tensor, or None where no lane ends) with the reference's of
        micro-batches ``loss_chunks``, and the gradients of ``held`` (``[(stage ids, module)]``, see `stage_params`) with
        ``grad_scale`` times the reference's. Returns this rank's figures (see `merge_checks`)."""
        params = [p for _, module in held for p in module.parameters()]
        poison_grads(params)
        losses = step(tuple(t.to(self.device) for t in self.batch))
        loss_chunks = list(loss_chunks)
        loss_diff = max_difference(losses, self.losses[loss_chunks]) if loss_chunks else (0.0, 0.0)
        grad_diff, stages = (0.0, 0.0), set()
        for stage_ids, module in held:
            for key, p in stage_params(stage_ids, module, self.blocks_per_stage):
                diff = max_difference(p.grad, self.grads[key], grad_scale)
                grad_diff = tuple(max(a, b) for a, b in zip(grad_diff, diff))
                stages.add(key[0])
        return {"losses": len(loss_chunks), "loss_max_abs_diff": loss_diff[0], "loss_max_rel_diff": loss_diff[1],
                "stages": sorted(stages), "grads": len(params), "grad_max_abs_diff": grad_diff[0],
                "grad_max_rel_diff": grad_diff[1], "grad_scale": grad_scale, "tolerance": self.tolerance}


def merge_checks(per_rank: list[dict], chunks: int, stages: int) -> dict:
    """One schedule's check from its ranks' `Check.run` figures: the largest differences, and
    ``equals_reference``: every micro-batch's loss and every stage's gradients were compared, all within the
    tolerance."""
    merged = {k: max(c[k] for c in per_rank) for k in ("loss_max_abs_diff", "loss_max_rel_diff",
                                                      "grad_max_abs_diff", "grad_max_rel_diff")}
    covered = sorted(set().union(*(c["stages"] for c in per_rank)))
    tolerance = per_rank[0]["tolerance"]
    merged.update(losses=sum(c["losses"] for c in per_rank), stages=covered, tolerance=tolerance,
                  grad_scale=per_rank[0]["grad_scale"])
    merged["equals_reference"] = (merged["losses"] == chunks and covered == list(range(stages))
                                  and merged["loss_max_rel_diff"] <= tolerance
                                  and merged["grad_max_rel_diff"] <= tolerance)
    return merged


def check_text(check: dict) -> str:
    """A schedule's check in words."""
    verdict = "equal the reference" if check["equals_reference"] else "DIFFER from the reference"
    return (f"losses ({check['losses']}) and gradients (stages {check['stages']}) {verdict}: max |diff| / max |ref| "
            f"loss {check['loss_max_rel_diff']:.2g}, gradients {check['grad_max_rel_diff']:.2g} "
            f"(tolerance {check['tolerance']:.2g})")


def exit_if_mismatched(per_schedule: dict) -> None:
    """Exit with status 1, naming them, if the checked step of any schedule differs from the reference."""
    bad = [name for name, entry in per_schedule.items()
           if "check" in entry and not entry["check"]["equals_reference"]]
    if bad:
        sys.exit(f"pipeline.py: losses or gradients differ from the single-process reference: {', '.join(bad)}")


def time_steps(run_step, cuda: bool, warmup: int, steps: int) -> dict:
    """Per-step time of this rank and the slower rank's median; steps start together."""
    def before():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    times = call_times_ms(run_step, warmup, steps, before=before, cuda=cuda)
    both = [None] * dist.get_world_size()
    dist.all_gather_object(both, statistics.median(times))
    return {"median_ms_per_rank": both, "median_ms": max(both), "steps_ms_this_rank": times}


def peak_memory(cuda: bool):
    return torch.cuda.max_memory_allocated() / 2**30 if cuda else None


def record_timeline(pipe, run_step, cuda: bool) -> dict:
    """One more step with two timestamps at the start and at the end of every op: the device's
    (a CUDA event on the current stream; perf_counter on a CPU) and the host's (perf_counter when
    the hook ran). Times in ms from the step's start (right after synchronize and a barrier)."""
    def now():
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(a, b) -> float:
        return a.elapsed_time(b) if cuda else (b - a) * 1e3

    marks = []
    pipe.op_hook = lambda op, when: marks.append((op, when, now(), time.perf_counter()))
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    start, host0 = now(), time.perf_counter()
    try:
        run_step()
        end = now()
        if cuda:
            torch.cuda.synchronize()
    finally:
        pipe.op_hook = None
    ops = []
    for (op, w0, a, ha), (op1, w1, b, hb) in zip(marks[::2], marks[1::2]):
        assert op == op1 and (w0, w1) == ("start", "end")
        ops.append([str(op), op.kind, op.module, op.chunk, op.b_module, op.b_chunk, op.split,
                    ms(start, a), ms(start, b), (ha - host0) * 1e3, (hb - host0) * 1e3])
    return {"step_ms": ms(start, end), "op_fields": list(OP_FIELDS), "ops": ops}


OP_FIELDS = ("name", "kind", "module", "chunk", "b_module", "b_chunk", "split",
             "start_ms", "end_ms", "host_start_ms", "host_end_ms")


def bench_smsplit(args, rank, device, dtype, cuda, data, check):
    m0 = make_stage(args, rank, device, dtype, Linear)
    m1 = make_stage(args, STAGES - 1 - rank, device, dtype, Linear)
    pipe = DualPipeV((m0, m1))

    def step(batch):
        x, y = batch
        pipe.zero_grad(set_to_none=True)
        if rank == 0:
            return pipe.step(x, num_chunks=args.chunks, criterion=loss_fn, labels=(y,))[0]
        pipe.step(num_chunks=args.chunks)
        return None

    def run_step():
        step(data)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = time_steps(run_step, cuda, args.warmup, args.steps)
    result["peak_memory_gib"] = peak_memory(cuda)
    result["timeline"] = record_timeline(pipe, run_step, cuda)
    assert [o[0] for o in result["timeline"]["ops"]] == [str(o) for o in schedule("dualpipev", RANKS, args.chunks)[rank]]
    result["check"] = check.run(step, [((rank,), m0), ((STAGES - 1 - rank,), m1)],
                                range(args.chunks) if rank == 0 else ())
    return result


def bench_smsplit_dualpipe(args, rank, device, dtype, cuda, data, check):
    """smsplit DualPipe: the same blocks as the other schedules in RANKS stages of two of ours each (like
    1F1B's); rank r holds stages r and RANKS-1-r (every stage twice, same initial weights), half of the
    micro-batches enter at each end, and each step ends by summing the two copies' gradients."""
    def stage(s):
        return nn.Sequential(*make_stage(args, 2 * s, device, dtype, Linear),
                             *make_stage(args, 2 * s + 1, device, dtype, Linear))

    pipe = DualPipe((stage(rank), stage(RANKS - 1 - rank)))

    def step(batch):
        x, y = batch
        half = x.size(0) // 2
        pipe.zero_grad(set_to_none=True)
        loss = None
        if rank == 0:  # lane 0 starts here, lane 1 (the other half) ends here
            loss, _ = pipe.step(x[:half], num_chunks=args.chunks, criterion=loss_fn, labels=(y[half:],))
        elif rank == RANKS - 1:
            loss, _ = pipe.step(x[half:], num_chunks=args.chunks, criterion=loss_fn, labels=(y[:half],))
        else:
            pipe.step(num_chunks=args.chunks)
        sum_stage_copies(pipe)
        return loss

    def run_step():
        step(data)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = time_steps(run_step, cuda, args.warmup, args.steps)
    result["peak_memory_gib"] = peak_memory(cuda)
    half = args.chunks // 2  # rank 0's losses are lane 1's (the second half's), the last rank's lane 0's
    loss_chunks = range(half, args.chunks) if rank == 0 else range(half) if rank == RANKS - 1 else ()
    held = [((2 * rank, 2 * rank + 1), pipe.module[0]),
            ((2 * (RANKS - 1 - rank), 2 * (RANKS - 1 - rank) + 1), pipe.module[1])]
    result["check"] = check.run(step, held, loss_chunks)
    return result


def bench_torch(args, name, rank, device, dtype, cuda, data, check):
    from torch.distributed import pipelining as pl

    if not hasattr(pl, name):
        return {"skipped": f"torch {torch.__version__} has no torch.distributed.pipelining.{name}"}
    try:
        return _bench_torch(args, pl, name, rank, device, dtype, cuda, data, check)
    except Exception as e:  # noqa: BLE001 -- recorded: one schedule failing must not lose the others' figures
        return {"error": f"{type(e).__name__}: {e}"}


def _bench_torch(args, pl, name, rank, device, dtype, cuda, data, check):
    cls = getattr(pl, name)
    if name == "ScheduleDualPipeV":
        stage_ids = [rank, STAGES - 1 - rank]
        mods = [make_stage(args, s, device, dtype) for s in stage_ids]
        stages = [pl.PipelineStage(m, s, STAGES, device) for m, s in zip(mods, stage_ids)]
        sched = cls(stages, n_microbatches=args.chunks, loss_fn=loss_fn)
        first, last = rank == 0, rank == 0
        held = [((s,), m) for s, m in zip(stage_ids, mods)]
    else:  # one stage per rank made of two consecutive model stages, same blocks in total
        mods = [nn.Sequential(*make_stage(args, 2 * rank, device, dtype),
                              *make_stage(args, 2 * rank + 1, device, dtype))]
        sched = cls(pl.PipelineStage(mods[0], rank, RANKS, device), n_microbatches=args.chunks, loss_fn=loss_fn)
        first, last = rank == 0, rank == RANKS - 1
        held = [((2 * rank, 2 * rank + 1), mods[0])]

    def step(batch):
        x, y = batch
        for m in mods:
            m.zero_grad(set_to_none=True)
        losses = []
        kwargs = {"target": y, "losses": losses} if last else {}
        sched.step(*((x,) if first else ()), **kwargs)
        return torch.stack(losses) if last else None

    def run_step():
        step(data)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = time_steps(run_step, cuda, args.warmup, args.steps)
    result["peak_memory_gib"] = peak_memory(cuda)
    scale = 1 / args.chunks if getattr(sched, "scale_grads", False) else 1.0  # torch's default: the mean
    result["check"] = check.run(step, held, range(args.chunks) if last else (), scale)
    return result


def _mean(xs):
    return statistics.fmean(xs) if xs else None


def analyse(chunks: int, raw: list[dict]) -> dict:
    """Measured bubble per rank, what the op timelines say about the gaps between ops, and the
    simulator's predictions from the measured op times, op overhead and message latency.

    raw[r]: rank r's record_timeline() and its p2p_message_ms. Returns a JSON-able dict, plus
    "_measured" and "_simulated" (Simulations, for the figures)."""
    where = stage_of("dualpipev", RANKS)
    plans = comm_plans("dualpipev", RANKS, chunks)
    ranks, timed = [], []
    kinds = ("F", "B", "Bi", "W", "FB")
    rank_kinds = [{k: [] for k in kinds} for _ in raw]
    gap_rows = []
    for rank, rec in enumerate(raw):
        ops = [dict(zip(rec["timeline"]["op_fields"], o)) for o in rec["timeline"]["ops"]]
        row, busy = [], 0.0
        for o in ops:
            s, e = o["start_ms"], o["end_ms"]
            busy += e - s
            rank_kinds[rank]["Bi" if o["kind"] == "B" and o["split"] else o["kind"]].append(e - s)
            op = Op(o["kind"], o["module"], o["chunk"], o["b_module"], o["b_chunk"], o["split"])
            lane, stage = where[(rank, op.module)]
            b_lane, b_stage = where[(rank, op.b_module)] if op.kind == "FB" else (lane, stage)
            row.append(TimedOp(op, lane, stage, b_lane, b_stage, s, e))
        timed.append(row)
        # the p2p batches the runtime posts before each op (comm_plan order), by round
        before, pending = [], []
        for rnd, item in plans[rank]:
            if rnd is None:
                before.append(pending)
                pending = []
            else:
                pending.append((rnd, item))
        gaps = {"direct": [], "batch": []}
        for i in range(1, len(ops)):
            gaps["batch" if before[i] else "direct"].append(ops[i]["start_ms"] - ops[i - 1]["end_ms"])
        # host_ahead: how long before the device reached an op the host had queued it; about 0
        # when the device waited for the host (launch-bound)
        ahead = [o["start_ms"] - o["host_start_ms"] for o in ops]
        gap_rows.append((ops, before))
        ranks.append({
            "step_ms": rec["timeline"]["step_ms"], "busy_ms": busy,
            "bubble_ms": rec["timeline"]["step_ms"] - busy,
            "first_op_ms": ops[0]["start_ms"], "last_op_ms": ops[-1]["end_ms"],
            "gaps_ms": {k: {"n": len(v), "mean": _mean(v), "median": statistics.median(v) if v else None,
                            "max": max(v, default=None), "sum": sum(v)} for k, v in gaps.items()},
            "op_overhead_ms": _mean(gaps["direct"]) or 0.0,
            "host_ahead_ms": {"min": min(ahead[1:], default=None), "median": statistics.median(ahead),
                              "ops_within_0.05ms": sum(a < 0.05 for a in ahead[1:])},
        })
    # The schedule's own span, as the simulator sees it: from rank 0's first op (it waits for
    # nothing) to the last op on any rank. Outside it each step also does host work the simulator
    # does not model (argument checks, the header all-reduce, chunking inputs, the loss). Each rank's
    # times are relative to its own start event, taken right after a barrier.
    t0 = ranks[0]["first_op_ms"]
    end = max(r["last_op_ms"] for r in ranks)
    for r in ranks:
        r["bubble_in_schedule_ms"] = (end - t0) - r["busy_ms"]

    # p2p latency seen in the timeline (2 ranks). Both ends of a batch leave it at the same moment
    # (each waits for the whole NCCL group), so the starts of the ops after matching batches give
    # the offset between the ranks' clocks; the batch's transfer time is then from the later of
    # the two posts (the end of the op before it) to that moment (the host has queued the next op
    # while the stream waited, so no op overhead is added).
    from_timeline = None
    if RANKS == 2:
        pairs = {}
        for rank, (ops, before) in enumerate(gap_rows):
            for i in range(1, len(ops)):
                if before[i]:  # the last batch before op i ends when op i can start
                    rnd, batch = before[i][-1]
                    post = ops[i - 1]["end_ms"] if len(before[i]) == 1 else None
                    pairs.setdefault(rnd, {})[rank] = (post, ops[i]["start_ms"], batch)
        pairs = {k: v for k, v in pairs.items() if len(v) == 2 and None not in (v[0][0], v[1][0])}
        if pairs:
            offset = statistics.median(v[0][1] - v[1][1] for v in pairs.values())  # rank 1 -> rank 0 clock
            per_message = []
            for v in pairs.values():
                (p0, s0, batch), (p1, _, _) = v[0], v[1]
                n = max(_batch_peers(0, batch).values())
                per_message.append((s0 - max(p0, p1 + offset)) / n)
            from_timeline = {"batches": len(pairs), "rank1_clock_offset_ms": offset,
                             "latency_ms_per_message": statistics.median(per_message),
                             "latency_ms_per_message_all": per_message}

    inputs = []
    for t in rank_kinds:
        mean = {k: _mean(v) for k, v in t.items()}
        W = mean["W"] or 0.0
        B = mean["B"] if mean["B"] is not None else (mean["Bi"] or 0.0) + W  # full backward
        inputs.append({"F": mean["F"], "B": B, "W": W, "FB": mean["FB"] if mean["FB"] is not None else mean["F"] + B,
                       "Bi": mean["Bi"] if mean["Bi"] is not None else B - W})
    latency = max(r.get("p2p_message_ms", 0.0) for r in raw)
    overhead = [r["op_overhead_ms"] for r in ranks]
    times = {k: [i[k] for i in inputs] for k in ("F", "B", "W", "FB", "Bi")}
    variants = {  # name -> simulate() arguments besides the op times
        "previous: inputs, Bi = B - W": {"sync": "inputs", "Bi": None},
        "inputs": {"sync": "inputs"},
        "inputs + op_overhead": {"sync": "inputs", "op_overhead": overhead},
        "batches": {"sync": "batches"},
        "batches + op_overhead": {"sync": "batches", "op_overhead": overhead},
    }
    if from_timeline and from_timeline["latency_ms_per_message"] > 0:
        variants["batches + op_overhead, timeline latency"] = {
            "sync": "batches", "op_overhead": overhead, "latency": from_timeline["latency_ms_per_message"]}
    main_variant = "batches + op_overhead"
    measured_bubble = [r["bubble_in_schedule_ms"] for r in ranks]
    predictions, sims = {}, {}
    for name, kw in variants.items():
        kw = {"latency": latency, **times, **kw}
        sim = sims[name] = simulate("dualpipev", RANKS, chunks, **kw)
        predictions[name] = {
            "total_ms": sim.total, "busy_ms_per_rank": sim.busy, "bubble_ms_per_rank": sim.bubble,
            "measured_over_predicted": [m / p if p else None for m, p in zip(measured_bubble, sim.bubble)],
            "within_10pct": [abs(m - p) <= 0.1 * abs(p) for m, p in zip(measured_bubble, sim.bubble)],
            "latency_ms": kw["latency"], "op_overhead_ms": kw.get("op_overhead", 0.0), "sync": kw["sync"],
        }
    sim = sims[main_variant]
    pooled = {k: _mean([x for t in rank_kinds for x in t[k]]) for k in kinds}
    step_ms = max(r["step_ms"] for r in ranks)
    measured = Simulation("dualpipev", RANKS, chunks, timed, step_ms, [r["busy_ms"] for r in ranks],
                          [step_ms - r["busy_ms"] for r in ranks], sim.peak_activations)
    side_by_side = [[[str(m.op), m.start - t0, m.end - t0, p.start, p.end] for m, p in zip(mrow, prow)]
                    for mrow, prow in zip(timed, sim.ops)]
    return {
        "per_rank": ranks,
        "schedule_span_ms": end - t0,
        "measured_bubble_in_schedule_ms": measured_bubble,
        "mean_op_ms": pooled,
        "simulator_inputs_ms_per_rank": inputs,
        "simulator_latency_ms": latency,
        "simulator_op_overhead_ms_per_rank": overhead,
        "latency_from_timeline": from_timeline,
        "main_model": main_variant,
        "predicted": {"total_ms": sim.total, "bubble_ms_per_rank": sim.bubble,
                      "peak_activations_per_rank": sim.peak_activations, **predictions[main_variant]},
        "predictions": predictions,
        "measured_vs_predicted_bubble_ms": [[m, p] for m, p in zip(measured_bubble, sim.bubble)],
        "ops_measured_vs_predicted": {"fields": ["op", "measured_start_ms", "measured_end_ms",
                                                 "predicted_start_ms", "predicted_end_ms"],
                                      "note": "measured times from rank 0's first op start, each rank on its own clock",
                                      "per_rank": side_by_side},
        "raw": raw,
        "_measured": measured,
        "_simulated": sim,
    }


def print_summary(timeline: dict) -> None:
    measured = timeline["measured_bubble_in_schedule_ms"]
    cols = " ".join(f"{'rank ' + str(r) + ' ms':>10s} {'meas/pred':>9s}" for r in range(len(measured)))
    print(f"  DualPipeV bubble in the schedule span (span {timeline['schedule_span_ms']:.2f} ms)")
    print(f"    {'':52s} {cols} {'total ms':>9s}")
    print(f"    {'measured':52s} " + " ".join(f"{m:10.2f} {'':9s}" for m in measured)
          + f" {timeline['schedule_span_ms']:9.2f}")
    for name, p in timeline["predictions"].items():
        star = "*" if name == timeline["main_model"] else " "
        cells = " ".join(f"{b:10.2f} {q:8.2f}{'+' if ok else ' '}" for b, q, ok in
                         zip(p["bubble_ms_per_rank"], p["measured_over_predicted"], p["within_10pct"]))
        print(f"   {star}{'predicted, ' + name:52s} {cells} {p['total_ms']:9.2f}")
    print("    (* main model; + within 10%)")
    lat = timeline["latency_from_timeline"]
    print("    op overhead (mean gap between ops with no p2p batch between) ms per rank:",
          [round(x, 4) for x in timeline["simulator_op_overhead_ms_per_rank"]],
          f"; p2p message {timeline['simulator_latency_ms']:.4f} ms (ping-pong)"
          + (f", {lat['latency_ms_per_message']:.4f} ms (timeline, {lat['batches']} batches)" if lat else ""))
    for r, rec in enumerate(timeline["per_rank"]):
        g = rec["gaps_ms"]
        print(f"    rank {r}: gaps after a p2p batch n={g['batch']['n']} sum {g['batch']['sum']:.2f} ms, "
              f"other gaps n={g['direct']['n']} sum {g['direct']['sum']:.2f} ms; host ahead of device: "
              f"min {rec['host_ahead_ms']['min']:.3f} ms, {rec['host_ahead_ms']['ops_within_0.05ms']} ops within 0.05 ms")


def p2p_message_ms(args, rank, device, dtype, cuda) -> float:
    """Time of one activation message (micro-batch x seq x hidden) between neighbour ranks (0-1, 2-3, ...,
    all pairs at once): ping-pong with the same batched p2p calls the schedule uses, half the round trip."""
    t = torch.randn(args.micro_batch, args.seq, args.hidden, device=device).to(dtype)
    r = torch.empty_like(t)
    peer = rank ^ 1

    def ping_pong():
        for turn in (0, 1):
            op = dist.P2POp(dist.isend, t, peer) if turn == rank % 2 else dist.P2POp(dist.irecv, r, peer)
            for work in dist.batch_isend_irecv([op]):
                work.wait()

    times = call_times_ms(ping_pong, warmup=3, repeat=5, inner=10, before=dist.barrier, cuda=cuda)
    return statistics.median(times) / 2


def worker(rank: int, args, port: int, queue) -> None:
    set_ranks(args.ranks)
    cuda = not args.smoke
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=RANKS, timeout=timedelta(seconds=120),
                            **({"device_id": device} if cuda else {}))
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (args.chunks * args.micro_batch, args.seq, args.hidden)
    data = (torch.randn(shape, generator=g).to(device, dtype), torch.randn(shape, generator=g).to(device, dtype))
    check = Check(args, device, dtype, args.tolerance if args.tolerance is not None else TOLERANCE[dtype])
    if cuda:
        torch.cuda.empty_cache()
    out = {"smsplit.DualPipeV": bench_smsplit(args, rank, device, dtype, cuda, data, check)}
    out["smsplit.DualPipeV"]["p2p_message_ms"] = p2p_message_ms(args, rank, device, dtype, cuda)
    if cuda:
        torch.cuda.empty_cache()
    out["smsplit.DualPipe"] = bench_smsplit_dualpipe(args, rank, device, dtype, cuda, data, check)
    for name in ("Schedule1F1B", "ScheduleGPipe", "ScheduleDualPipeV"):
        if cuda:
            torch.cuda.empty_cache()
        out[f"torch.{name}"] = bench_torch(args, name, rank, device, dtype, cuda, data, check)
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU with gloo")
    p.add_argument("--ranks", type=int, default=2, help="pipeline ranks, one GPU each (even)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--blocks-per-stage", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--chunks", type=int, default=None,
                   help="micro-batches per step (default max(8, 2 x ranks); DualPipeV needs >= 2 x ranks)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest accepted max |difference| / max |reference| of the checked step's losses and of "
                   "each gradient (default 1e-4 in float32, 2e-2 in bfloat16)")
    p.add_argument("--reanalyse", metavar="JSON", help="no run: redo the bubble analysis of a results file "
                   "(its dualpipev_timeline.raw) and print it; works on a CPU")
    args = p.parse_args()
    if args.reanalyse:
        import json

        saved = json.loads(Path(args.reanalyse).read_text())
        set_ranks(len(saved["dualpipev_timeline"]["raw"]))
        print_summary(analyse(saved["config"]["chunks"], saved["dualpipev_timeline"]["raw"]))
        return
    if args.ranks < 2 or args.ranks % 2:
        p.error(f"--ranks must be an even number >= 2, got {args.ranks}")
    set_ranks(args.ranks)
    if args.chunks is None:
        args.chunks = max(8, 2 * RANKS)
    elif args.chunks < 2 * RANKS:
        p.error(f"--chunks must be >= 2 x ranks = {2 * RANKS} (DualPipeV), got {args.chunks}")
    if args.smoke:
        args.hidden, args.heads, args.blocks_per_stage, args.seq = 64, 4, 1, 16
        args.micro_batch, args.chunks, args.warmup, args.steps = 2, 2 * RANKS, 1, 2
    elif torch.cuda.device_count() < RANKS:
        sys.exit(f"needs {RANKS} GPUs, found {torch.cuda.device_count()}; try --smoke")
    suffix = ("" if RANKS == 2 else f"_{RANKS}ranks") + ("_smoke" if args.smoke else "")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    t0 = time.time()
    procs = [ctx.Process(target=worker, args=(r, args, port, queue)) for r in range(RANKS)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=900) for _ in range(RANKS))
    for proc in procs:
        proc.join()
        if proc.exitcode:
            sys.exit(f"a worker exited with {proc.exitcode}")

    per_schedule = {}
    for name in results[0]:
        recs = [results[r][name] for r in range(RANKS)]
        entry = {k: v for k, v in recs[0].items() if k not in ("timeline", "steps_ms_this_rank", "check")}
        if all("check" in r for r in recs):
            entry["check"] = merge_checks([r["check"] for r in recs], args.chunks, STAGES)
        entry["steps_ms_per_rank"] = [r.get("steps_ms_this_rank") for r in recs]
        entry["peak_memory_gib_per_rank"] = [r.get("peak_memory_gib") for r in recs]
        entry.pop("peak_memory_gib", None)
        if "median_ms" in entry:
            entry["tokens_per_s"] = args.chunks * args.micro_batch * args.seq / (entry["median_ms"] / 1e3)
        per_schedule[name] = entry
    timeline = analyse(args.chunks, [{k: results[r]["smsplit.DualPipeV"][k] for k in ("timeline", "p2p_message_ms")}
                                     for r in range(RANKS)])
    FIGURES.mkdir(parents=True, exist_ok=True)
    measured_png = FIGURES / f"pipeline_measured{suffix}.png"
    simulated_png = FIGURES / f"pipeline_simulated{suffix}.png"
    timeline.pop("_measured").save_png(
        str(measured_png), title=f"smsplit DualPipeV measured, {RANKS} ranks, {args.chunks} chunks (ms)")
    timeline.pop("_simulated").save_png(
        str(simulated_png), title=f"simulate('dualpipev') [{timeline['main_model']}] from measured "
        "F/B/Bi/W/F&B, op overhead and message time (ms)")

    tokens = args.chunks * args.micro_batch * args.seq
    payload = {
        **environment(),
        "benchmark": f"pipeline schedules, {RANKS} ranks",
        "smoke": args.smoke,
        "config": {**vars(args), "stages": STAGES, "tokens_per_step": tokens,
                   "dtype": "float32" if args.smoke else "bfloat16",
                   "backend": "gloo" if args.smoke else "nccl"},
        "notes": [
            "step time = the slower rank's median over steps; each step starts after a barrier",
            ("smsplit.DualPipeV uses smsplit.pipeline.Linear (W deferred in zero-bubble steps); "
             "the modules define no overlapped_forward_backward, so an F&B runs F then B"),
            (f"torch 1F1B/GPipe: {RANKS} stages (each = 2 of our stages) on {RANKS} ranks; DualPipeV: {STAGES} "
             f"stages, V-shaped; smsplit.DualPipe: the same {RANKS} stages as 1F1B, each held twice (rank r: "
             "stages r and ranks-1-r), half the micro-batches entering at each end, a step ending with "
             "sum_stage_copies"),
            ("check: one more step of every schedule on fresh random data (seed 1), gradients poisoned with NaN "
             "first; its per-micro-batch losses and its gradients against the whole model run in one process, "
             "micro-batch after micro-batch (gradients of the summed losses, times grad_scale: torch's "
             "scale_grads divides by the micro-batch count); differences are max |diff| / max |reference| of the "
             "loss vector and of each gradient (rel) and max |diff| (abs), the worst over ranks"),
            ("dualpipev_timeline: one more step with CUDA events (and host times) at the start and end of "
             "every op. Measured bubble per rank = the schedule's span (rank 0's first op start to the last "
             "op end on any rank) - the rank's summed op times. Predicted = simulate('dualpipev') fed each "
             "rank's mean F, B, Bi (split backward), W and F&B, so predicted busy = measured busy; "
             "op_overhead = the rank's mean gap between consecutive ops with no p2p batch between them; "
             "latency = one activation message (ping-pong). Variants in 'predictions': sync='inputs' (an op "
             "waits only for its own messages) or 'batches' (every p2p batch of comm_plan is a rendezvous, "
             "as the NCCL runtime), with and without op_overhead; 'main_model' is the one in 'predicted'"),
        ],
        "schedules": per_schedule,
        "dualpipev_timeline": timeline,
        "figures": [str(measured_png.relative_to(FIGURES.parent.parent)),
                    str(simulated_png.relative_to(FIGURES.parent.parent))],
        "wall_s": time.time() - t0,
    }
    path = write_result(f"pipeline{suffix}", payload)
    print(f"wrote {path}, {measured_png}, {simulated_png}")
    for name, entry in per_schedule.items():
        figure = entry.get("median_ms") or entry.get("skipped") or entry.get("error")
        print(f"  {name:28s} {figure}" + (f"\n  {'':28s} {check_text(entry['check'])}" if "check" in entry else ""))
    print_summary(timeline)
    exit_if_mismatched(per_schedule)


if __name__ == "__main__":
    main()
