"""Pipeline schedules on 2 GPUs: smsplit DualPipeV vs torch.distributed.pipelining.

    python bench/pipeline.py            # 2 GPUs, NCCL (spawns its own 2 processes)
    python bench/pipeline.py --smoke    # tiny, CPU, gloo, 2 processes: checks the script end to end

Model: a stack of transformer blocks (RMSNorm, causal attention, GELU MLP; bf16), split in 4
stages of --blocks-per-stage blocks. smsplit DualPipeV and torch's ScheduleDualPipeV put stages
(r, 3-r) on rank r; torch's Schedule1F1B and ScheduleGPipe put two consecutive stages on each rank.
Every schedule runs the same micro-batches (--chunks of --micro-batch x --seq tokens).

Measured: step time (median of --steps after --warmup, the slower rank's), peak memory; for
smsplit DualPipeV also each op's start and end (CUDA events), hence the per-rank timeline, busy
time and bubble (step time - busy). The mean F, B, W and F&B times feed
simulate("dualpipev", ...), whose bubble is the prediction we compare against.
Writes bench/results/pipeline.json and bench/figures/pipeline_{measured,simulated}.png
(--smoke: *_smoke.* instead).
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
from common import FIGURES, environment, write_result  # noqa: E402

from smsplit.pipeline import DualPipeV, Linear, Op, Simulation, schedule, simulate  # noqa: E402
from smsplit.pipeline.schedule import TimedOp, stage_of  # noqa: E402

RANKS = 2
STAGES = 2 * RANKS


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


class Clock:
    """CUDA events on the GPU, perf_counter on the CPU; times in ms."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def time_steps(run_step, clock: Clock, warmup: int, steps: int, group) -> dict:
    """Per-step time of this rank and the slower rank's median; steps start together."""
    times = []
    for i in range(warmup + steps):
        clock.sync()
        dist.barrier(group=group)
        start = clock.mark()
        run_step()
        end = clock.mark()
        clock.sync()
        if i >= warmup:
            times.append(clock.ms(start, end))
    both = [None] * dist.get_world_size()
    dist.all_gather_object(both, statistics.median(times))
    return {"median_ms_per_rank": both, "median_ms": max(both), "steps_ms_this_rank": times}


def peak_memory(cuda: bool):
    return torch.cuda.max_memory_allocated() / 2**30 if cuda else None


def bench_smsplit(args, rank, device, dtype, clock, data):
    x, y = data
    m0 = make_stage(args, rank, device, dtype, Linear)
    m1 = make_stage(args, STAGES - 1 - rank, device, dtype, Linear)
    pipe = DualPipeV((m0, m1))

    def run_step():
        pipe.zero_grad(set_to_none=True)
        if rank == 0:
            pipe.step(x, num_chunks=args.chunks, criterion=loss_fn, labels=(y,))
        else:
            pipe.step(num_chunks=args.chunks)

    if clock.cuda:
        torch.cuda.reset_peak_memory_stats()
    result = time_steps(run_step, clock, args.warmup, args.steps, None)
    result["peak_memory_gib"] = peak_memory(clock.cuda)

    # one more step with an event pair around every op
    marks = []
    pipe.op_hook = lambda op, when: marks.append((op, when, clock.mark()))
    clock.sync()
    dist.barrier()
    start = clock.mark()
    run_step()
    end = clock.mark()
    clock.sync()
    pipe.op_hook = None
    ops = []
    for (op, w0, a), (op1, w1, b) in zip(marks[::2], marks[1::2]):
        assert op == op1 and (w0, w1) == ("start", "end")
        ops.append((op, clock.ms(start, a), clock.ms(start, b)))
    assert [o for o, _, _ in ops] == schedule("dualpipev", RANKS, args.chunks)[rank]
    result["timeline"] = {"step_ms": clock.ms(start, end),
                          "ops": [[str(op), op.kind, op.module, op.chunk, op.b_module, op.b_chunk, op.split, s, e]
                                  for op, s, e in ops]}
    del pipe, m0, m1
    return result


def bench_torch(args, name, rank, device, dtype, clock, data):
    from torch.distributed import pipelining as pl

    if not hasattr(pl, name):
        return {"skipped": f"torch {torch.__version__} has no torch.distributed.pipelining.{name}"}
    try:
        return _bench_torch(args, pl, name, rank, device, dtype, clock, data)
    except Exception as e:  # recorded: one schedule failing must not lose the others' figures
        return {"error": f"{type(e).__name__}: {e}"}


