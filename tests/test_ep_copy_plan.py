"""The host side of NvlinkTransport(bulk="copy_engine"), on a CPU: which rows the copy engines move and where
each token's row lands, for 2 to 8 ranks, against loops over the tokens (the GPU tests check the bytes on 2 H200s)."""

import math
import random
from fractions import Fraction

import numpy as np

import pytest
import torch

pytest.importorskip("triton")
from smsplit.ep import nvlink  # noqa: E402
from smsplit.ep.transport import EPError  # noqa: E402


def transport(rank, num_ranks, max_tokens, copy_share=0.7):
    """An NvlinkTransport with only the host-side state the planning reads (no GPU, no buffer)."""
    t = object.__new__(nvlink.NvlinkTransport)
    t.rank, t.num_ranks, t.max_tokens, t.copy_share = rank, num_ranks, max_tokens, copy_share
    t.combine_copy_share = copy_share
    t.num_sms, t.quantize_tokens_per_step = 2, 4  # FP8 staging launches end on rounds of 8 tokens
    t.combine_chunks = None
    t.e4m3_store_bytes = 16
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


def prefix_rows_by_loop(flags, share):
    """(m, {token: row}) of `_prefix_plan`, token by token: rows 0..m-1 of x are copied, a token before m that is
    not sent is a hole, filled by the first tokens after m that are sent; the rest from row m in token order."""
    sent = [t for t, f in enumerate(flags) if f]
    m = math.ceil(round(share * len(sent), 6))
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


def stage_bounds_by_loop(tokens, chunks, round_tokens):
    """The FP8 staging launches' token bounds, in exact fractions: launch c ends at the whole round nearest to
    c / chunks of the tokens (ties to even), at most at the last token; equal ends merge."""
    ends = []
    for c in range(1, chunks):
        end = min(tokens, round(Fraction(c * tokens, chunks * round_tokens)) * round_tokens)
        if 0 < end < tokens and end not in ends:
            ends.append(end)
    return [0] + ends + [tokens]


@pytest.mark.parametrize("density", [0.0, 0.5, 0.95, 0.99, 1.0])
@pytest.mark.parametrize("share", [1.0, 0.7, 0.3, 0.0])
def test_prefix_plan_matches_a_loop_and_gives_each_sent_token_one_row(density, share):
    rng = random.Random(int(density * 100) + int(share * 10))
    for T in (0, 1, 7, 200):
        flags = [rng.random() < density for _ in range(T)]
        m, pos = nvlink._prefix_plan(np.array(flags, dtype=bool), share)
        want_m, rows = prefix_rows_by_loop(flags, share)
        assert m == want_m
        assert pos.tolist() == [rows.get(t, -1) for t in range(T)]
        assert sorted(rows.values()) == list(range(sum(flags)))  # one row per token sent, none past the count


