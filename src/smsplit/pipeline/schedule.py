"""Pipeline schedules as per-rank op lists, the p2p plan derived from them, and a simulator.

`schedule(kind, pp, chunks)` is the single source of op order: `DualPipe`/`DualPipeV` walk
exactly these lists at runtime and `simulate` times exactly these lists.

Vocabulary:
  rank    a pipeline rank, 0..pp-1.
  module  0 or 1: which of the rank's (at most two) modules an op runs.
  lane    a path of (rank, module) pairs that micro-batches flow through, first stage to last.
          1f1b/zb1p: one lane over pp ranks. dualpipe: two lanes, rank 0 -> pp-1 through every
          rank's module 0 and rank pp-1 -> 0 through every rank's module 1. dualpipev: one V-shaped
          lane, rank 0 -> pp-1 through module 0 then back pp-1 -> 0 through module 1 (2*pp stages).
  stage   a position on its lane.
  chunk   a micro-batch id, counted per lane (dualpipe: chunks/2 per lane).
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from dataclasses import dataclass, field

from smsplit._args import check_int

KINDS = ("1f1b", "zb1p", "dualpipe", "dualpipev")


@dataclass(frozen=True)
class Op:
    """One compute op of a rank.

    kind: "F" forward, "B" backward, "W" deferred weight-gradient, "FB" a forward and a backward
      issued together (overlapped when the module type has `overlapped_forward_backward`).
    module, chunk: what the op runs; for "FB" the forward half; for "W" the split "B" it completes.
    b_module, b_chunk: "FB" only, the backward half.
    split: "B" only; True computes input gradients now and leaves weight gradients to a later "W".
    """

    kind: str
    module: int
    chunk: int
    b_module: int = -1
    b_chunk: int = -1
    split: bool = False

    @property
    def forward(self) -> tuple[int, int] | None:
        return (self.module, self.chunk) if self.kind in ("F", "FB") else None

    @property
    def backward(self) -> tuple[int, int] | None:
        if self.kind == "B":
            return (self.module, self.chunk)
        if self.kind == "FB":
            return (self.b_module, self.b_chunk)
        return None

    def __str__(self) -> str:
        if self.kind == "FB":
            return f"F{self.module}.{self.chunk}&B{self.b_module}.{self.b_chunk}"
        return f"{self.kind}{'i' if self.split else ''}{self.module}.{self.chunk}"


def lanes(kind: str, pp: int) -> list[list[tuple[int, int]]]:
    """The (rank, module) path of each lane, first stage first.

    kind: "1f1b", "zb1p", "dualpipe" or "dualpipev" (ValueError otherwise); pp: number of ranks.
    """
    _check_kind(kind)
    down = [(r, 0) for r in range(pp)]
    up = [(r, 1) for r in reversed(range(pp))]
    if kind in ("1f1b", "zb1p"):
        return [down]
    if kind == "dualpipe":
        return [down, up]
    return [down + up]


def chunks_per_lane(kind: str, chunks: int) -> int:
    """Micro-batches that go through each lane when a step runs ``chunks`` in all: for "dualpipe", half of
    them enter at each end; the other kinds have one lane. Does not check ``chunks`` (see `check_chunks`)."""
    return chunks // 2 if kind == "dualpipe" else chunks


def check_chunks(kind: str, pp: int, chunks: int) -> None:
    """Raise ValueError naming a valid value when (pp, chunks) cannot be scheduled.

    kind: a schedule kind (see `lanes`); pp: number of ranks; chunks: micro-batches per step, as for
    `schedule`. Both must be ints (numpy integers too; TypeError for bools and other types) and positive;
    "dualpipe" needs an even pp and an even chunks >= 2*pp, "dualpipev" chunks >= 2*pp.
    """
    _check_kind(kind)
    for name, value in (("pp (pipeline ranks)", pp), ("num_chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{kind}: {name} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{kind}: {name} must be a positive int, got {value!r}")
    if kind == "dualpipe":
        if pp % 2:
            raise ValueError(
                f"DualPipe needs an even number of pipeline ranks, got {pp}; "
                f"use {pp + 1} or {pp - 1} ranks, or DualPipeV, which takes any number")
        if chunks % 2 or chunks < 2 * pp:
            good = max(2 * pp, chunks + chunks % 2)
            raise ValueError(
                f"DualPipe with {pp} ranks needs an even num_chunks >= 2*ranks = {2 * pp} "
                f"(half of the micro-batches enter at each end); got {chunks}, try {good}")
    elif kind == "dualpipev" and chunks < 2 * pp:
        raise ValueError(
            f"DualPipeV with {pp} ranks needs num_chunks >= 2*ranks = {2 * pp}; got {chunks}")


def schedule(kind: str, pp: int, chunks: int) -> list[list[Op]]:
    """Each rank's ordered op list for `kind` in ("1f1b", "zb1p", "dualpipe", "dualpipev").

    pp is the number of ranks (for dualpipev that is half the number of stages); chunks is the
    total number of micro-batches (for dualpipe, half of them enter at each end).
    """
    check_chunks(kind, pp, chunks)
    if kind == "1f1b":
        return [_one_f_one_b(pp, chunks, r) for r in range(pp)]
    if kind == "zb1p":
        return [_zb_h1(pp, chunks, r) for r in range(pp)]
    return [_dualpipe(kind, pp, chunks, r) for r in range(pp)]


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown schedule kind {kind!r}; choose one of {KINDS}")


def _one_f_one_b(pp: int, chunks: int, rank: int) -> list[Op]:
    warmup = min(pp - 1 - rank, chunks)
    ops = [Op("F", 0, c) for c in range(warmup)]
    for c in range(chunks - warmup):
        ops += [Op("F", 0, warmup + c), Op("B", 0, c)]
    ops += [Op("B", 0, c) for c in range(chunks - warmup, chunks)]
    return ops


def _zb_h1(pp: int, chunks: int, rank: int) -> list[Op]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with B split into input-grad B
    and a W; rank r keeps up to r W's pending so later ranks return gradients sooner, which keeps
    peak activations at pp like 1F1B. W's fill the cool-down."""
    warmup = min(pp - 1 - rank, chunks)
    ops = [Op("F", 0, c) for c in range(warmup)]
    pending: deque[int] = deque()

    def backward(c: int) -> None:
        ops.append(Op("B", 0, c, split=True))
        pending.append(c)
        if len(pending) > rank:
            ops.append(Op("W", 0, pending.popleft()))

    for c in range(chunks - warmup):
        ops.append(Op("F", 0, warmup + c))
        backward(c)
    for c in range(chunks - warmup, chunks):
        backward(c)
    ops += [Op("W", 0, c) for c in pending]
    return ops