def _bench_torch(args, pl, name, rank, device, dtype, clock, data):
    x, y = data
    cls = getattr(pl, name)
    if name == "ScheduleDualPipeV":
        stage_ids = [rank, STAGES - 1 - rank]
        mods = [make_stage(args, s, device, dtype) for s in stage_ids]
        stages = [pl.PipelineStage(m, s, STAGES, device) for m, s in zip(mods, stage_ids)]
        sched = cls(stages, n_microbatches=args.chunks, loss_fn=loss_fn)
        first, last = rank == 0, rank == 0
    else:  # one stage per rank made of two consecutive model stages, same blocks in total
        mods = [nn.Sequential(*make_stage(args, 2 * rank, device, dtype),
                              *make_stage(args, 2 * rank + 1, device, dtype))]
        sched = cls(pl.PipelineStage(mods[0], rank, RANKS, device), n_microbatches=args.chunks, loss_fn=loss_fn)
        first, last = rank == 0, rank == RANKS - 1

    def run_step():
        for m in mods:
            m.zero_grad(set_to_none=True)
        kwargs = {"target": y, "losses": []} if last else {}
        sched.step(*((x,) if first else ()), **kwargs)

    if clock.cuda:
        torch.cuda.reset_peak_memory_stats()
    result = time_steps(run_step, clock, args.warmup, args.steps, None)
    result["peak_memory_gib"] = peak_memory(clock.cuda)
    del sched, mods
    return result


def summarize_timeline(args, per_rank: list[dict]) -> dict:
    """Measured busy/bubble per rank, mean op times, and the simulator's prediction."""
    ranks = []
    kinds: dict[str, list[float]] = {"F": [], "B": [], "Bi": [], "W": [], "FB": []}
    rank_kinds = [{k: [] for k in kinds} for _ in per_rank]
    step_ms = max(r["timeline"]["step_ms"] for r in per_rank)
    timed = []
    where = stage_of("dualpipev", RANKS)
    for rank, rec in enumerate(per_rank):
        row = []
        busy = 0.0
        for _, kind, module, chunk, b_module, b_chunk, split, s, e in rec["timeline"]["ops"]:
            busy += e - s
            name = "Bi" if kind == "B" and split else kind
            kinds[name].append(e - s)
            rank_kinds[rank][name].append(e - s)
            op = Op(kind, module, chunk, b_module, b_chunk, split)
            lane, stage = where[(rank, module)]
            b_lane, b_stage = where[(rank, b_module)] if kind == "FB" else (lane, stage)
            row.append(TimedOp(op, lane, stage, b_lane, b_stage, s, e))
        timed.append(row)
        ranks.append({"step_ms": rec["timeline"]["step_ms"], "busy_ms": busy,
                      "bubble_ms": rec["timeline"]["step_ms"] - busy,
                      "first_op_ms": row[0].start if row else 0.0, "last_op_ms": row[-1].end if row else 0.0})
    # The schedule's own span, as the simulator sees it: from rank 0's first op (it waits for
    # nothing) to the last op on any rank. Outside it each step also does host work the simulator
    # does not model (argument checks, the header all-reduce, chunking inputs, the loss). Each rank's
    # times are relative to its own start event, taken right after a barrier.
    t0 = ranks[0]["first_op_ms"]
    end = max(r["last_op_ms"] for r in ranks)
    for r in ranks:
        r["bubble_in_schedule_ms"] = (end - t0) - r["busy_ms"]

    def simulator_inputs(times):
        mean = {k: (statistics.fmean(v) if v else None) for k, v in times.items()}
        # W: measured directly; B: a full backward where the schedule ran one, else split B + W
        W = mean["W"] or 0.0
        B = mean["B"] if mean["B"] is not None else (mean["Bi"] or 0.0) + W
        FB = mean["FB"] if mean["FB"] is not None else mean["F"] + B
        return mean, {"F": mean["F"], "B": B, "W": W, "FB": FB}

    mean, pooled = simulator_inputs(kinds)
    own = [simulator_inputs(t)[1] for t in rank_kinds]  # each rank's own mean op times
    latency = max(r.get("p2p_message_ms", 0.0) for r in per_rank)
    sim = simulate("dualpipev", RANKS, args.chunks, **{k: [o[k] for o in own] for k in ("F", "B", "W", "FB")},
                   latency=latency)
    sim_pooled = simulate("dualpipev", RANKS, args.chunks, **pooled)
    measured = Simulation("dualpipev", RANKS, args.chunks, timed, step_ms,
                          [r["busy_ms"] for r in ranks], [step_ms - r["busy_ms"] for r in ranks],
                          sim.peak_activations)
    return {
        "per_rank": ranks,
        "mean_op_ms": mean,
        "simulator_inputs_ms_per_rank": own,
        "simulator_latency_ms": latency,
        "predicted": {"total_ms": sim.total, "bubble_ms_per_rank": sim.bubble,
                      "peak_activations_per_rank": sim.peak_activations},
        "predicted_from_pooled_means": {"inputs_ms": pooled, "total_ms": sim_pooled.total,
                                        "bubble_ms_per_rank": sim_pooled.bubble},
        "measured_vs_predicted_bubble_ms": [[r["bubble_in_schedule_ms"], p] for r, p in zip(ranks, sim.bubble)],
        "schedule_span_ms": end - t0,
        "_measured": measured,
        "_simulated": sim,
    }


