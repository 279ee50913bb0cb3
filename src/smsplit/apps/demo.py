"""`smsplit demo`: train the tiny DeepSeek-style model with expert parallelism and DualPipeV.

    from smsplit.apps.demo import DemoConfig, run
    summary = run(DemoConfig(out_dir="smsplit-report/moe", steps=200))

``world = ep * pp`` processes. Ranks with the same pipeline rank form an EP group (they hold different experts
and see different data); ranks with the same EP rank form a DualPipeV pipeline. On a CPU-only machine
`run` spawns 2 gloo processes (EP 2, one pipeline rank holding both legs of the V) and uses the
reference EP transport; with 2+ GPUs it runs one process per GPU over NCCL with an `SmBudget` splitting each
GPU's SMs between the comm and compute streams.

Rank 0 shows a progress bar (loss, tokens/s, exposed communication) and writes the report folder:
``loss_curve.png``, ``pipeline_timeline.png`` (the DualPipeV schedule timed with the measured op durations),
``overlap_timeline.png`` (the pieces of one measured F&B step on the comm and compute streams), on GPU
``sm_trace.png`` (where those pieces ran, SM by SM), and ``summary.json``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from smsplit.launch import free_port
from smsplit.moe.model import ModelConfig, build_stages
from smsplit.moe.overlap import COMM, PieceRunner, piece_of
from smsplit.moe.router import update_biases
from smsplit.timeouts import timeout_problem


@dataclass(frozen=True)
class DemoConfig:
    """What `run` trains and where it writes the report. Bad values, and ``device="cuda"`` on a machine with
    fewer GPUs than ``world_size``, raise ValueError when the config is made (a ``comm_sms`` the GPUs cannot grant
    and a report folder that cannot be made when `run` starts), so before any process starts.

    Args:
        out_dir: the report folder (loss curve, pipeline timeline, summary.json); made if missing.
        steps: training steps (>= 1).
        device: "cpu" (``world_size`` gloo processes, reference EP transport), "cuda" (one process per GPU,
            NCCL, SM budget of ``comm_sms``) or "auto" (cuda when ``world_size`` GPUs are present).
        world_size: processes; ``world_size / pp`` of them form each EP group.
        pp: DualPipeV pipeline ranks (1: each process runs both legs of the V itself).
        chunks: micro-batches per step (>= 2 * pp); batch: sequences per EP rank per step (divisible by chunks).
        seed: seed of the model's initialization and of the synthetic data, an int in [0, 2**32).
        lr: AdamW learning rate, a finite number > 0.
        comm_sms: SMs asked for communication on each GPU (`SmBudget`: green contexts, else grid mode); fewer
            than the GPU's SMs, checked by `run` before any process starts; unused on CPU.
        model: the model, a `ModelConfig` or a dict of `ModelConfig` fields (the others at their defaults).
        progress: show rank 0's progress bar (or its periodic lines when the output is not a terminal).
        timeout_s: bound on every wait for a peer: the process groups' timeout (init, the EP and pipeline groups),
            the EP buffer's and the pipeline's waits.
        ranks_per_node: treat each this many consecutive ranks of an EP group as one node (one machine pretending
            to be several); None finds the nodes from the launcher or the host names (`smsplit.nodes.node_layout`:
            the demo's processes all run on this machine, so one node). When the EP group spans several nodes the
            routers limit each token to ``model.max_nodes_per_token`` of them (groups = nodes,
            `smsplit.moe.router.node_limited_groups`); the summary records the layout and the groups used.
    """

    out_dir: str = "smsplit-report/moe"
    steps: int = 200
    device: str = "auto"
    world_size: int = 2
    pp: int = 1
    chunks: int = 2
    batch: int = 16
    seed: int = 0
    lr: float = 3e-3
    comm_sms: int = 20
    model: ModelConfig = field(default_factory=ModelConfig)
    progress: bool = True
    timeout_s: float = 120.0
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "world_size", "pp", "chunks", "batch", "comm_sms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        seed, lr, device, pp = self.seed, self.lr, self.device, self.pp
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
        if problem := timeout_problem(self.timeout_s):
            raise ValueError(f"timeout_s: {problem}")
        if isinstance(lr, bool) or not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        gpus = _gpu_count()
        if device == "cuda" and gpus < self.world_size:
            raise ValueError(f"device='cuda' runs one process per GPU: world_size={self.world_size} needs "
                             f"{self.world_size} CUDA GPUs, this machine has {gpus} (device='cpu' runs gloo "
                             f"processes)")
        if not isinstance(self.progress, bool):
            raise ValueError(f"progress must be a bool, got {self.progress!r}")
        if not isinstance(self.out_dir, (str, os.PathLike)):
            raise ValueError(f"out_dir must be a path, got {self.out_dir!r}")
        object.__setattr__(self, "out_dir", os.fspath(self.out_dir))
        if isinstance(self.model, dict):
            known = {f.name for f in fields(ModelConfig)}
            if unknown := sorted(set(self.model) - known):
                raise ValueError(f"model: ModelConfig has no field {', '.join(map(repr, unknown))}")
            object.__setattr__(self, "model", ModelConfig(**self.model))
        if not isinstance(self.model, ModelConfig):
            raise ValueError(f"model must be a ModelConfig or a dict of its fields, got {self.model!r}")
        if self.chunks < 2 * pp:
            raise ValueError(f"chunks={self.chunks} must be at least 2 * pp = {2 * pp} (DualPipeV)")
        if self.world_size % pp:
            raise ValueError(f"world_size={self.world_size} must be a multiple of pp={pp}")
        if self.batch % self.chunks:
            raise ValueError(f"batch={self.batch} must divide into chunks={self.chunks} micro-batches")
        cfg = self.model
        if cfg.n_experts % self.ep:
            raise ValueError(f"n_experts={cfg.n_experts} must divide evenly over the {self.ep} EP ranks "
                             f"(world_size={self.world_size} / pp={pp})")
        rpn = self.ranks_per_node
        if rpn is not None:
            if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1:
                raise ValueError(f"ranks_per_node must be None or an int >= 1, got {rpn!r}")
            if self.ep % rpn:
                raise ValueError(f"ranks_per_node={rpn} does not divide the EP group's {self.ep} ranks into whole "
                                 f"nodes (world_size={self.world_size} / pp={pp})")
            from smsplit.moe.router import node_limited_groups
            from smsplit.nodes import NodeLayout

            # the routing the ranks will derive, checked here so a bad M fails before any process starts
            node_limited_groups(cfg.n_experts, cfg.topk, cfg.n_groups, cfg.topk_groups,
                                NodeLayout(rpn, self.ep // rpn), cfg.max_nodes_per_token)
        if cfg.n_layers % (2 * pp):
            raise ValueError(f"n_layers={cfg.n_layers} must divide into 2 * pp = {2 * pp} stages (DualPipeV)")

    @property
    def ep(self) -> int:
        """Ranks in each EP group."""
        return self.world_size // self.pp

    @property
    def ep_backend(self) -> str:
        """The EP transport: across nodes (``ranks_per_node`` splitting the EP group, or fewer processes a machine
        than EP ranks) the hierarchical transport; else on GPUs our NVLink kernels (FP8 dispatch quantized inside the
        kernel, BF16 combine; messages they do not move, the fp32 gradients, take the reference transport inside the
        same `Buffer`), on CPU the reference transport."""
        per_node = self.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or self.ep
        if self.ep > per_node:
            return "hierarchical"
        return "nvlink" if self.device == "cuda" else "reference"


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def synthetic_batch(cfg: ModelConfig, batch: int, seed: int, step: int, slot: int) -> torch.Tensor:
    """``[batch, seq_len + 1]`` token ids from a fixed random Markov chain (each token has 4 likely
    successors), so the loss has somewhere to fall to: the chain's entropy rate, about 0.9 nats, from above
    ln(vocab) at the start.
    The chain depends on ``seed`` only; the samples on (seed, step, slot)."""
    chain = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, cfg.vocab_size, (cfg.vocab_size, 4), generator=chain)
    probs = torch.softmax(torch.randn(cfg.vocab_size, 4, generator=chain) * 1.5, dim=-1)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + slot + 1)
    tokens = torch.empty(batch, cfg.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab_size, (batch,), generator=g)
    for t in range(cfg.seq_len):
        choice = torch.multinomial(probs[tokens[:, t]], 1, generator=g).squeeze(1)
        tokens[:, t + 1] = successors[tokens[:, t], choice]
    return tokens


def _budget(comm_sms: int, device):
    from smsplit.budget import SmBudget, SmBudgetError

    try:
        return SmBudget(comm_sms, device=device, mode="green")
    except (SmBudgetError, ValueError):
        return SmBudget(comm_sms, device=device, mode="grid")


def _worker(rank: int, port: int, config: DemoConfig) -> None:
    """One rank of `run`: joins the process group of ``config.world_size`` ranks and trains."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = config.world_size
    on_gpu = config.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    timeout = datetime.timedelta(seconds=config.timeout_s)
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        _train(rank, config)
    finally:
        dist.destroy_process_group()


def _train(rank: int, config: DemoConfig) -> None:
    from smsplit.ep import Buffer
    from smsplit.pipeline import DualPipeV

    cfg, world, pp, ep = config.model, config.world_size, config.pp, config.ep
    pp_rank, ep_rank = divmod(rank, ep)
    timeout = datetime.timedelta(seconds=config.timeout_s)  # (a new group's default is torch's: 10-30 minutes)
    ep_groups = [dist.new_group(list(range(p * ep, (p + 1) * ep)), timeout=timeout) for p in range(pp)]
    pp_groups = [dist.new_group(list(range(e, world, ep)), timeout=timeout) for e in range(ep)]
    ep_group, pp_group = ep_groups[pp_rank], pp_groups[ep_rank]
    device = torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" else torch.device("cpu")

    chunks, batch, steps = config.chunks, config.batch, config.steps
    budget = _budget(config.comm_sms, device) if device.type == "cuda" else None
    runner = PieceRunner(budget.comm_stream if budget else None, budget.compute_stream if budget else None,
                         record=True)
    buffer = None
    if ep > 1:  # sized for the largest message: the backward's gradients with top-k weights
        backend = config.ep_backend
        tokens = batch // chunks * cfg.seq_len
        nbytes = max(Buffer.get_buffer_size_hint(tokens, cfg.dim, ep, cfg.topk, x_dtype=torch.float32, fp8=False,
                                                 combine_dtype=torch.float32),
                     Buffer.get_buffer_size_hint(tokens, cfg.dim, ep, cfg.topk, backend=backend))
        buffer = Buffer(ep_group, num_nvl_bytes=nbytes, budget=budget, backend=backend, timeout_s=config.timeout_s,
                        ranks_per_node=config.ranks_per_node)
    # the EP group's nodes (agreed by the buffer, which moves tokens across them hierarchically) decide the routing
    # groups: node-limited routing across nodes
    nodes = buffer.nodes if ep > 1 else None
    m0, m1 = build_stages(cfg, pp_rank, pp, ep_rank, ep, seed=config.seed, runner=runner, buffer=buffer,
                          nodes=nodes)
    m0.to(device), m1.to(device)
    params = list({id(p): p for m in (m0, m1) for p in m.parameters()}.values())
    expert_params = {id(p) for m in (m0, m1) for b in m.blocks for p in b.moe.experts.parameters()}
    replicated = [p for p in params if id(p) not in expert_params]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    routers = [b.moe.router for m in (m0, m1) for b in m.blocks]

    scale = 1.0 / (chunks * ep)  # the step's loss is the mean over every token of every EP rank

    def criterion(logits, labels):
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten()) * scale

    op_times: dict[str, list[float]] = {"F": [], "B": [], "W": [], "FB": []}
    timing = {"step": 0}
    trace_state = {"want": False, "trace": None, "intervals": None}

    def op_hook(op, when):
        timing["op"] = str(op) if when == "start" else None  # (named by errors out of the op)
        if when == "start":
            if device.type == "cuda":
                torch.cuda.synchronize()
            timing["t0"] = time.perf_counter()
            if op.kind == "FB" and trace_state["want"]:
                trace_state["before"] = runner.intervals
                runner.intervals = []
                if budget is not None:
                    from smsplit.trace import Trace

                    trace_state["trace"] = runner.trace = Trace(device)
            return
        if device.type == "cuda":
            torch.cuda.synchronize()
        kind = "B" if op.kind == "B" and not op.split else op.kind
        if op.kind == "B" and op.split:
            kind = "Bi"
        if timing["step"] > 0 or steps == 1:  # step 0 includes one-time set-up: kept only if alone
            op_times.setdefault(kind, []).append(time.perf_counter() - timing["t0"])
        if op.kind == "FB" and trace_state["want"]:
            trace_state["want"] = False
            runner.trace = None
            trace_state["intervals"] = runner.exposed_comm() | {"pieces": _piece_rows(runner)}
            runner.intervals = trace_state.pop("before") + runner.intervals

    pipe = DualPipeV((m0, m1), process_group=pp_group, timeout_s=config.timeout_s, op_hook=op_hook)
    is_reporter = rank == 0
    losses, rates, exposed = [], [], []
    progress = _progress(steps) if is_reporter and config.progress else None
    tokens_per_step = batch * cfg.seq_len * ep
    start_all = time.perf_counter()
    for step in range(steps):
        tokens = synthetic_batch(cfg, batch, config.seed, step, ep_rank).to(device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        optimizer.zero_grad(set_to_none=True)
        runner.intervals.clear()
        trace_state["want"] = step == steps - 1
        timing["step"] = step
        t0 = time.perf_counter()
        with _phase(rank, lambda: f"step {step}: " + (f"pipeline op {timing['op']}" if timing.get("op")
                                                         else "pipeline step")):
            loss, _ = pipe.step(inputs, num_chunks=chunks, criterion=criterion, labels=(labels,))
        step_loss = loss.sum().detach() if loss is not None else torch.zeros((), device=device)
        if ep > 1:
            with _phase(rank, f"step {step}: summing the replicated gradients and the loss over the EP group"):
                _all_reduce_grads(replicated, ep_group)
                dist.all_reduce(step_loss, group=ep_group)
        optimizer.step()
        with _phase(rank, f"step {step}: updating the routers' biases"):
            update_biases(routers, ep_group if ep > 1 else None)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        shares = runner.exposed_comm()
        losses.append(float(step_loss))
        rates.append(tokens_per_step / elapsed)
        exposed.append(shares["exposed_fraction"])
        if progress is not None:
            progress[0].update(progress[1], advance=1, loss=losses[-1], tps=rates[-1], exposed=100 * exposed[-1])
            if not progress[0].console.is_terminal and (step + 1) % max(1, steps // 10) == 0:
                progress[0].console.print(f"step {step + 1}/{steps}: loss {losses[-1]:.3f}, "
                                          f"{rates[-1]:,.0f} tok/s, exposed comm {100 * exposed[-1]:.1f}%")
    wall = time.perf_counter() - start_all
    if progress is not None:
        progress[0].stop()

    if is_reporter:
        router = routers[0] if routers else None
        routing = dict(nodes=nodes.num_nodes if nodes else 1, ranks_per_node=nodes.ranks_per_node if nodes else ep,
                       layout_source=nodes.source if nodes else "single EP rank",
                       n_groups=router.n_groups if router else None, topk_groups=router.topk_groups if router else None)
        _report(config, losses, rates, exposed, op_times, trace_state, budget, wall, routing)
    if budget is not None:
        budget.close()


@contextlib.contextmanager
def _phase(rank: int, what):
    """A failure of communication (gloo's after the group's timeout, the EP buffer's `EPTimeoutError`) re-raised
    as a RuntimeError naming the rank, ``what`` (a string, or a function giving one when the error comes) and the
    overlapped piece it came out of, if any."""
    try:
        yield
    except (RuntimeError, TimeoutError) as error:
        where = what() if callable(what) else what
        piece = piece_of(error)
        raise RuntimeError(f"rank {rank}: {where}{', ' + piece if piece else ''}: {error}") from error


def _all_reduce_grads(params, group) -> None:
    """Sum the gradients of the parameters every EP rank holds a copy of (one flat all-reduce)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def _piece_rows(runner: PieceRunner) -> list:
    """(kind, name, start_s, end_s) of the recorded pieces, relative to the first."""
    ivs = runner.intervals
    if not ivs:
        return []
    first = ivs[0].start
    if isinstance(first, torch.cuda.Event):
        torch.cuda.synchronize()
        return [(iv.kind, iv.name, first.elapsed_time(iv.start) / 1e3, first.elapsed_time(iv.end) / 1e3)
                for iv in ivs]
    return [(iv.kind, iv.name, iv.start - first, iv.end - first) for iv in ivs]


def _progress(steps: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("[bold]MoE demo"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                        TextColumn("exposed comm {task.fields[exposed]:.1f}%"), TimeElapsedColumn())
    progress.start()
    task = progress.add_task("train", total=steps, loss=float("nan"), tps=0.0, exposed=0.0)
    return progress, task


def _report(config: DemoConfig, losses, rates, exposed, op_times, trace_state, budget, wall, routing=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from smsplit.pipeline import simulate

    out, cfg, pp, ep, chunks = Path(config.out_dir), config.model, config.pp, config.ep, config.chunks
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(f"tiny DeepSeek-style MoE, EP {ep} x DualPipeV {pp} ({config.device})")
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png", dpi=110)
    plt.close(fig)

    mean = {k: sum(v) / len(v) for k, v in op_times.items() if v}
    f, fb = mean.get("F", 0.0), mean.get("FB", 0.0)
    b = mean.get("B", 0.0) or (mean.get("Bi", 0.0) + mean.get("W", 0.0))
    w, bi = mean.get("W", 0.0), mean.get("Bi")
    sim = simulate("dualpipev", pp, chunks, F=f, B=max(b, w), W=w, FB=fb or None, Bi=bi)
    sim.save_png(str(out / "pipeline_timeline.png"),
                 title=f"DualPipeV, {pp} pipeline rank(s), {chunks} chunks, measured op times\n"
                       f"F {1e3 * f:.1f} ms, B {1e3 * b:.1f} ms"
                       + (f" (split {1e3 * bi:.1f} ms)" if bi is not None else "")
                       + f", W {1e3 * w:.1f} ms, F&B {1e3 * fb:.1f} ms")

    pieces = (trace_state.get("intervals") or {}).get("pieces", [])
    if pieces:
        _draw_pieces(pieces, out / "overlap_timeline.png",
                     f"one F&B step, {config.device}: exposed communication "
                     f"{100 * trace_state['intervals']['exposed_fraction']:.1f}% of the step")
    if trace_state.get("trace") is not None:
        trace_state["trace"].save_png(out / "sm_trace.png", title=f"one overlapped F&B step, {budget!r}",
                                      num_sms=budget.total_sms)
        trace_state["trace"].save_chrome(out / "sm_trace.json")
    tail = max(1, len(rates) // 2)
    summary = dict(
        device=config.device, world=config.world_size, ep=ep, pp=pp, chunks=chunks, steps=len(losses),
        seed=config.seed, model=asdict(cfg), budget=repr(budget) if budget is not None else None,
        ep_backend=config.ep_backend, routing=routing, first_losses=losses[:10], final_loss=losses[-1] if losses else None,
        loss_fell=bool(losses and min(losses[-5:]) < losses[0]),
        tokens_per_s=sum(rates[-tail:]) / tail if rates else 0.0,
        exposed_comm_fraction=sum(exposed[-tail:]) / tail if exposed else 0.0,
        overlapped_step=trace_state.get("intervals") and {k: v for k, v in trace_state["intervals"].items()
                                                          if k != "pieces"},
        op_seconds=mean, train_wall_s=wall, losses=losses)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


def _draw_pieces(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colour = {"comm": "#e4572e", "compute": "#2e86ab"}
    fig, ax = plt.subplots(figsize=(12, 2.6))
    for kind, name, s, e in rows:
        y = 1 if kind == COMM else 0
        ax.barh(y, (e - s) * 1e3, left=s * 1e3, color=colour[kind], edgecolor="black", linewidth=0.4)
        if e - s > 0.03 * max(r[3] for r in rows):
            ax.text((s + e) / 2 * 1e3, y, name.replace(" (backward)", "ᴮ"), ha="center", va="center", fontsize=6)
    ax.set_yticks([0, 1])
    ax.set_yticklabels(["compute", "comm"])
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(config: DemoConfig) -> dict:
    """Train the tiny MoE model as ``config`` says and write the report to ``config.out_dir``; returns the
    summary (what ``summary.json`` holds). A ``comm_sms`` that leaves a GPU no compute SM, even in grid mode,
    and a report folder that cannot be made raise ValueError before any process starts."""
    if not isinstance(config, DemoConfig):
        raise TypeError(f"run takes a DemoConfig, got {config!r}")
    world_size, comm_sms = config.world_size, config.comm_sms
    if config.device == "auto":
        config = replace(config, device="cuda" if _gpu_count() >= world_size else "cpu")
    if config.device == "cuda":
        from smsplit.budget import plan_split

        for gpu in range(world_size):  # what grid mode (the fallback from green contexts) cannot grant either
            plan_split(comm_sms, torch.cuda.get_device_properties(gpu).multi_processor_count)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    out_dir = Path(config.out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission
        raise ValueError(f"out_dir: cannot make the report folder {config.out_dir!r}: {e}") from e
    summary_path = out_dir / "summary.json"
    summary_path.unlink(missing_ok=True)
    mp.spawn(_worker, args=(free_port(), config), nprocs=world_size, join=True)
    return json.loads(summary_path.read_text())