def test_prefix_with_too_many_holes_leaves_the_rows_to_the_sms_in_token_order():
    flags = np.array([t % 2 == 0 for t in range(100)])  # every other token: a copied prefix is half holes
    m, pos = nvlink._prefix_plan(flags, 1.0)
    assert m == 0 and pos.tolist() == [t // 2 if t % 2 == 0 else -1 for t in range(100)]
    flags = np.ones(100, dtype=bool)
    flags[[3, 50, 99]] = False  # 2 holes in the 97 copied rows: filled by tokens 97 and 98
    m, pos = nvlink._prefix_plan(flags, 1.0)
    assert m == 97 and pos[97] == 3 and pos[98] == 50 and pos[96] == 96


@pytest.mark.parametrize("num_ranks,rank", [(2, 0), (2, 1), (4, 2), (8, 5)])
def test_dispatch_split_per_peer(num_ranks, rank):
    rng = random.Random(num_ranks * 10 + rank)
    T = 60
    in_rank = torch.tensor([[rng.random() < (0.95 if (d + rank) % 2 else 0.6) for d in range(num_ranks)] for _ in range(T)])
    send_start = [rng.randrange(0, 100) for _ in range(num_ranks)]
    for share in (1.0, 0.7, 0.0):
        tr = transport(rank, num_ranks, max_tokens=200, copy_share=share)
        split = tr._dispatch_split(layout(T, num_ranks, send_start=send_start), in_rank)
        copies, fill_from, fill_to = [], T, 0
        for d in range(num_ranks):
            flags = in_rank[:, d].tolist()
            if d == rank:  # own rows: the SMs, token order
                assert split.copied[d] == 0
                assert split.pos[:, d].tolist() == [sum(flags[:t]) if flags[t] else -1 for t in range(T)]
                continue
            m, rows = prefix_rows_by_loop(flags, share)
            assert split.copied[d] == m and split.pos[:, d].tolist() == [rows.get(t, -1) for t in range(T)]
            if m:
                copies.append((d, m, send_start[d]))
                if not all(flags[:m]):
                    fill_from = min(fill_from, m)
                    fill_to = max(fill_to, 1 + max(t for t, row in rows.items() if t >= m and row < m))
        # the hole fillers lie in [fill_from, fill_to): the kernels quantize and store only those tokens twice
        assert split.copies == copies and split.fill_from == fill_from
        assert split.fill_to == (fill_to if fill_from < T else T)
        assert any(m for _, m, _ in copies) == (share > 0)  # the dense peers' prefixes are copied


def test_a_layout_past_the_receive_area_is_refused():
    in_rank = torch.ones(10, 2, dtype=torch.bool)
    tr = transport(0, 2, max_tokens=10)
    with pytest.raises(EPError, match="past the end"):
        tr._dispatch_split(layout(10, 2, send_start=[0, 15]), in_rank)  # rows 15..24 of a 20-row area


@pytest.mark.parametrize("num_ranks,rank", [(2, 1), (4, 0), (8, 3)])
@pytest.mark.parametrize("share,fractions", [(1.0, (0.4, 0.7, 0.9, 1.0)), (0.5, (1.0,)), (0.7, (0.25, 0.5, 1.0))])
def test_combine_chunks_return_each_sources_rows_as_one_block(num_ranks, rank, share, fractions):
    rng = random.Random(num_ranks + rank)
    counts = [rng.randrange(0, 30) for _ in range(num_ranks)]
    counts[(rank + 1) % num_ranks] = 0  # a source that sent nothing
    recv_start = [0]
    for n in counts:
        recv_start.append(recv_start[-1] + n)
    tr = transport(rank, num_ranks, max_tokens=50, copy_share=share)
    tr.combine_chunks = fractions
    chunks, ends = tr._combine_split(layout(0, num_ranks, recv_start=recv_start))
    assert len(chunks) == len(fractions) and tuple(ends.shape) == (num_ranks, len(fractions))
    for source in range(num_ranks):
        if source == rank:
            assert ends[source].tolist() == [0] * len(fractions)  # own rows are summed from y, never copied
            continue
        n = counts[source]
        copied = -(-n * round(share * 10) // 10)  # ceil(share * n)
        assert ends[source].tolist() == [-(-copied * round(f * 100) // 100) for f in fractions]
        # chunk c moves rows [end of c-1, end of c) of this source to the same positions of its slots, in order
        begin = 0
        for c, chunk in enumerate(chunks):
            mine = [(first, k, slot) for s, first, k, slot in chunk if s == source]
            end = int(ends[source, c])
            assert mine == ([(recv_start[source] + begin, end - begin, begin)] if end > begin else [])
            begin = end
        assert begin == copied  # the SMs push positions copied..n-1


def test_combine_chunks_follow_the_comm_sms_until_set():
    tr = transport(1, 2, max_tokens=40, copy_share=1.0)
    lay = layout(0, 2, recv_start=[0, 20, 40])
    for num_sms, fractions in ((8, (0.5, 0.8, 1.0)), (19, (0.5, 0.8, 1.0)), (20, (0.4, 0.7, 0.9, 1.0)),
                               (32, (0.4, 0.7, 0.9, 1.0))):
        tr.num_sms = num_sms
        assert tr.combine_chunks == fractions
        chunks, ends = tr._combine_split(lay)  # source 0 sent 20 rows
        assert ends[0].tolist() == [round(20 * f) for f in fractions]
    tr.combine_chunks = [0.25, 1.0]
    tr.num_sms = 8
    assert tr.combine_chunks == (0.25, 1.0) and tr._combine_split(lay)[1][0].tolist() == [5, 20]
    tr.combine_chunks = None
    assert tr.combine_chunks == (0.5, 0.8, 1.0)


def test_combine_chunks_are_checked():
    tr = transport(0, 2, max_tokens=10)
    lay = layout(0, 2, recv_start=[0, 5, 9])
    for bad in ((), (0.5,), (0.6, 0.3, 1.0), (0.0, 1.0), tuple([0.1 * i for i in range(1, 10)]) + (1.0,)):
        tr.combine_chunks = bad
        with pytest.raises(ValueError, match="combine_chunks"):
            tr._combine_split(lay)


def test_share_rounding_is_exact_for_decimal_shares():
    assert nvlink._share_of(0.7, 300) == 210  # 0.7 * 300 is 210.00000000000003 in binary
    assert nvlink._share_of(0.7, 301) == 211
    assert nvlink._share_of(1.0, 4096) == 4096 and nvlink._share_of(0.0, 10) == 0


@pytest.mark.parametrize("argument,value", [("copy_share", 1.5), ("combine_copy_share", -0.1)])
def test_shares_outside_0_to_1_are_refused_before_any_setup(argument, value):
    with pytest.raises(ValueError, match=argument):
        nvlink.NvlinkTransport(None, torch.device("cpu"), num_sms=1, max_tokens=1, hidden=128, bulk="copy_engine",
                               **{argument: value})


@pytest.mark.parametrize("num_ranks,rank,chunks", [(2, 0, 4), (2, 1, 1), (4, 3, 3), (8, 2, 5)])
@pytest.mark.parametrize("share", [1.0, 0.7])
def test_fp8_staging_chunks_put_each_token_on_the_rows_of_the_bf16_dispatch(num_ranks, rank, chunks, share):
    rng = random.Random(num_ranks * 100 + rank)
    T = 57
    # dense peers (a copied prefix with a few holes) and sparse ones (too many holes: token order)
    in_rank = torch.tensor([[rng.random() < (0.96 if (d + rank) % 2 else 0.6) for d in range(num_ranks)]
                            for _ in range(T)])
    send_start = [rng.randrange(0, 100) for _ in range(num_ranks)]
    tr = transport(rank, num_ranks, max_tokens=200, copy_share=share)
    tr.stage_chunks = chunks
    plan = tr._stage_split(layout(T, num_ranks, send_start=send_start), in_rank)
    # the launches stage the tokens up to the longest copied prefix, rounded up to whole rounds of 8 tokens; the
    # dispatch's last launch pushes the later tokens' rows itself
    longest = max(prefix_rows_by_loop(in_rank[:, d].tolist(), share)[0] for d in range(num_ranks) if d != rank)
    staged_end = min(T, -(-longest // 8) * 8)
    bounds = stage_bounds_by_loop(staged_end, chunks, 8) if staged_end else [0]
    assert [(a, b) for a, b, _ in plan] == list(zip(bounds, bounds[1:]))
    for peer in range(num_ranks):
        if peer == rank:
            assert all(p != peer for _, _, copies in plan for p, _, _ in copies)  # own rows: in place, never staged
            continue
        flags = in_rank[:, peer].tolist()
        m, rows = prefix_rows_by_loop(flags, share)
        fillers = {t for t, r in rows.items() if t >= m and r < m}
        copied_rows = set()
        for a, b, copies in plan:  # a chunk's runs: rows a .. min(b, m)-1 (holes too), then its later tokens' rows
            later = sorted(rows[t] for t in range(a, b) if flags[t] and t not in fillers and rows[t] >= m)
            want = [(send_start[peer] + a, min(b, m) - a)] if a < m else []
            want += [(send_start[peer] + later[0], len(later))] if later else []
            assert [(first, n) for p, first, n in copies if p == peer] == want
            assert later == list(range(later[0], later[0] + len(later))) if later else True
            mine = [r - send_start[peer] for p, first, n in copies if p == peer for r in range(first, first + n)]
            assert not copied_rows & set(mine)  # no row copied twice
            copied_rows |= set(mine)
        # every row of a staged token is copied once from staging (the fillers' rows, staged by the first launch,
        # too); the later tokens' rows are not
        assert copied_rows == {rows[t] for t in range(T) if flags[t] and (t < staged_end or t in fillers)}
        assert {rows[t] for t in fillers} == {t for t in range(m) if not flags[t]}


@pytest.mark.parametrize("tokens,chunks,round_tokens", [(4096, 4, 320), (4096, 4, 384), (4096, 3, 512), (57, 4, 16),
                                                       (57, 4, 64), (1000, 7, 16), (320, 4, 320)])
def test_fp8_staging_launches_end_on_whole_rounds_but_the_last(tokens, chunks, round_tokens):
    bounds = nvlink._stage_bounds(tokens, chunks, round_tokens)
    assert bounds == stage_bounds_by_loop(tokens, chunks, round_tokens)
    assert bounds[0] == 0 and bounds[-1] == tokens and bounds == sorted(set(bounds))
    assert all(b % round_tokens == 0 for b in bounds[1:-1])  # only the last launch has a partial round
    assert len(bounds) - 1 == min(chunks, -(-tokens // round_tokens))  # as many launches as asked, or as rounds
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert max(sizes) - min(sizes[:-1] or sizes) <= 2 * round_tokens  # near equal
    if (tokens, chunks, round_tokens) == (4096, 4, 320):  # 12.8 rounds: 3, 3, 4 and 2.8 of them, 13 in all
        assert bounds == [0, 960, 1920, 3200, 4096]


def test_fp8_staging_refuses_a_bad_chunk_count_and_rows_past_the_area():
    in_rank = torch.ones(10, 2, dtype=torch.bool)
    tr = transport(0, 2, max_tokens=10)
    tr.stage_chunks = 0
    with pytest.raises(ValueError, match="stage_chunks"):
        tr._stage_split(layout(10, 2, send_start=[0, 0]), in_rank)
    tr.stage_chunks = 2
    with pytest.raises(EPError, match="past the end"):
        tr._stage_split(layout(10, 2, send_start=[0, 15]), in_rank)


def test_quantized_rows_by_is_checked_before_any_launch():
    tr = transport(0, 2, max_tokens=10)
    tr.hidden, tr.max_topk, tr.bulk = 256, 8, "copy_engine"
    tr.quantized_rows_by = "copy engines"
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="quantized_rows_by must be one of"):
        tr.dispatch(x, None, None, None, torch.ones(4, 2, dtype=torch.bool), 4, quantize=True)
    tr.quantized_rows_by, tr.e4m3_store_bytes = "sm", 12
    with pytest.raises(ValueError, match="e4m3_store_bytes must be 8 or 16"):
        tr.dispatch(x, None, None, None, torch.ones(4, 2, dtype=torch.bool), 4, quantize=True)
    # staged FP8 rows keep their row numbers on each peer, which start at different offsets per peer: with more
    # than 2 ranks two peers' rows would share staging rows (rank 0's rows start at 0 on every peer)
    tr = transport(0, 4, max_tokens=10)
    tr.hidden, tr.max_topk, tr.bulk, tr.quantized_rows_by = 256, 8, "copy_engine", "copy_engine"
    with pytest.raises(ValueError, match="overlap in the staging area with more than 2 ranks"):
        tr.dispatch(x, None, None, None, torch.ones(4, 4, dtype=torch.bool), 4, quantize=True)