def p2p_message_ms(args, rank, device, dtype, clock) -> float:
    """Time of one activation message (micro-batch x seq x hidden) between the two ranks:
    ping-pong with the same batched p2p calls the schedule uses, half the round trip."""
    t = torch.randn(args.micro_batch, args.seq, args.hidden, device=device).to(dtype)
    r = torch.empty_like(t)
    peer = 1 - rank

    def ping_pong():
        for turn in (0, 1):
            op = dist.P2POp(dist.isend, t, peer) if turn == rank else dist.P2POp(dist.irecv, r, peer)
            for work in dist.batch_isend_irecv([op]):
                work.wait()

    for _ in range(3):
        ping_pong()
    dist.barrier()
    start = clock.mark()
    for _ in range(10):
        ping_pong()
    end = clock.mark()
    if clock.cuda:
        end.synchronize()
    return clock.ms(start, end) / 10 / 2


def worker(rank: int, args, port: int, queue) -> None:
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
    clock = Clock(cuda)
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (args.chunks * args.micro_batch, args.seq, args.hidden)
    data = (torch.randn(shape, generator=g).to(device, dtype), torch.randn(shape, generator=g).to(device, dtype))
    out = {"smsplit.DualPipeV": bench_smsplit(args, rank, device, dtype, clock, data)}
    out["smsplit.DualPipeV"]["p2p_message_ms"] = p2p_message_ms(args, rank, device, dtype, clock)
    for name in ("Schedule1F1B", "ScheduleGPipe", "ScheduleDualPipeV"):
        if cuda:
            torch.cuda.empty_cache()
        out[f"torch.{name}"] = bench_torch(args, name, rank, device, dtype, clock, data)
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU with gloo")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--blocks-per-stage", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--chunks", type=int, default=8, help="micro-batches per step (>= 4)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.heads, args.blocks_per_stage, args.seq = 64, 4, 1, 16
        args.micro_batch, args.chunks, args.warmup, args.steps = 2, 4, 1, 2
    elif torch.cuda.device_count() < RANKS:
        sys.exit(f"needs {RANKS} GPUs, found {torch.cuda.device_count()}; try --smoke")
    suffix = "_smoke" if args.smoke else ""

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
        entry = {k: v for k, v in recs[0].items() if k not in ("timeline", "steps_ms_this_rank")}
        entry["steps_ms_per_rank"] = [r.get("steps_ms_this_rank") for r in recs]
        entry["peak_memory_gib_per_rank"] = [r.get("peak_memory_gib") for r in recs]
        entry.pop("peak_memory_gib", None)
        if "median_ms" in entry:
            entry["tokens_per_s"] = args.chunks * args.micro_batch * args.seq / (entry["median_ms"] / 1e3)
        per_schedule[name] = entry
    timeline = summarize_timeline(args, [results[r]["smsplit.DualPipeV"] for r in range(RANKS)])
    FIGURES.mkdir(parents=True, exist_ok=True)
    measured_png = FIGURES / f"pipeline_measured{suffix}.png"
    simulated_png = FIGURES / f"pipeline_simulated{suffix}.png"
    timeline.pop("_measured").save_png(
        str(measured_png), title=f"smsplit DualPipeV measured, {RANKS} ranks, {args.chunks} chunks (ms)")
    timeline.pop("_simulated").save_png(
        str(simulated_png), title="simulate('dualpipev') from measured F/B/W/F&B (ms)")

    tokens = args.chunks * args.micro_batch * args.seq
    payload = {
        **environment(),
        "benchmark": "pipeline schedules, 2 ranks",
        "smoke": args.smoke,
        "config": {**vars(args), "stages": STAGES, "tokens_per_step": tokens,
                   "dtype": "float32" if args.smoke else "bfloat16",
                   "backend": "gloo" if args.smoke else "nccl"},
        "notes": [
            "step time = the slower rank's median over steps; each step starts after a barrier",
            "smsplit.DualPipeV uses smsplit.pipeline.Linear (W deferred in zero-bubble steps); "
            "the modules define no overlapped_forward_backward, so an F&B runs F then B",
            "torch 1F1B/GPipe: 2 stages (each = 2 of our stages) on 2 ranks; DualPipeV: 4 stages, V-shaped",
            "measured bubble = step time - sum of op times on the rank (one extra step with CUDA "
            "events around every op); predicted = simulate('dualpipev') with each rank's measured mean op times and the measured "
            "time of one activation message as the latency "
            "(predicted_from_pooled_means: one mean over both ranks)",
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
        print(f"  {name:28s} {figure}")
    pred = timeline["predicted"]["bubble_ms_per_rank"]
    print("  DualPipeV bubble ms in the schedule span, measured vs predicted:",
          [(round(r["bubble_in_schedule_ms"], 2), round(p_, 2)) for r, p_ in zip(timeline["per_rank"], pred)],
          "; step - busy:", [round(r["bubble_ms"], 2) for r in timeline["per_rank"]])


if __name__ == "__main__":
    main()
