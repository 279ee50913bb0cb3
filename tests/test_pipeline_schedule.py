"""Schedules, the p2p plan the runtime walks, and the simulator against the bubble table of the design notes (../shared/DESIGN.md).

Conventions (DeepSeek-V3 report, Table 2; DualPipe README):
  F, B, W: time of one stage's forward, full backward (input + weight gradients), weight-gradient
    part of one micro-batch; a split ("input only") backward takes B - W. F&B: one overlapped pair.
  bubble: per rank, step time minus the rank's compute time; the table's figure is the largest
    over ranks.
  activation memory: the most (micro-batch, stage) activations a rank holds at once, counted from
    the forward's start to the end of the backward that frees them (the W for a split backward);
    an F&B holds its forward's and its backward's at once. 1F1B, ZB1P, DualPipe: PP, PP, PP+1.
  PP in the table is the number of stages. For DualPipeV the README counts PP stages on PP/2
    devices; `simulate(kind, pp, ...)` takes the number of ranks, so DualPipeV with R ranks is the
    table's PP = 2R: bubble (R-1)(F&B+B-3W), activations 2R+1.
"""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest

from smsplit.pipeline import Batch, Op, comm_plan, schedule, simulate
from smsplit.pipeline.schedule import check_chunks, header_first

PPS = [2, 4, 6, 8]
TIMES = [(1.0, 2.0, 1.0), (1.0, 2.0, 0.5), (1.0, 1.0, 0.3), (2.0, 3.0, 0.7)]


def chunk_counts(kind: str, pp: int) -> list[int]:
    low = 2 * pp if kind.startswith("dual") else pp
    return sorted({low, low + 2, 3 * low, 20 if pp <= 8 else low})


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("F, B, W", TIMES)
def test_1f1b_bubble_and_memory(pp, F, B, W):
    for chunks in chunk_counts("1f1b", pp):  # chunks >= pp: enough to fill the pipe
        sim = simulate("1f1b", pp, chunks, F, B, W)
        assert max(sim.bubble) == pytest.approx((pp - 1) * (F + B))
        assert max(sim.peak_activations) == pp == sim.peak_activations[0]
        assert sim.total == pytest.approx((chunks + pp - 1) * (F + B))


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("F, B, W", TIMES)
def test_zb1p_bubble_and_memory(pp, F, B, W):
    """ZB-H1 with W <= F and W <= B - W (weight grads never the longer half), as in all TIMES."""
    for chunks in chunk_counts("zb1p", pp):
        sim = simulate("zb1p", pp, chunks, F, B, W)
        assert max(sim.bubble) == pytest.approx((pp - 1) * (F + B - 2 * W))
        assert max(sim.peak_activations) == pp


@pytest.mark.parametrize("kind", ["dualpipe", "dualpipev"])
@pytest.mark.parametrize("ranks", [2, 4, 6, 8])
@pytest.mark.parametrize("F", [1.0, 1.7])
@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_dualpipe_bubble_matches_table(kind, ranks, F, overlap):
    """(PP/2-1)(F&B+B-3W) holds exactly, for every chunk count allowed, when F = W = B/2 (the
    zero-bubble papers' balance: forward = input backward = weight backward) and
    B <= F&B <= F+B (F&B between "the forward hides entirely" and "no overlap")."""
    B, W = 2 * F, F
    FB = B + overlap * F
    stages = ranks if kind == "dualpipe" else 2 * ranks
    for chunks in chunk_counts(kind, ranks):
        sim = simulate(kind, ranks, chunks, F, B, W, FB)
        assert max(sim.bubble) == pytest.approx((stages / 2 - 1) * (FB + B - 3 * W)), chunks


def test_dualpipe_bubble_formula_is_not_exact_for_other_balances():
    """Outside F = W = B/2 the table's figure is an approximation; record one case so that the
    docs' caveat stays true (pp=4, F=1, B=2, W=0.5, F&B=2.2: simulated 2.2, table 2.7)."""
    F, B, W, FB = 1.0, 2.0, 0.5, 2.2
    sim = simulate("dualpipe", 4, 8, F, B, W, FB)
    table = (4 / 2 - 1) * (FB + B - 3 * W)
    assert max(sim.bubble) == pytest.approx(2.2)
    assert max(sim.bubble) != pytest.approx(table)