def _dualpipe(kind: str, pp: int, chunks: int, rank: int) -> list[Op]:
    """DualPipe (DeepSeek-V3 report, section 3.2.1) and its V-shaped variant, in eight steps.

    "Phase" 0 is the lane that starts on this rank's side of the pipeline, phase 1 the other one.
    For dualpipe the second half of the ranks mirrors the first half, so phase p runs module
    p ^ 1 there; n is the number of ranks in a half and r the rank's distance from its end.
    For dualpipev n is the number of ranks and r the rank.
    """
    if kind == "dualpipe":
        n, r, mirror = pp // 2, min(rank, pp - 1 - rank), int(rank >= pp // 2)
    else:
        n, r, mirror = pp, rank, 0
    per_lane = chunks_per_lane(kind, chunks)
    innermost = r == n - 1  # the rank where the two phases meet
    ops: list[Op] = []
    next_f, next_b = [0, 0], [0, 0]
    pending_w: deque[tuple[int, int]] = deque()

    def take(counter: list[int], phase: int) -> tuple[int, int]:
        m = phase ^ mirror
        counter[m] += 1
        return m, counter[m] - 1

    def f(phase: int) -> None:
        ops.append(Op("F", *take(next_f, phase)))

    def b(phase: int, split: bool = False) -> None:
        m, c = take(next_b, phase)
        ops.append(Op("B", m, c, split=split))
        if split:
            pending_w.append((m, c))

    def w() -> None:
        ops.append(Op("W", *pending_w.popleft()))

    def fb(f_phase: int, b_phase: int) -> None:
        fm, fc = take(next_f, f_phase)
        bm, bc = take(next_b, b_phase)
        ops.append(Op("FB", fm, fc, bm, bc))

    for _ in range(2 * (n - r - 1)):  # 1: forwards of phase 0 fill the pipe
        f(0)
    for _ in range(r + 1):  # 2: both phases
        f(0)
        f(1)
    for _ in range(n - r - 1):  # 3: first backwards, zero-bubble split
        b(1, split=True)
        w()
        f(1)
    for i in range(per_lane - 2 * n + r + 1):  # 4: steady state, forward & backward pairs
        if i == 0 and innermost:
            f(0)  # kept apart so that its output leaves before the backward runs
            b(1)
        else:
            fb(0, 1)
        fb(1, 0)
    for _ in range(n - r - 1):  # 5
        b(1)
        fb(1, 0)
    split = False
    for i in range(r + 1):  # 6: drain; the second half of these backwards defer W
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        b(1, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        b(0, split)
    for _ in range(n - r - 1):  # 7
        w()
        b(0, split=True)
    for _ in range(r + 1):  # 8
        w()
    assert not pending_w and next_f == next_b, (kind, pp, chunks, rank)
    return ops


# --------------------------------------------------------------------------------------------
# point-to-point plan


@dataclass(frozen=True)
class Message:
    """Tensors one rank sends another: "act" (forward outputs of src_module, chunk) or "grad"
    (gradients of the inputs of src_module, chunk)."""

    kind: str
    src: int
    dst: int
    src_module: int
    dst_module: int
    chunk: int


@dataclass
class Batch:
    """Messages a rank posts together (one `batch_isend_irecv`) and waits for."""

    sends: list[Message] = field(default_factory=list)
    recvs: list[Message] = field(default_factory=list)


def _neighbours(kind: str, pp: int) -> dict[tuple[int, int], tuple]:
    """(rank, module) -> (previous (rank, module) or None, next (rank, module) or None)."""
    out = {}
    for lane in lanes(kind, pp):
        for i, node in enumerate(lane):
            out[node] = (lane[i - 1] if i > 0 else None, lane[i + 1] if i + 1 < len(lane) else None)
    return out


def stage_of(kind: str, pp: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, module) -> (lane, stage): where each module of each rank sits, for a schedule kind (see
    `lanes`) on pp ranks. Only the modules that the kind uses are keys (module 0 alone for 1f1b and zb1p)."""
    return {node: (li, s) for li, lane in enumerate(lanes(kind, pp)) for s, node in enumerate(lane)}


def _produced(rank: int, op: Op, nbrs) -> list[Message]:
    """Messages op sends to other ranks, activations first."""
    out = []
    if op.forward is not None:
        m, c = op.forward
        nxt = nbrs[(rank, m)][1]
        if nxt is not None and nxt[0] != rank:
            out.append(Message("act", rank, nxt[0], m, nxt[1], c))
    if op.backward is not None:
        m, c = op.backward
        prv = nbrs[(rank, m)][0]
        if prv is not None and prv[0] != rank:
            out.append(Message("grad", rank, prv[0], m, prv[1], c))
    return out


def comm_plan(kind: str, pp: int, chunks: int, rank: int, forward_only: bool = False) -> list:
    """What rank `rank` runs: its ops from `schedule(kind, pp, chunks)`, in order, with the
    `Batch`es of point-to-point messages between them.

    Deadlock freedom: the schedule is timed in unit rounds (every op takes one round and waits for
    its inputs), and both ends of a message post it in the batch of the round in which it was
    produced. Matching batches then carry the same round number on both ranks and each rank posts
    its batches in round order, so even if every send blocks until its receive is posted, the
    batches of the earliest unfinished round can always complete. Per pair of ranks, messages
    are posted in the same order on both ends, as NCCL requires. A message may thus arrive
    before the op that needs it. In forward_only mode gradients are not sent.
    """
    plans = comm_plans(kind, pp, chunks, forward_only)
    return [item for _, item in plans[check_int("rank", rank, 0, stop=len(plans))]]


def comm_plans(kind: str, pp: int, chunks: int, forward_only: bool = False) -> list[list[tuple]]:
    """Every rank's `comm_plan` as (round, item) pairs: round is a `Batch`'s round number, the
    same in the batches that hold the two ends of a message, and None for an `Op`. forward_only:
    the plans of a forward-only step (no backward ops, no gradients sent)."""
    all_ops = schedule(kind, pp, chunks)
    nbrs = _neighbours(kind, pp)
    timed, _ = _timeline(kind, pp, all_ops, lambda rank, op: 1.0, 0.0)
    by_round: list[dict[int, Batch]] = [{} for _ in range(pp)]
    for src in range(pp):
        for t in timed[src]:
            for msg in _produced(src, t.op, nbrs):
                if forward_only and msg.kind == "grad":
                    continue
                by_round[src].setdefault(int(t.end), Batch()).sends.append(msg)
                by_round[msg.dst].setdefault(int(t.end), Batch()).recvs.append(msg)
    plans = []
    for rank in range(pp):
        items = [((t.start, 1), None, t.op) for t in timed[rank]]
        items += [((float(r), 0), r, b) for r, b in by_round[rank].items()]
        plans.append([(r, x) for _, r, x in sorted(items, key=lambda kv: kv[0])])
    return plans


def header_first(batch: Batch, known: set) -> list[list[tuple[str, Message, bool]]]:
    """Split a batch into sub-batches of (direction, message, is_header) while message shapes are
    being learned: the first activation message of each stream (src, src_module) -> dst is
    announced by a small header carrying shapes and dtypes. All headers of the batch travel in a
    sub-batch of their own before the data, on both ends, which keeps the round argument of
    `comm_plan` valid. `known` holds the streams this rank has announced or learned (both ends
    make the same decisions); it is updated in place.
    """
    headers, data = [], []
    for direction, msgs in (("send", batch.sends), ("recv", batch.recvs)):
        for msg in msgs:
            key = (msg.src, msg.dst, msg.src_module)
            if msg.kind == "act" and key not in known:
                known.add(key)
                headers.append((direction, msg, True))
            data.append((direction, msg, False))
    return [sub for sub in (headers, data) if sub]


# --------------------------------------------------------------------------------------------
# simulator


@dataclass(frozen=True)
class TimedOp:
    """An op of `Simulation.ops`, placed on its lane(s) and in time.

    op: the `Op`. lane, stage: where its module sits (`stage_of`), for an "FB" its forward half's.
    b_lane, b_stage: for an "FB", its backward half's; otherwise equal to lane and stage.
    start, end: when the rank runs it.
    """

    op: Op
    lane: int
    stage: int
    b_lane: int
    b_stage: int
    start: float
    end: float


@dataclass
class Simulation:
    """Result of `simulate`.

    ops[r]: rank r's ops in execution order with start and end times.
    total: time from the first op's start to the last op's end.
    busy[r]: the time rank r computes; bubble[r] = total - busy[r].
    peak_activations[r]: the most micro-batch activations rank r holds at once, counting one per
      (micro-batch, stage) from the start of its forward to the end of its backward (to the end
      of the W for a split backward). An "FB" holds its forward's and its backward's at once.
    """

    kind: str
    pp: int
    chunks: int
    ops: list[list[TimedOp]]
    total: float
    busy: list[float]
    bubble: list[float]
    peak_activations: list[int]

    def save_png(self, path: str, title: str | None = None) -> None:
        """Draw the timeline to ``path``: one row per rank, F / B / W / F&B coloured, chunk ids inside;
        ``title`` goes above the line that gives the total and the largest bubble."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle

        colour = {"F": ("#f6b26b", "#e69138"), "B": ("#93c47d", "#6aa84f"),
                  "Bi": ("#d9ead3", "#b6d7a8"), "W": ("#6fa8dc", "#3d85c6")}
        longest = max(len(row) for row in self.ops)
        fig, ax = plt.subplots(figsize=(min(40.0, max(8.0, 0.3 * longest)), 0.6 * self.pp + 1.6))
        for r, row in enumerate(self.ops):
            y = self.pp - 1 - r
            for t in row:
                op, width = t.op, t.end - t.start
                if op.kind == "FB":
                    ax.add_patch(Rectangle((t.start, y + 0.5), width, 0.4, color=colour["F"][op.module % 2], lw=0))
                    ax.add_patch(Rectangle((t.start, y + 0.1), width, 0.4, color=colour["B"][op.b_module % 2], lw=0))
                    label = f"{op.chunk}&{op.b_chunk}"
                else:
                    key = "Bi" if op.kind == "B" and op.split else op.kind
                    ax.add_patch(Rectangle((t.start, y + 0.1), width, 0.8, color=colour[key][op.module % 2], lw=0))
                    label = str(op.chunk)
                ax.add_patch(Rectangle((t.start, y + 0.1), width, 0.8, fill=False, lw=0.5, ec="black"))
                ax.text(t.start + width / 2, y + 0.5, label, ha="center", va="center", fontsize=6)
        ax.set_xlim(0, self.total)
        ax.set_ylim(0, self.pp)
        ax.set_yticks([self.pp - 1 - r + 0.5 for r in range(self.pp)])
        ax.set_yticklabels([f"rank {r}" for r in range(self.pp)])
        ax.set_xlabel("time")
        stats = (f"{self.kind}, {self.pp} ranks, {self.chunks} chunks, total {self.total:.4g}, "
                 f"bubble max {max(self.bubble):.4g}")
        ax.set_title(f"{title}\n{stats}" if title else stats)
        fig.legend(handles=[Patch(color=colour["F"][0], label="F"), Patch(color=colour["B"][0], label="B"),
                            Patch(color=colour["Bi"][0], label="B (input only)"),
                            Patch(color=colour["W"][0], label="W"),
                            Patch(color="white", ec="black", label="F&B: F top, B bottom; darker: module 1")],
                   loc="lower center", ncol=5, fontsize=7, frameon=False)
        fig.tight_layout(rect=(0, 0.3 / fig.get_figheight(), 1, 1))  # the legend's 0.3 inch below the axes
        fig.savefig(path, dpi=150)
        plt.close(fig)


def _per_rank(value, pp: int, name: str) -> list[float]:
    """One finite time >= 0 per rank from a number or a sequence of ``pp`` numbers."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        values = [float(value)] * pp
    elif isinstance(value, (list, tuple)) and all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                                                 for v in value):
        values = [float(v) for v in value]
    else:
        raise TypeError(f"{name}: give a number or a list of numbers (one per rank), got {value!r}")
    if len(values) != pp:
        raise ValueError(f"{name}: give one time for every rank ({pp}) or a single number, got {len(values)}")
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"{name}: times must be finite and >= 0, got {value!r}")
    return values


SYNCS = ("inputs", "batches")


def simulate(kind: str, pp: int, chunks: int, F=1.0, B=2.0, W=1.0, FB=None, latency: float = 0.0, *,
             Bi=None, op_overhead=0.0, sync: str = "inputs") -> Simulation:
    """Time `schedule(kind, pp, chunks)` with dependency tracking.

    kind: "1f1b", "zb1p", "dualpipe" or "dualpipev"; pp: number of ranks (dualpipev runs 2*pp
    stages); chunks: micro-batches per step (dualpipe: half enter at each end).
    F, B, W: times of one stage's forward, full backward (input and weight gradients) and weight
    gradient for one micro-batch. FB: time of an "FB" op (default F + B, no overlap). Bi: time of
    a split ("input only") backward (default B - W). Each of F, B, W, FB, Bi is one number, or a
    sequence of one number per rank (ranks whose stages run at different speeds).
    op_overhead: host/launch gap before each op: an op starts no earlier than op_overhead after
      the end of the previous op on its rank (nothing before a rank's first op). It overlaps with
      waiting for messages: start = max(previous end + op_overhead, messages ready). One number
      or one per rank. Default 0.
    sync: how messages hold ops up.
      "inputs" (default): an op waits only for the messages it needs; each arrives `latency`
        after the end of the op that produced it.
      "batches": each rank walks `comm_plan(kind, pp, chunks, rank)` and every batch of it is a
        rendezvous, as NCCL's batched point-to-point (the stream waits for the whole group, sends
        included): a rank posts a batch when its previous op or batch has finished, and the batch
        completes, for each rank it exchanges with, latency * n after the later of the two posts,
        n being the most messages it carries one way between the two (messages of one size that
        share the link). Nothing after the batch starts on the rank before it completes.
    latency: delay of one message between ranks.
    """
    if sync not in SYNCS:
        raise ValueError(f"sync must be one of {SYNCS}, got {sync!r}")
    ops = schedule(kind, pp, chunks)
    F, B, W = _per_rank(F, pp, "F"), _per_rank(B, pp, "B"), _per_rank(W, pp, "W")
    FB = [f + b for f, b in zip(F, B)] if FB is None else _per_rank(FB, pp, "FB")
    if any(w > b for b, w in zip(B, W)):
        raise ValueError(f"W: the weight gradient is part of the full backward B, so W <= B; got B={B}, W={W}")
    Bi = [b - w for b, w in zip(B, W)] if Bi is None else _per_rank(Bi, pp, "Bi")
    overhead = _per_rank(op_overhead, pp, "op_overhead")
    latency = _per_rank(latency, 1, "latency")[0]

    def duration(rank: int, op: Op) -> float:
        if op.kind in ("F", "W", "FB"):
            return {"F": F, "W": W, "FB": FB}[op.kind][rank]
        return Bi[rank] if op.split else B[rank]

    if sync == "batches":
        plans = [[item if rnd is None else (rnd, item) for rnd, item in plan]
                 for plan in comm_plans(kind, pp, chunks)]
    else:
        plans = ops
    timed, events = _timeline(kind, pp, plans, duration, latency, overhead)
    total = max((row[-1].end for row in timed if row), default=0.0)
    if not math.isfinite(total):
        raise ValueError(f"F, B, W, FB, Bi, latency, op_overhead: the step's time overflows a float (total {total}); "
                         f"use smaller units")
    busy = [sum(t.end - t.start for t in row) for row in timed]
    peaks = []
    for ev in events:
        level = peak = 0
        for _, delta in sorted(ev):  # at equal times frees (-1) come before allocations
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    return Simulation(kind, pp, chunks, timed, total, busy, [total - b for b in busy], peaks)


def _batch_peers(rank: int, batch: Batch) -> dict[int, int]:
    """peer -> the most messages `batch` carries one way between `rank` and that peer."""
    sends: dict[int, int] = {}
    recvs: dict[int, int] = {}
    for m in batch.sends:
        sends[m.dst] = sends.get(m.dst, 0) + 1
    for m in batch.recvs:
        recvs[m.src] = recvs.get(m.src, 0) + 1
    return {p: max(sends.get(p, 0), recvs.get(p, 0)) for p in sends.keys() | recvs.keys()}


def _timeline(kind: str, pp: int, plans: list[list], duration, latency: float, overhead=None):
    """Start and end of every op, and per rank the (time, +1/-1) activation events.

    plans[r]: rank r's ops in order, with (round, Batch) items between them for sync="batches"
    (then the batches carry the latency); without batches an op waits for its own messages.
    """
    where = stage_of(kind, pp)
    nbrs = _neighbours(kind, pp)
    overhead = overhead or [0.0] * pp
    batches = any(isinstance(item, tuple) for plan in plans for item in plan)
    msg_latency = 0.0 if batches else latency
    f_end: dict[tuple[int, int, int], float] = {}  # (rank, module, chunk) -> end of its forward
    b_end: dict[tuple[int, int, int], float] = {}

    def ready(rank: int, op: Op) -> float | None:
        needs = []
        if op.forward is not None:
            m, c = op.forward
            prv = nbrs[(rank, m)][0]
            if prv is not None:
                needs.append((f_end, (prv[0], prv[1], c), prv[0] != rank))
        if op.backward is not None:
            m, c = op.backward
            nxt = nbrs[(rank, m)][1]
            needs.append((b_end, (nxt[0], nxt[1], c), nxt[0] != rank) if nxt is not None
                         else (f_end, (rank, m, c), False))
        if op.kind == "W":
            needs.append((b_end, (rank, op.module, op.chunk), False))
        t = 0.0
        for table, key, remote in needs:
            if key not in table:
                return None
            t = max(t, table[key] + (msg_latency if remote else 0.0))
        return t

    timed: list[list[TimedOp]] = [[] for _ in range(pp)]
    events: list[list[tuple[float, int]]] = [[] for _ in range(pp)]
    free = [0.0] * pp  # when the rank's last op or batch finished
    next_op = [0.0] * pp  # earliest start of the rank's next op (its last op's end + overhead)
    posted: dict[tuple[int, int], float] = {}  # (rank, round) -> when the rank posted that batch
    pos = [0] * pp
    while any(pos[r] < len(plans[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(plans[r]):
                item = plans[r][pos[r]]
                if isinstance(item, tuple):  # (round, Batch): a rendezvous with its peers
                    rnd, batch = item
                    posted.setdefault((r, rnd), free[r])
                    peers = _batch_peers(r, batch)
                    if any((p, rnd) not in posted for p in peers):
                        break
                    free[r] = max(max(posted[(r, rnd)], posted[(p, rnd)]) + latency * n for p, n in peers.items())
                    pos[r] += 1
                    progressed = True
                    continue
                op = item
                t = ready(r, op)
                if t is None:
                    break
                start = max(free[r], next_op[r], t)
                end = free[r] = start + duration(r, op)
                next_op[r] = end + overhead[r]
                lane, stage = where[(r, op.module)]
                b_lane, b_stage = where[(r, op.b_module)] if op.kind == "FB" else (lane, stage)
                timed[r].append(TimedOp(op, lane, stage, b_lane, b_stage, start, end))
                if op.forward is not None:
                    f_end[(r, *op.forward)] = end
                    events[r].append((start, +1))
                if op.backward is not None:
                    b_end[(r, *op.backward)] = end
                    if not (op.kind == "B" and op.split):
                        events[r].append((end, -1))
                if op.kind == "W":
                    events[r].append((end, -1))
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(plans[r][pos[r]]) for r in range(pp) if pos[r] < len(plans[r])}
            raise RuntimeError(f"{kind} with {pp} ranks deadlocks; next items {stuck}")
    return timed, events
