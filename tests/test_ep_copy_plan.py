"""The host side of NvlinkTransport(bulk="copy_engine"), on a CPU: which rows the copy engines move and where
each token's row lands, for 2 to 8 ranks, against loops over the tokens (the GPU tests check the bytes on 2 H200s);
and the checks a call makes before any launch."""

import inspect
import random

import numpy as np

import pytest
import torch

pytest.importorskip("triton")
from smsplit.ep import nvlink, nvlink_plan  # noqa: E402
from smsplit.ep.copy_engine import CopyEngineTransport  # noqa: E402
from smsplit.ep.transport import EPError  # noqa: E402


def transport(rank, num_ranks, max_tokens, bulk="copy_engine"):
    """An NvlinkTransport with only the host-side state the planning and the argument checks read (no GPU, no
    buffer)."""
    t = object.__new__(nvlink.NvlinkTransport)
    t.rank, t.num_ranks, t.max_tokens, t.bulk = rank, num_ranks, max_tokens, bulk
    t.hidden, t.max_topk = 256, 8
    t.status = torch.zeros(4, dtype=torch.int32)
    t._status_words = t.status.numpy()
    t.device = torch.device("cpu")
    return t


def layout(num_tokens, num_ranks, send_start=None, recv_start=None):
    words = torch.zeros(2 * num_ranks + 2, dtype=torch.int32)
    if send_start is not None:
        words[:num_ranks] = torch.tensor(send_start)
    if recv_start is not None:
        words[num_ranks: 2 * num_ranks + 1] = torch.tensor(recv_start)
    return nvlink.NvlinkLayout(pos=torch.empty(0), layout=words, num_tokens=num_tokens, num_recv_rows=0)


def prefix_rows_by_loop(flags):
    """(m, {token: row}) of `prefix_plan`, token by token: rows 0..m-1 of x are copied (m: the tokens sent), a token
    before m that is not sent is a hole, filled by the first tokens after m that are sent; more than m / 8 holes:
    nothing copied, every row in token order."""
    sent = [t for t, f in enumerate(flags) if f]
    m = len(sent)
    holes = [t for t in range(m) if not flags[t]]
    if len(holes) > m / 8:
        m, holes = 0, []
    rows, after = {}, m
    for t in sent:
        if t < m:
            rows[t] = t
        elif holes:
            rows[t] = holes.pop(0)
        else:
            rows[t], after = after, after + 1
    return m, rows


@pytest.mark.parametrize("density", [0.0, 0.5, 0.9, 0.95, 0.99, 1.0])
def test_prefix_plan_matches_a_loop_and_gives_each_sent_token_one_row(density):
    rng = random.Random(int(density * 100))
    for T in (0, 1, 7, 200):
        flags = [rng.random() < density for _ in range(T)]
        m, pos = nvlink_plan.prefix_plan(np.array(flags, dtype=bool))
        want_m, rows = prefix_rows_by_loop(flags)
        assert m == want_m
        assert pos.tolist() == [rows.get(t, -1) for t in range(T)]
        assert sorted(rows.values()) == list(range(sum(flags)))  # one row per token sent, none past the count


