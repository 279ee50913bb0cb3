"""The host side of NvlinkTransport(bulk="copy_engine"), on a CPU: which runs of rows the copy engines move, for
2 to 8 ranks, against loops over the tokens (the GPU tests check the bytes on 2 H200s)."""

import random

import pytest
import torch

pytest.importorskip("triton")
from smsplit.ep import nvlink  # noqa: E402
from smsplit.ep.transport import EPError  # noqa: E402


def transport(rank, num_ranks, max_tokens, copy_share=0.7):
    """An NvlinkTransport with only the host-side state the planning reads (no GPU, no buffer)."""
    t = object.__new__(nvlink.NvlinkTransport)
    t.rank, t.num_ranks, t.max_tokens, t.copy_share = rank, num_ranks, max_tokens, copy_share
    t.status = torch.zeros(4, dtype=torch.int32)
    t.device = torch.device("cpu")
    return t


def layout(num_tokens, num_ranks, send_start=None, recv_start=None):
    words = torch.zeros(2 * num_ranks + 2, dtype=torch.int32)
    if send_start is not None:
        words[:num_ranks] = torch.tensor(send_start)
    if recv_start is not None:
        words[num_ranks: 2 * num_ranks + 1] = torch.tensor(recv_start)
    return nvlink.NvlinkLayout(pos=torch.empty(0), layout=words, num_tokens=num_tokens, num_recv_rows=0)


def runs_by_loop(flags):
    """[(first, length)] of the maximal runs of True in a list."""
    runs, t = [], 0
    while t < len(flags):
        if flags[t]:
            first = t
            while t < len(flags) and flags[t]:
                t += 1
            runs.append((first, t - first))
        else:
            t += 1
    return runs


@pytest.mark.parametrize("num_ranks,rank", [(2, 0), (2, 1), (4, 2), (8, 5)])
def test_dispatch_runs_and_rows(num_ranks, rank):
    rng = random.Random(num_ranks * 10 + rank)
    T = 60
    in_rank = torch.tensor([[rng.random() < 0.7 for _ in range(num_ranks)] for _ in range(T)])
    send_start = [rng.randrange(0, 100) for _ in range(num_ranks)]
    tr = transport(rank, num_ranks, max_tokens=200)
    lay = layout(T, num_ranks, send_start=send_start)
    plan = tr._copy_plan(lay, in_rank)
    assert [peer for peer, _ in plan] == [d for d in range(num_ranks) if d != rank]
    for peer, runs in plan:
        expected, row = [], send_start[peer]
        for first, n in runs_by_loop(in_rank[:, peer].tolist()):
            expected.append((first, n, row))
            row += n
        assert runs == expected
    # the copy engines take the tokens before ceil(share * T); the SMs the rest
    for share in (1.0, 0.7, 0.5, 0.0):
        tr.copy_share = share
        copies, sm_from = tr._dispatch_split(lay, in_rank)
        assert sm_from == -(-T * round(share * 10) // 10)
        for peer in range(num_ranks):
            if peer == rank:
                continue
            moved = [t for p, first, n, _ in copies if p == peer for t in range(first, first + n)]
            assert moved == [t for t in range(sm_from) if in_rank[t, peer]]
            for p, first, n, row in copies:  # a truncated run keeps its rows
                if p == peer:
                    assert row == send_start[peer] + int(in_rank[:first, peer].sum())


def test_too_many_runs_leave_the_rows_to_the_sms():
    T = 2 * (nvlink.MAX_COPY_RUNS + 1)
    in_rank = torch.zeros(T, 2, dtype=torch.bool)
    in_rank[:, 0] = True
    in_rank[::2, 1] = True  # MAX_COPY_RUNS + 1 runs of one token to rank 1
    tr = transport(0, 2, max_tokens=T)
    lay = layout(T, 2, send_start=[0, 0])
    assert tr._copy_plan(lay, in_rank) == []
    assert tr._dispatch_split(lay, in_rank) == ([], 0)
    in_rank[-2:, 1] = False  # one run fewer: the copy engines take them
    assert len(tr._copy_plan(layout(T, 2, send_start=[0, 0]), in_rank)[0][1]) == nvlink.MAX_COPY_RUNS


def test_a_layout_past_the_receive_area_is_refused():
    in_rank = torch.ones(10, 2, dtype=torch.bool)
    tr = transport(0, 2, max_tokens=10)
    with pytest.raises(EPError, match="past the end"):
        tr._copy_plan(layout(10, 2, send_start=[0, 15]), in_rank)  # rows 15..24 of a 20-row area


@pytest.mark.parametrize("num_ranks,rank", [(2, 1), (4, 0), (8, 3)])
def test_combine_runs_and_slots(num_ranks, rank):
    rng = random.Random(num_ranks + rank)
    counts = [rng.randrange(0, 30) for _ in range(num_ranks)]
    recv_start = [0]
    src = []
    for n in counts:  # each source's rows: increasing token indices with gaps
        tokens = sorted(rng.sample(range(50), n))
        src += tokens
        recv_start.append(recv_start[-1] + n)
    tr = transport(rank, num_ranks, max_tokens=50)
    lay = layout(0, num_ranks, recv_start=recv_start)
    recv_src = torch.tensor(src + [-1] * 7, dtype=torch.int32)  # padding rows after the received ones
    plan = tr._combine_plan(lay, recv_src)
    assert [s for s, _ in plan] == [s for s in range(num_ranks) if s != rank]
    for source, runs in plan:
        rows = list(range(recv_start[source], recv_start[source + 1]))
        expected, r = [], 0
        while r < len(rows):  # a run: consecutive rows whose source tokens are consecutive
            first = r
            while r + 1 < len(rows) and src[rows[r + 1]] == src[rows[r]] + 1:
                r += 1
            r += 1
            expected.append((rows[first], r - first, src[rows[first]]))
        assert runs == expected
    tr.copy_share = 0.5
    copies, ends = tr._combine_split(lay, recv_src)
    for source in range(num_ranks):
        if source == rank:
            assert int(ends[source]) == 0  # own rows are summed from y, never copied
            continue
        n = counts[source]
        assert int(ends[source]) == recv_start[source] + -(-n // 2)
        moved = [row for s, first, k, _ in copies if s == source for row in range(first, first + k)]
        assert moved == list(range(recv_start[source], int(ends[source])))


def test_share_rounding_is_exact_for_decimal_shares():
    assert nvlink._share_of(0.7, 300) == 210  # 0.7 * 300 is 210.00000000000003 in binary
    assert nvlink._share_of(0.7, 301) == 211
    assert nvlink._share_of(1.0, 4096) == 4096 and nvlink._share_of(0.0, 10) == 0
