"""Single-process parts of the EP package: layout counting, local expert ids, events."""

import pytest
import torch

from smsplit.ep import EventOverlap, compute_dispatch_layout
from smsplit.ep.layout import to_local_expert_ids, token_positions


@pytest.mark.parametrize("num_ranks,num_experts,num_topk", [(2, 8, 1), (4, 16, 4), (4, 36, 9), (8, 256, 8)])
def test_layout_matches_loops(num_ranks, num_experts, num_topk):
    g = torch.Generator().manual_seed(num_experts)
    topk = torch.rand(37, num_experts, generator=g).argsort(dim=1)[:, :num_topk]
    topk[torch.rand(37, num_topk, generator=g) < 0.3] = -1
    topk[5] = -1  # a token that goes nowhere
    num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank = compute_dispatch_layout(topk, num_experts,
                                                                                           num_ranks)
    local = num_experts // num_ranks
    want_in_rank = [[any(int(e) >= 0 and int(e) // local == r for e in row) for r in range(num_ranks)]
                    for row in topk]
    assert is_token_in_rank.tolist() == want_in_rank
    assert num_tokens_per_rank.dtype == torch.int32 and num_tokens_per_expert.dtype == torch.int32
    assert num_tokens_per_rank.tolist() == [sum(row[r] for row in want_in_rank) for r in range(num_ranks)]
    assert num_tokens_per_expert.tolist() == [sum(e in row.tolist() for row in topk) for e in range(num_experts)]


def test_layout_of_no_tokens():
    num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank = \
        compute_dispatch_layout(torch.empty(0, 4, dtype=torch.int64), 8, 2)
    assert num_tokens_per_rank.tolist() == [0, 0] and num_tokens_per_expert.tolist() == [0] * 8
    assert is_token_in_rank.shape == (0, 2)


def test_local_expert_ids():
    topk = torch.tensor([[0, 3, 4, 7, -1], [5, 2, -1, 6, 1]])
    assert to_local_expert_ids(topk, 1, 4).tolist() == [[-1, -1, 0, 3, -1], [1, -1, -1, 2, -1]]
    assert to_local_expert_ids(topk, 0, 4).tolist() == [[0, 3, -1, -1, -1], [-1, 2, -1, -1, 1]]


def test_event_overlap_is_a_no_op_without_cuda():
    event = EventOverlap.record_current_stream(torch.device("cpu"))
    assert event.event is None
    event.current_stream_wait()
    with event as entered:
        assert entered is event


@pytest.mark.parametrize("num_tokens,num_ranks", [(1, 2), (37, 2), (50, 4), (129, 8), (0, 3)])
def test_token_positions_count_the_earlier_tokens_to_each_rank(num_tokens, num_ranks):
    g = torch.Generator().manual_seed(num_tokens + num_ranks)
    in_rank = torch.rand(num_tokens, num_ranks, generator=g) < 0.6
    if num_tokens > 3:
        in_rank[:, 1] = False  # a rank that gets nothing
        in_rank[2] = True      # a token that goes everywhere
    pos = token_positions(in_rank)
    want = [[sum(bool(in_rank[u, r]) for u in range(t)) if in_rank[t, r] else -1 for r in range(num_ranks)]
            for t in range(num_tokens)]
    assert pos.dtype == torch.int32 and pos.is_contiguous() and pos.shape == (num_tokens, num_ranks)
    assert pos.tolist() == want