def test_prefix_with_too_many_holes_leaves_the_rows_to_the_sms_in_token_order():
    flags = np.array([t % 2 == 0 for t in range(100)])  # every other token: a copied prefix is half holes
    m, pos = nvlink_plan.prefix_plan(flags)
    assert m == 0 and pos.tolist() == [t // 2 if t % 2 == 0 else -1 for t in range(100)]
    flags = np.ones(100, dtype=bool)
    flags[[3, 50, 99]] = False  # 2 holes in the 97 copied rows: filled by tokens 97 and 98
    m, pos = nvlink_plan.prefix_plan(flags)
    assert m == 97 and pos[97] == 3 and pos[98] == 50 and pos[96] == 96


@pytest.mark.parametrize("num_ranks,rank", [(2, 0), (2, 1), (4, 2), (8, 5)])
def test_dispatch_split_per_peer(num_ranks, rank):
    rng = random.Random(num_ranks * 10 + rank)
    T = 60
    in_rank = torch.tensor([[rng.random() < (0.97 if (d + rank) % 2 else 0.6) for d in range(num_ranks)]
                            for _ in range(T)])
    send_start = [rng.randrange(0, 100) for _ in range(num_ranks)]
    tr = transport(rank, num_ranks, max_tokens=200)
    split = tr._dispatch_split(layout(T, num_ranks, send_start=send_start), in_rank)
    plan = split.plan.tolist()
    copies, fill_from, fill_to = [], T, 0
    for d in range(num_ranks):
        flags = in_rank[:, d].tolist()
        if d == rank:  # own rows: the SMs, token order
            assert plan[d] == 0
            assert split.pos[:, d].tolist() == [sum(flags[:t]) if flags[t] else -1 for t in range(T)]
            continue
        m, rows = prefix_rows_by_loop(flags)
        assert plan[d] == m and split.pos[:, d].tolist() == [rows.get(t, -1) for t in range(T)]
        if m:
            copies.append((d, m, send_start[d]))
            if not all(flags[:m]):
                fill_from = min(fill_from, m)
                fill_to = max(fill_to, 1 + max(t for t, row in rows.items() if t >= m and row < m))
    # the hole fillers lie in [fill_from, fill_to): the kernel stores only those tokens' rows twice
    assert split.copies == copies and plan[num_ranks] == fill_from
    assert plan[num_ranks + 1] == (fill_to if fill_from < T else T)
    assert copies  # the dense peers' prefixes are copied


def test_a_layout_is_planned_once():
    in_rank = torch.ones(10, 2, dtype=torch.bool)
    tr = transport(0, 2, max_tokens=10)
    lay = layout(10, 2, send_start=[0, 10])
    split = tr._dispatch_split(lay, in_rank)
    assert tr._dispatch_split(lay, torch.zeros(10, 2, dtype=torch.bool)) is split  # (a cached dispatch's inputs)


def test_a_layout_past_the_receive_area_is_refused():
    in_rank = torch.ones(10, 2, dtype=torch.bool)
    tr = transport(0, 2, max_tokens=10)
    with pytest.raises(EPError, match="past the end"):
        tr._dispatch_split(layout(10, 2, send_start=[0, 15]), in_rank)  # rows 15..24 of a 20-row area


@pytest.mark.parametrize("num_ranks,rank", [(2, 1), (4, 0), (8, 3)])
@pytest.mark.parametrize("fractions", [(0.4, 0.7, 0.9, 1.0), (0.5, 0.8, 1.0), (1.0,)])
def test_combine_chunks_return_each_sources_rows_as_one_block(num_ranks, rank, fractions):
    rng = random.Random(num_ranks + rank)
    counts = [rng.randrange(0, 30) for _ in range(num_ranks)]
    counts[(rank + 1) % num_ranks] = 0  # a source that sent nothing
    recv_start = [0]
    for n in counts:
        recv_start.append(recv_start[-1] + n)
    chunks, ends = nvlink_plan.combine_split(rank, recv_start, fractions, "cpu")
    assert len(chunks) == len(fractions) and tuple(ends.shape) == (num_ranks, len(fractions))
    for source in range(num_ranks):
        if source == rank:
            assert ends[source].tolist() == [0] * len(fractions)  # own rows are summed from y, never copied
            continue
        n = counts[source]
        assert ends[source].tolist() == [-(-n * round(f * 100) // 100) for f in fractions]  # ceil(f * n)
        # chunk c moves rows [end of c-1, end of c) of this source to the same positions of its slots, in order
        begin = 0
        for c, chunk in enumerate(chunks):
            mine = [(first, k, slot) for s, first, k, slot in chunk if s == source]
            end = int(ends[source, c])
            assert mine == ([(recv_start[source] + begin, end - begin, begin)] if end > begin else [])
            begin = end
        assert begin == n  # every row goes back by copy engine


def test_combine_chunks_follow_each_calls_sm_count():
    """The chunks are derived from the SM count a call passes, and each chunking planned once per layout."""
    tr = transport(1, 2, max_tokens=40)
    lay = layout(0, 2, recv_start=[0, 20, 40])
    for num_sms, fractions in ((8, (0.5, 0.8, 1.0)), (19, (0.5, 0.8, 1.0)), (20, (0.4, 0.7, 0.9, 1.0)),
                               (32, (0.4, 0.7, 0.9, 1.0))):
        assert nvlink_plan.default_combine_chunks(num_sms) == fractions
        chunks, ends = tr._combine_split(lay, num_sms)  # source 0 sent 20 rows
        assert ends[0].tolist() == [round(20 * f) for f in fractions]
        # the layout's receive rows and where each source's rows start follow the ends, where the copied combine
        # kernel reads them
        words = torch.as_strided(ends, (ends.numel() + 4,), (1,))
        assert words[-4:].tolist() == [lay.num_recv_rows, 0, 20, 40]
    assert sorted(key for key in lay.splits) == [("combine", (0.4, 0.7, 0.9, 1.0)), ("combine", (0.5, 0.8, 1.0))]
    assert tr._combine_split(lay, 16) is lay.splits[("combine", (0.5, 0.8, 1.0))]


def test_share_rounding_is_exact_for_decimal_shares():
    assert nvlink_plan.share_of(0.7, 300) == 210  # 0.7 * 300 is 210.00000000000003 in binary
    assert nvlink_plan.share_of(0.7, 301) == 211
    assert nvlink_plan.share_of(1.0, 4096) == 4096 and nvlink_plan.share_of(0.0, 10) == 0


def test_the_sm_count_is_an_argument_of_each_call_not_of_the_transport():
    for cls in (nvlink.NvlinkTransport, CopyEngineTransport):
        assert "num_sms" not in inspect.signature(cls.__init__).parameters, cls
        for method in (cls.dispatch, cls.combine):
            param = inspect.signature(method).parameters["num_sms"]
            assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is inspect.Parameter.empty
    assert inspect.signature(nvlink.NvlinkTransport.plan).parameters["num_sms"].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(nvlink.NvlinkTransport.__init__).parameters) == [
        "self", "group", "device", "max_tokens", "hidden", "max_topk", "timeout_s", "bulk"]


@pytest.mark.parametrize("num_sms", [0, -1, 2.0, True, None, "20"])
def test_a_bad_sm_count_is_refused_before_any_launch(num_sms):
    tr = transport(0, 2, max_tokens=10)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_sms must be an int >= 1"):
        tr.dispatch(x, None, None, None, torch.ones(4, 2, dtype=torch.bool), 4, num_sms=num_sms)
    lay = nvlink.NvlinkLayout(pos=torch.empty(0), layout=torch.zeros(6, dtype=torch.int32), num_tokens=4,
                              num_recv_rows=4)
    with pytest.raises(ValueError, match="num_sms must be an int >= 1"):
        tr.combine(x, None, lay, num_sms=num_sms)
    with pytest.raises(ValueError, match="num_sms must be an int >= 1"):
        tr.plan(lay, torch.ones(4, 2, dtype=torch.bool), num_sms=num_sms)
    assert nvlink_plan.check_num_sms(np.int64(12)) == 12


def copy_engine_transport(rank, num_ranks, max_tokens):
    """A CopyEngineTransport with only the host-side state its argument checks read (no GPU, no buffer)."""
    t = object.__new__(CopyEngineTransport)
    t.rank, t.num_ranks, t.max_tokens, t.num_chunks = rank, num_ranks, max_tokens, 4
    t.hidden, t.max_topk = 256, 8
    t.status = torch.zeros(4, dtype=torch.int32)
    t._status_words = t.status.numpy()
    t.device = torch.device("cpu")
    return t


@pytest.mark.parametrize("make", [transport, copy_engine_transport], ids=["nvlink", "copy_engine"])
def test_scales_come_with_an_fp8_x_only(make):
    """(The copy-engine pack kernel tells FP8 rows by their scales: an FP8 x without them would be moved as BF16.)"""
    tr = make(0, 2, max_tokens=10)
    in_rank = torch.ones(4, 2, dtype=torch.bool)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scales: an FP8 x comes with its fp32 scales"):
        tr.dispatch(x, torch.ones(4, 2), None, None, in_rank, 4, num_sms=2)
    with pytest.raises(ValueError, match="scales: an FP8 x comes with its fp32 scales"):
        tr.dispatch(x.to(torch.float8_e4m3fn), None, None, None, in_rank, 4, num_sms=2)
    with pytest.raises(ValueError, match="quantize: x is already FP8"):
        tr.dispatch(x.to(torch.float8_e4m3fn), torch.ones(4, 2), None, None, in_rank, 4, num_sms=2, quantize=True)


def test_a_bad_bulk_mover_is_refused_before_any_setup():
    with pytest.raises(ValueError, match="bulk must be one of"):
        nvlink.NvlinkTransport(None, torch.device("cpu"), max_tokens=1, hidden=128, bulk="copy engines")
