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

import itertools
import re
import struct
from types import SimpleNamespace

import pytest

from smsplit.pipeline import Batch, Message, Op, comm_plan, comm_plans, schedule, simulate
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
    """Outside F = W = B/2 the table's figure is an approximation: one case where the simulated
    bubble differs from it, so that the docs' caveat stays true (pp=4, F=1, B=2, W=0.5, F&B=2.2:
    table 2.7)."""
    F, B, W, FB = 1.0, 2.0, 0.5, 2.2
    sim = simulate("dualpipe", 4, 8, F, B, W, FB)
    table = (4 / 2 - 1) * (FB + B - 3 * W)
    assert table == pytest.approx(2.7)
    assert abs(max(sim.bubble) - table) > 0.1 * table


def kinds_and_ranks(kinds, ranks):
    """Every (kind, ranks) but DualPipe's odd rank counts, which it refuses
    (`test_dualpipe_refuses_an_odd_number_of_ranks`)."""
    return [(k, r) for k in kinds for r in ranks if not (k == "dualpipe" and r % 2)]


@pytest.mark.parametrize("kind, ranks", kinds_and_ranks(["dualpipe", "dualpipev"], [1, 2, 3, 4, 6, 8]))
@pytest.mark.parametrize("F, B, W", TIMES)
def test_dualpipe_activation_memory(kind, ranks, F, B, W):
    stages = ranks if kind == "dualpipe" else 2 * ranks
    for chunks in chunk_counts(kind, ranks):
        sim = simulate(kind, ranks, chunks, F, B, W, FB=0.8 * (F + B))
        assert max(sim.peak_activations) == stages + 1, (chunks, sim.peak_activations)


@pytest.mark.parametrize("kind, ranks", kinds_and_ranks(["1f1b", "zb1p", "dualpipe", "dualpipev"], [1, 2, 3, 4, 5, 8]))
def test_every_rank_runs_each_forward_backward_once_and_w_after_its_b(kind, ranks):
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
    assert rendezvous_order(per_rank) == [3, 3]  # both ranks stuck at their fourth row


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
        for a, b in itertools.pairwise(row):
            assert a.end <= b.start + 1e-12


