"""Single-process parts of the EP package: layout counting, local expert ids, events."""

import pytest
import torch

from oracles import dispatch_layout as loop_layout  # the layout by Python loops
from smsplit import ptx
from smsplit.ep import EventOverlap, compute_dispatch_layout
from smsplit.ep.layout import check_dispatch_layout, layout_kernel, token_positions, token_positions_kernel
from smsplit.ep.rows import to_local_expert_ids

# the layout functions run torch operations on the CPU and one Triton kernel each on a GPU: both are checked
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def routing(num_tokens, num_experts, num_topk, seed, outside=False):
    """Random top-k ids with -1 entries, a token that goes nowhere, a token that names one expert twice, and
    (``outside``) ids outside [-1, num_experts)."""
    g = torch.Generator().manual_seed(seed)
    topk = torch.rand(num_tokens, num_experts, generator=g).argsort(dim=1)[:, :num_topk]
    topk[torch.rand(num_tokens, num_topk, generator=g) < 0.3] = -1
    if num_tokens > 6:
        topk[5] = -1
        if num_topk > 1:
            topk[6, 1] = topk[6, 0] = 3 % num_experts
    if outside and num_tokens > 9:
        topk[7, 0], topk[9, num_topk - 1] = num_experts, -2
        topk[8, 0] = 2 ** 40 if num_tokens % 2 else -2 ** 40
    return topk


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens,num_ranks,num_experts,num_topk",
                         [(37, 2, 8, 1), (37, 4, 16, 4), (37, 4, 36, 9), (37, 8, 256, 8), (300, 1, 4, 2),
                          (129, 3, 12, 5), (1000, 16, 64, 16), (4099, 2, 256, 8),
                          (100, 24, 48, 8), (70, 64, 128, 6),  # (over 16 ranks: the kernel's smaller token block)
                          (37, 4, 64, 20)])  # (more top-k columns than the kernel takes: torch's way on a GPU too)
def test_layout_matches_loops(device, num_tokens, num_ranks, num_experts, num_topk):
    topk = routing(num_tokens, num_experts, num_topk, seed=num_tokens + num_experts, outside=True)
    num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank = \
        compute_dispatch_layout(topk.to(device), num_experts, num_ranks)
    want_per_rank, want_per_expert, want_in_rank = loop_layout(topk, num_experts, num_ranks)
    assert is_token_in_rank.dtype == torch.bool and is_token_in_rank.tolist() == want_in_rank
    assert num_tokens_per_rank.dtype == torch.int32 and num_tokens_per_expert.dtype == torch.int32
    assert num_tokens_per_rank.tolist() == want_per_rank
    assert num_tokens_per_expert.tolist() == want_per_expert


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens,num_ranks,num_experts,num_topk",
                         [(37, 2, 8, 3), (129, 4, 36, 9), (4099, 8, 256, 8), (0, 2, 8, 2)])
def test_check_dispatch_layout_counts_what_differs(device, num_tokens, num_ranks, num_experts, num_topk):
    topk = routing(num_tokens, num_experts, num_topk, seed=7 * num_tokens + num_ranks, outside=True)
    _, want_per_expert, want_in_rank = loop_layout(topk, num_experts, num_ranks)
    given = torch.tensor(want_in_rank, dtype=torch.bool).view(num_tokens, num_ranks)
    flips = [(t, t % num_ranks) for t in range(0, num_tokens, 11)]
    for t, r in flips:
        given[t, r] = not given[t, r]
    summary = check_dispatch_layout(topk.to(device), num_experts, given.to(device))
    outside = sum(1 for e in topk.flatten().tolist() if e < -1 or e >= num_experts)
    want = given.sum(0).tolist() + want_per_expert + [outside, len(flips)]
    assert summary.dtype == torch.int32 and summary.tolist() == want


@pytest.mark.parametrize("num_experts,num_ranks", [(10, 4), (2, 4), (8, 0)])
def test_layout_needs_experts_split_evenly_over_the_ranks(num_experts, num_ranks):
    with pytest.raises(ValueError, match="must be a positive multiple of num_ranks"):
        compute_dispatch_layout(torch.zeros(3, 2, dtype=torch.int64), num_experts, num_ranks)


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens,num_ranks", [(1, 2), (37, 2), (50, 4), (129, 8), (0, 3), (1500, 5), (700, 16)])
def test_token_positions_count_the_earlier_tokens_to_each_rank(device, num_tokens, num_ranks):
    g = torch.Generator().manual_seed(num_tokens + num_ranks)
    in_rank = torch.rand(num_tokens, num_ranks, generator=g) < 0.6
    if num_tokens > 3:
        in_rank[:, 1] = False  # a rank that gets nothing
        in_rank[2] = True      # a token that goes everywhere
    pos, counts = token_positions(in_rank.to(device), with_counts=True)
    want, earlier = [], [0] * num_ranks  # by a loop over the tokens: each rank's tokens so far
    for row in in_rank.tolist():
        want.append([earlier[r] if row[r] else -1 for r in range(num_ranks)])
        earlier = [n + row[r] for r, n in enumerate(earlier)]
    assert pos.dtype == torch.int32 and pos.is_contiguous() and pos.shape == (num_tokens, num_ranks)
    assert pos.tolist() == want
    assert counts.dtype == torch.int32 and counts.tolist() == in_rank.sum(0).tolist()
    assert token_positions(in_rank.to(device)).tolist() == want


@pytest.mark.compile
def test_layout_kernels_compile_for_hopper():
    layout_signature = {"topk_ptr": "*i64", "given_ptr": "*i1", "in_rank_ptr": "*i1", "counts_ptr": "*i32",
                        "T": "i32", "K": "i32", "R": "i32", "E": "i32", "L": "i32", "CHECK": "constexpr",
                        "BT": "constexpr", "KP": "constexpr", "RP": "constexpr"}
    for check in (False, True):
        text, _ = ptx.compile_for_sm90(layout_kernel, layout_signature,
                                       {"CHECK": check, "BT": 128, "KP": 8, "RP": 8}, num_warps=4)
        assert "atom.global" in text or "red.global" in text  # the per-expert and per-rank counts
    text, _ = ptx.compile_for_sm90(token_positions_kernel, {"in_rank_ptr": "*i1", "positions_ptr": "*i32",
                                                            "counts_ptr": "*i32", "T": "i32", "R": "i32",
                                                            "BT": "constexpr", "RP": "constexpr"},
                                   {"BT": 512, "RP": 8}, num_warps=4)
    assert "st.global" in text