@pytest.mark.parametrize("kind", ["dualpipe", "dualpipev"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("F, B, W", TIMES)
def test_dualpipe_activation_memory(kind, ranks, F, B, W):
    if kind == "dualpipe" and ranks % 2:
        pytest.skip("DualPipe needs an even number of ranks")
    stages = ranks if kind == "dualpipe" else 2 * ranks
    for chunks in chunk_counts(kind, ranks):
        sim = simulate(kind, ranks, chunks, F, B, W, FB=0.8 * (F + B))
        assert max(sim.peak_activations) == stages + 1, (chunks, sim.peak_activations)


@pytest.mark.parametrize("kind", ["1f1b", "zb1p", "dualpipe", "dualpipev"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 8])
def test_every_rank_runs_each_forward_backward_once_and_w_after_its_b(kind, ranks):
    if kind == "dualpipe" and ranks % 2:
        pytest.skip("DualPipe needs an even number of ranks")
    for chunks in chunk_counts(kind, ranks) + [2 * ranks + 1]:
        if kind == "dualpipe" and chunks % 2:
            continue
        per_lane = chunks // 2 if kind == "dualpipe" else chunks
        modules = (0,) if kind in ("1f1b", "zb1p") else (0, 1)
        for ops in schedule(kind, ranks, chunks):
            fwd = [op.forward for op in ops if op.forward]
            bwd = [op.backward for op in ops if op.backward]
            want = sorted((m, c) for m in modules for c in range(per_lane))
            assert sorted(fwd) == want and sorted(bwd) == want
            for m in modules:  # each module runs its chunks in order
                assert [c for mm, c in fwd if mm == m] == list(range(per_lane))
                assert [c for mm, c in bwd if mm == m] == list(range(per_lane))
            splits = [i for i, op in enumerate(ops) if op.kind == "B" and op.split]
            ws = [i for i, op in enumerate(ops) if op.kind == "W"]
            assert len(splits) == len(ws)
            for b, w in zip(splits, ws):  # FIFO: the k-th W completes the k-th split B
                assert b < w and (ops[b].module, ops[b].chunk) == (ops[w].module, ops[w].chunk)


def _torch_dualpipev(ranks: int, chunks: int, rank: int) -> list[tuple]:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, "ScheduleDualPipeV"):
        pytest.skip("this torch has no ScheduleDualPipeV")
    cls = schedules.ScheduleDualPipeV
    actions = cls._calculate_single_rank_operations(
        SimpleNamespace(pp_group_size=ranks, _n_microbatches=chunks), rank)

    def one(a):
        module = 0 if a.stage_index == rank else 1
        kind = {"FORWARD": ("F", False), "BACKWARD_INPUT": ("B", True), "FULL_BACKWARD": ("B", False),
                "BACKWARD_WEIGHT": ("W", False)}[a.computation_type.name]
        return kind[0], module, a.microbatch_index, kind[1]

    out = []
    for a in actions:
        if a.sub_actions:
            f, b = (one(x) for x in a.sub_actions)
            out.append(("FB", f[1], f[2], b[1], b[2], False))
        else:
            k, m, c, split = one(a)
            out.append((k, m, c, -1, -1, split))
    return out


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
def test_dualpipev_ops_equal_torch_schedule_dualpipev(ranks):
    """Independent reference: torch.distributed.pipelining's port of DeepSeek's DualPipeV."""
    for chunks in (2 * ranks, 2 * ranks + 1, 3 * ranks + 2):
        for rank, ops in enumerate(schedule("dualpipev", ranks, chunks)):
            ours = [(o.kind, o.module, o.chunk, o.b_module, o.b_chunk, o.split) for o in ops]
            assert ours == _torch_dualpipev(ranks, chunks, rank), (chunks, rank)


def test_dualpipe_ranks_mirror_each_other():
    """DualPipe's second half of ranks runs the first half's op list with the modules swapped."""
    for pp in (2, 4, 6, 8):
        ops = schedule("dualpipe", pp, 3 * pp if (3 * pp) % 2 == 0 else 3 * pp + 1)
        for r in range(pp // 2):
            swap = [Op(o.kind, 1 - o.module, o.chunk, 1 - o.b_module if o.kind == "FB" else -1,
                       o.b_chunk, o.split) for o in ops[r]]
            assert swap == ops[pp - 1 - r]


# ---------------------------------------------------------------------------------------------
# the p2p plan


def rendezvous_order(per_rank_batches: list[list[list[tuple]]]):
    """Run per-rank batch sequences under the strictest p2p semantics (NCCL's worst case): a
    batch completes only when every message in it has been posted at both ends; a rank posts its
    next batch only after its current one completed. Returns None if all complete, else the
    stuck batch index per rank. Also checks that both ends post each pair's messages in the same
    order (NCCL matches p2p between two ranks by posting order, not by tag)."""
    sent, received = {}, {}
    for bs in per_rank_batches:
        for b in bs:
            for direction, msg, is_header in b:
                (sent if direction == "send" else received).setdefault((msg.src, msg.dst), []).append(
                    (msg, is_header))
    assert sent == received, "the two ends of a pair post messages in different orders"
    ids = []
    for bs in per_rank_batches:
        seen, rows = {}, []
        for b in bs:
            row = set()
            for direction, msg, _ in b:
                key = (direction, msg.src, msg.dst)
                seen[key] = seen.get(key, 0) + 1
                row.add((direction, msg.src, msg.dst, seen[key]))
            rows.append(row)
        ids.append(rows)
    head = [0] * len(ids)
    posted = set().union(*(rows[0] for rows in ids if rows))
    while True:
        moved = False
        for r, rows in enumerate(ids):
            if head[r] < len(rows) and all(
                    ("recv" if d == "send" else "send", s, t, i) in posted for d, s, t, i in rows[head[r]]):
                head[r] += 1
                moved = True
                if head[r] < len(rows):
                    posted |= rows[head[r]]
        if all(head[r] == len(rows) for r, rows in enumerate(ids)):
            return None
        if not moved:
            return head


def plan_batches(kind, ranks, chunks, forward_only, learning):
    out = []
    for rank in range(ranks):
        known, rows = set(), []
        for item in comm_plan(kind, ranks, chunks, rank, forward_only):
            if isinstance(item, Batch):
                if learning:
                    rows += header_first(item, known)
                else:
                    rows.append([("send", m, False) for m in item.sends] + [("recv", m, False) for m in item.recvs])
        out.append(rows)
    return out


@pytest.mark.parametrize("kind, ranks", [("dualpipe", 2), ("dualpipe", 4), ("dualpipe", 6), ("dualpipe", 8),
                                         ("dualpipev", 1), ("dualpipev", 2), ("dualpipev", 3),
                                         ("dualpipev", 4), ("dualpipev", 5), ("dualpipev", 8)])
def test_comm_plan_cannot_deadlock(kind, ranks):
    """For training and forward-only steps, and for the first step (headers announce shapes)."""
    for chunks in chunk_counts(kind, ranks) + [2 * ranks + 1]:
        if kind == "dualpipe" and chunks % 2:
            continue
        for forward_only in (False, True):
            for learning in (False, True):
                stuck = rendezvous_order(plan_batches(kind, ranks, chunks, forward_only, learning))
                assert stuck is None, (chunks, forward_only, learning, stuck)


def test_rendezvous_checker_catches_a_naive_plan():
    """Negative control: "send right after the op, receive right before the op that needs it"
    deadlocks DualPipe on 2 ranks (both ranks block on a send the other receives later)."""
    per_rank = []
    for rank in range(2):
        plan = comm_plan("dualpipe", 2, 4, rank)
        ops = [x for x in plan if isinstance(x, Op)]
        recvs_for = {}
        for item in plan:
            if isinstance(item, Batch):
                for m in item.recvs:
                    recvs_for[(m.kind, m.dst_module, m.chunk)] = m
        sends = {}
        for item in plan:
            if isinstance(item, Batch):
                for m in item.sends:
                    sends.setdefault((m.kind, m.src_module, m.chunk), m)
        rows, pending = [], []
        for op in ops:
            need = []
            if op.forward and ("act", *op.forward) in recvs_for:
                need.append(recvs_for[("act", *op.forward)])
            if op.backward and ("grad", *op.backward) in recvs_for:
                need.append(recvs_for[("grad", *op.backward)])
            rows.append([("send", m, False) for m in pending] + [("recv", m, False) for m in need])
            pending = [m for k, m in sends.items() if (op.forward and k == ("act", *op.forward))
                       or (op.backward and k == ("grad", *op.backward))]
        rows.append([("send", m, False) for m in pending])
        per_rank.append(rows)
    try:
        stuck = rendezvous_order(per_rank)
    except AssertionError:
        stuck = "order mismatch"
    assert stuck is not None


@pytest.mark.parametrize("kind, ranks, chunks", [("dualpipe", 4, 10), ("dualpipev", 3, 7)])
def test_runtime_plan_walks_exactly_the_schedule(kind, ranks, chunks):
    for rank in range(ranks):
        for forward_only in (False, True):
            plan = comm_plan(kind, ranks, chunks, rank, forward_only)
            assert [x for x in plan if isinstance(x, Op)] == schedule(kind, ranks, chunks)[rank]


# ---------------------------------------------------------------------------------------------
# simulator odds and ends


def test_latency_delays_only_cross_rank_dependencies():
    base = simulate("dualpipev", 1, 4)
    assert simulate("dualpipev", 1, 4, latency=5.0).total == base.total  # one rank: no messages
    slow = simulate("1f1b", 4, 8, F=1.0, latency=0.5)
    assert slow.ops[3][0].start == pytest.approx(3 * (1.0 + 0.5))  # first forward reaches rank 3
    assert slow.total > simulate("1f1b", 4, 8, F=1.0).total


def test_timeline_ops_do_not_overlap_and_respect_order():
    sim = simulate("dualpipe", 4, 12, 1.0, 2.0, 0.7, 2.4)
    for r, row in enumerate(sim.ops):
        assert [t.op for t in row] == schedule("dualpipe", 4, 12)[r]
        for a, b in zip(row, row[1:]):
            assert a.end <= b.start + 1e-12


def test_save_png(tmp_path):
    path = tmp_path / "timeline.png"
    simulate("dualpipev", 4, 10, 1.0, 2.0, 1.0, 2.5).save_png(str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 600 and height > 200


@pytest.mark.parametrize("kind, pp, chunks, words", [
    ("dualpipe", 3, 6, "even number of pipeline ranks"),
    ("dualpipe", 4, 7, "try 8"),
    ("dualpipe", 4, 6, "try 8"),
    ("dualpipev", 3, 5, "num_chunks >= 2*ranks = 6"),
    ("pipedream", 2, 4, "unknown schedule kind"),
])
def test_check_chunks_messages(kind, pp, chunks, words):
    with pytest.raises(ValueError, match=words.replace("*", r"\*")):
        check_chunks(kind, pp, chunks)


def test_per_rank_op_times_shift_the_bubble_to_the_faster_rank():
    same = simulate("dualpipev", 2, 8, F=1.0, B=2.0, W=1.0)
    per_rank = simulate("dualpipev", 2, 8, F=[1.0, 1.0], B=[2.0, 2.0], W=[1.0, 1.0])
    assert per_rank.bubble == pytest.approx(same.bubble) and per_rank.total == pytest.approx(same.total)
    skewed = simulate("dualpipev", 2, 8, F=[0.8, 1.0], B=[1.6, 2.0], W=[0.8, 1.0])
    # rank 0 does the same ops faster: its busy time drops, and it waits for rank 1
    assert skewed.busy[0] < skewed.busy[1]
    assert skewed.bubble[0] > skewed.bubble[1]
    with pytest.raises(ValueError, match="one time for every rank"):
        simulate("dualpipev", 2, 8, F=[1.0, 1.0, 1.0])