def test_save_png(tmp_path):
    path = tmp_path / "timeline.png"
    simulate("dualpipev", 4, 10, 1.0, 2.0, 1.0, 2.5).save_png(str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 600 and height > 200
    simulate("dualpipev", 1, 2).save_png(str(tmp_path / "one_rank.png"), title="a title above the totals")
    assert (tmp_path / "one_rank.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


@pytest.mark.parametrize("ranks", [1, 3, 5])
def test_dualpipe_refuses_an_odd_number_of_ranks(ranks):
    for make in (lambda: schedule("dualpipe", ranks, 2 * ranks), lambda: simulate("dualpipe", ranks, 2 * ranks)):
        with pytest.raises(ValueError, match=f"even number of pipeline ranks, got {ranks}"):
            make()


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


# ---------------------------------------------------------------------------------------------
# op overhead, split-backward time, batch rendezvous (bench/pipeline.py feeds these measured)


def spans(sim):
    return [[(str(t.op), t.start, t.end) for t in row] for row in sim.ops]


def test_op_overhead_hand_checked():
    """1F1B, 2 ranks, 2 micro-batches, F=1, B=2. Rank 0 runs F0 F1 B0 B1, rank 1 F0 B0 F1 B1.
    Without overhead: rank 0 F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]; rank 1 F0 [1,2] B0 [2,4] F1 [4,5]
    B1 [5,7]. With op_overhead=0.5 every op starts >= 0.5 after its rank's previous op, but the
    gap overlaps waiting: rank 0's B0 and B1 wait longer than that for rank 1's gradients."""
    base = simulate("1f1b", 2, 2, F=1.0, B=2.0)
    assert spans(base) == [[("F0.0", 0, 1), ("F0.1", 1, 2), ("B0.0", 4, 6), ("B0.1", 7, 9)],
                           [("F0.0", 1, 2), ("B0.0", 2, 4), ("F0.1", 4, 5), ("B0.1", 5, 7)]]
    sim = simulate("1f1b", 2, 2, F=1.0, B=2.0, op_overhead=0.5)
    assert spans(sim) == [[("F0.0", 0, 1), ("F0.1", 1.5, 2.5), ("B0.0", 4.5, 6.5), ("B0.1", 8.5, 10.5)],
                          [("F0.0", 1, 2), ("B0.0", 2.5, 4.5), ("F0.1", 5, 6), ("B0.1", 6.5, 8.5)]]
    assert sim.total == 10.5 and sim.busy == base.busy  # the gap is bubble, not busy time
    assert sim.bubble == [10.5 - 6, 10.5 - 6]
    # per rank: only rank 1 pays it
    one = simulate("1f1b", 2, 2, F=1.0, B=2.0, op_overhead=[0.0, 0.5])
    assert spans(one)[1] == [("F0.0", 1, 2), ("B0.0", 2.5, 4.5), ("F0.1", 5, 6), ("B0.1", 6.5, 8.5)]
    assert spans(one)[0] == [("F0.0", 0, 1), ("F0.1", 1, 2), ("B0.0", 4.5, 6.5), ("B0.1", 8.5, 10.5)]
    with pytest.raises(ValueError, match="op_overhead: give one time for every rank"):
        simulate("1f1b", 2, 2, op_overhead=[0.1, 0.2, 0.3])


def test_single_rank_overhead_adds_one_gap_per_op():
    """One rank waits for nothing: n ops take n-1 gaps longer."""
    n = len(schedule("dualpipev", 1, 4)[0])
    assert simulate("dualpipev", 1, 4, op_overhead=0.25).total == pytest.approx(
        simulate("dualpipev", 1, 4).total + 0.25 * (n - 1))


def test_split_backward_time_bi():
    """ZB1P on one rank: F0 Bi0 W0 F1 Bi1 W1; a split B takes Bi (default B - W)."""
    assert [str(o) for o in schedule("zb1p", 1, 2)[0]] == ["F0.0", "Bi0.0", "W0.0", "F0.1", "Bi0.1", "W0.1"]
    assert simulate("zb1p", 1, 2, F=1.0, B=3.0, W=1.0).total == 2 * (1 + 2 + 1)
    sim = simulate("zb1p", 1, 2, F=1.0, B=3.0, W=1.0, Bi=1.5)
    assert sim.total == 2 * (1 + 1.5 + 1) and sim.busy == [7.0]


def test_batches_rendezvous_hand_checked():
    """1F1B, 2 ranks, 2 micro-batches, F=1, B=2, latency 0.5. Plans (comm_plans):
    rank 0: F0 [send a0] F1 [send a1] [recv g0] B0 [recv g1] B1
    rank 1: [recv a0] F0 [recv a1] B0 [send g0] F1 B1 [send g1]
    sync="inputs": an op waits for its own messages (+0.5). sync="batches": each batch completes
    0.5 after both ends posted it and holds up the rank that posted it, sender included: rank 1's
    F1 waits for its send of g0, which rank 0 posts at 3 but rank 1 only at 5 (after B0)."""
    plans = comm_plans("1f1b", 2, 2)
    show = [[str(x) if r is None else (r, [m.kind[0] + str(m.chunk) for m in x.sends],
                                       [m.kind[0] + str(m.chunk) for m in x.recvs]) for r, x in plan]
            for plan in plans]
    assert show == [["F0.0", (1, ["a0"], []), "F0.1", (2, ["a1"], []), (3, [], ["g0"]), "B0.0",
                     (5, [], ["g1"]), "B0.1"],
                    [(1, [], ["a0"]), "F0.0", (2, [], ["a1"]), "B0.0", (3, ["g0"], []), "F0.1", "B0.1",
                     (5, ["g1"], [])]]
    inputs = simulate("1f1b", 2, 2, F=1.0, B=2.0, latency=0.5)
    assert spans(inputs) == [[("F0.0", 0, 1), ("F0.1", 1, 2), ("B0.0", 5, 7), ("B0.1", 8, 10)],
                             [("F0.0", 1.5, 2.5), ("B0.0", 2.5, 4.5), ("F0.1", 4.5, 5.5), ("B0.1", 5.5, 7.5)]]
    batches = simulate("1f1b", 2, 2, F=1.0, B=2.0, latency=0.5, sync="batches")
    assert spans(batches) == [[("F0.0", 0, 1), ("F0.1", 1.5, 2.5), ("B0.0", 5.5, 7.5), ("B0.1", 9, 11)],
                              [("F0.0", 1.5, 2.5), ("B0.0", 3, 5), ("F0.1", 5.5, 6.5), ("B0.1", 6.5, 8.5)]]
    # two messages one way in one batch take twice the latency (they share the link)
    two = simulate("dualpipev", 2, 4, latency=0.5, sync="batches")
    assert two.total > simulate("dualpipev", 2, 4, latency=0.5).total
    with pytest.raises(ValueError, match="sync must be one of"):
        simulate("1f1b", 2, 2, sync="ops")


def test_batch_peers_counts_messages_one_way():
    from smsplit.pipeline.schedule import Message, _batch_peers

    b = Batch(sends=[Message("act", 0, 1, 0, 0, 3), Message("grad", 0, 1, 1, 1, 1)],
              recvs=[Message("act", 1, 0, 1, 1, 2), Message("grad", 1, 0, 0, 0, 0), Message("act", 2, 0, 0, 1, 0)])
    assert _batch_peers(0, b) == {1: 2, 2: 1}


@pytest.mark.parametrize("kind, ranks, chunks", [("1f1b", 4, 8), ("zb1p", 3, 6), ("dualpipe", 4, 10),
                                                 ("dualpipev", 2, 8), ("dualpipev", 3, 7)])
def test_batches_never_earlier_than_inputs_and_overhead_respected(kind, ranks, chunks):
    """A batch holds a rank up at least as long as the messages its next ops need (it carries
    them, and waits for the other end), so no op starts earlier than under sync="inputs"."""
    times = {"F": [1.0 + 0.1 * r for r in range(ranks)], "B": 2.1, "W": 0.6, "FB": 2.7}
    for overhead in (0.0, 0.2):
        a = simulate(kind, ranks, chunks, latency=0.3, op_overhead=overhead, **times)
        b = simulate(kind, ranks, chunks, latency=0.3, op_overhead=overhead, sync="batches", **times)
        assert a.busy == pytest.approx(b.busy)
        for ra, rb in zip(a.ops, b.ops):
            assert [t.op for t in ra] == [t.op for t in rb]
            assert all(y.start >= x.start - 1e-9 for x, y in zip(ra, rb))
            assert all(y.start >= x.end + overhead - 1e-9 for x, y in itertools.pairwise(rb))


def expected_messages(kind: str, pp: int, chunks: int, forward_only: bool):
    """Per rank, from its own op list and the lanes of the module docstring: (messages its ops send, messages
    its ops need), each mapped to the op that sends or needs it."""
    down, up = [(r, 0) for r in range(pp)], [(r, 1) for r in reversed(range(pp))]
    prev, nxt = {}, {}
    for path in {"1f1b": [down], "zb1p": [down], "dualpipe": [down, up], "dualpipev": [down + up]}[kind]:
        for a, b in itertools.pairwise(path):
            nxt[a], prev[b] = b, a
    out = []
    for rank, ops in enumerate(schedule(kind, pp, chunks)):
        sends, needs = {}, {}
        for op in ops:
            halves = [("act", op.forward)] + ([] if forward_only else [("grad", op.backward)])
            for kind_, half in halves:
                if half is None:
                    continue
                m, c = half
                to, source = (nxt, prev) if kind_ == "act" else (prev, nxt)
                if (rank, m) in to and to[(rank, m)][0] != rank:
                    dst, dst_module = to[(rank, m)]
                    sends[Message(kind_, rank, dst, m, dst_module, c)] = op
                if (rank, m) in source and source[(rank, m)][0] != rank:
                    src, src_module = source[(rank, m)]
                    needs[Message(kind_, src, rank, src_module, m, c)] = op
        out.append((sends, needs))
    return out


@pytest.mark.parametrize("kind, ranks, chunks", [("dualpipe", 2, 6), ("dualpipe", 4, 8), ("dualpipev", 1, 2),
                                                 ("dualpipev", 3, 7), ("zb1p", 4, 8), ("1f1b", 3, 5)])
@pytest.mark.parametrize("forward_only", [False, True])
def test_comm_plans_carry_each_message_once_between_its_ops(kind, ranks, chunks, forward_only):
    """Each rank's batches send exactly the messages its own ops produce, after the op, and receive exactly
    those its own ops need, before the op; both ends post a message in batches of the same round."""
    plans = comm_plans(kind, ranks, chunks, forward_only)
    round_of = [{}, {}]  # [send / receive][message] -> round of the batch that posts it
    for rank, ((sends, needs), plan) in enumerate(zip(expected_messages(kind, ranks, chunks, forward_only), plans)):
        assert [x for _, x in plan] == comm_plan(kind, ranks, chunks, rank, forward_only)
        assert all((r is None) == isinstance(x, Op) for r, x in plan)
        position = {x: i for i, (_, x) in enumerate(plan) if isinstance(x, Op)}
        posted = [[], []]
        for i, (r, item) in enumerate(plan):
            if r is None:
                continue
            for side, msgs in enumerate((item.sends, item.recvs)):
                for m in msgs:
                    assert m in (sends, needs)[side], (rank, m, "not sent or needed by this rank's ops")
                    posted[side].append(m)
                    round_of[side][m] = r
                    if side == 0:
                        assert position[sends[m]] < i, (rank, m, "sent before the op that produces it")
                    else:
                        assert i < position[needs[m]], (rank, m, "received after the op that needs it")
        assert sorted(posted[0], key=repr) == sorted(sends, key=repr), rank
        assert sorted(posted[1], key=repr) == sorted(needs, key=repr), rank
    assert round_of[0] == round_of[1]
    assert forward_only or any(m.kind == "grad" for m in round_of[0]) or ranks == 1


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(F=-1.0), ValueError, "F: times must be finite and >= 0"),
    (dict(F=float("nan")), ValueError, "F: times must be finite"),
    (dict(latency=-5.0), ValueError, "latency: times must be finite and >= 0"),
    (dict(W=3.0, B=1.0), ValueError, "W <= B"),
    (dict(W=3.0, B=1.0, Bi=0.5), ValueError, "W <= B"),  # also with a measured split backward
    (dict(F=1e308, B=1e308, W=0.0), ValueError, "overflows a float"),
    (dict(F="2"), TypeError, "F: give a number"),
    (dict(F=None), TypeError, "F: give a number"),
    (dict(latency=None), TypeError, "latency: give a number"),
    (dict(B=[1.0, -2.0]), ValueError, "B: times must be finite"),
])
def test_simulate_refuses_impossible_times(kwargs, error, words):
    from smsplit.pipeline.schedule import simulate

    with pytest.raises(error, match=re.escape(words)):
        simulate("zb1p", 2, 4, **kwargs)


def test_pipeline_counts_are_ints_and_the_rank_is_in_range():
    import numpy as np

    from smsplit.pipeline.schedule import comm_plan, simulate

    for pp, chunks, error in ((True, 4, TypeError), (2, 4.0, TypeError), (0, 4, ValueError)):
        with pytest.raises(error):
            simulate("1f1b", pp, chunks)
    assert simulate("dualpipev", np.int64(2), np.int64(4)).total == simulate("dualpipev", 2, 4).total
    for rank in (-1, 2, 1.0):
        with pytest.raises(ValueError, match="rank must be an int in \\[0, 2\\)"):
            comm_plan("dualpipev", 2, 4, rank)
