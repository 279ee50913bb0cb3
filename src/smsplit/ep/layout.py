"""Dispatch layout (who sends what where), the dispatch handle, and the byte sizes every transport shares.

A dispatch moves each token to every rank that holds one of its top-k experts. Experts are split evenly and
contiguously: rank `r` holds experts `[r * num_local_experts, (r + 1) * num_local_experts)`. On every rank, the
received tokens are ordered by source rank, then by token index on the source rank.
"""

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

SCALE_BLOCK = 128  # FP8 values per fp32 scale
ROW_ALIGN = 16     # bytes; every per-token message is padded to this


def compute_dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) \
        -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    Count tokens per rank and per expert from the top-k choices (no communication).

    Arguments:
        topk_idx: `[num_tokens, num_topk]` with `torch.int64`, expert ids in `[0, num_experts)`, `-1` for none.
        num_experts: the number of experts, a multiple of `num_ranks`.
        num_ranks: the number of ranks in the group.

    Returns:
        num_tokens_per_rank: `[num_ranks]` with `torch.int32`, tokens that go to each rank (a token counts once per
            rank, however many of its experts that rank holds).
        num_tokens_per_expert: `[num_experts]` with `torch.int32`, tokens that chose each expert.
        is_token_in_rank: `[num_tokens, num_ranks]` with `torch.bool`.
    """
    num_tokens = topk_idx.size(0)
    chosen = topk_idx >= 0
    # Column `num_experts` collects the -1 entries and is dropped.
    counts = torch.zeros(num_tokens, num_experts + 1, dtype=torch.int32, device=topk_idx.device)
    counts.scatter_add_(1, torch.where(chosen, topk_idx, num_experts), torch.ones_like(topk_idx, dtype=torch.int32))
    is_token_in_expert = counts[:, :num_experts] > 0
    is_token_in_rank = is_token_in_expert.view(num_tokens, num_ranks, num_experts // num_ranks).any(dim=2)
    num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
    num_tokens_per_expert = is_token_in_expert.sum(dim=0, dtype=torch.int32)
    return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank


def token_positions(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """
    Where each token lands among the tokens this rank sends to each rank.

    Arguments:
        is_token_in_rank: `[num_tokens, num_ranks]` with `torch.bool`.

    Returns:
        `[num_tokens, num_ranks]` contiguous `torch.int32`: entry `[t, r]` counts the tokens before `t` that go
        to rank `r` if `t` goes there, else -1.
    """
    num_tokens, num_ranks = is_token_in_rank.shape
    if num_tokens == 0:
        return torch.empty(0, num_ranks, dtype=torch.int32, device=is_token_in_rank.device)
    # One scan over the ranks' rows laid end to end, then each row's start taken off: torch scans a 1-D tensor
    # with one parallel (CUB) scan, while its scan down each column of [num_tokens, num_ranks] is a serial loop.
    flat = is_token_in_rank.t().contiguous().view(-1)
    running = torch.cumsum(flat, 0, dtype=torch.int32).view(num_ranks, num_tokens)
    before_row = torch.cat([running.new_zeros(1), running[:-1, -1]])
    positions = (running - before_row[:, None] - 1).t()
    return torch.where(is_token_in_rank, positions, -1).contiguous()


def to_local_expert_ids(topk_idx: torch.Tensor, rank: int, num_local_experts: int) -> torch.Tensor:
    """Global expert ids -> ids local to `rank` (`0 .. num_local_experts - 1`), -1 for experts on other ranks."""
    local = topk_idx - rank * num_local_experts
    return torch.where((local >= 0) & (local < num_local_experts) & (topk_idx >= 0), local, -1)


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def region_offsets(sizes: dict, alignment: int) -> Tuple[dict, int]:
    """Where each region of a buffer starts when ``sizes`` (name -> bytes, in order) are laid out one after the
    other, each padded to ``alignment``: ``(offsets, total bytes)``."""
    offsets, total = {}, 0
    for name, size in sizes.items():
        offsets[name] = total
        total += align_up(size, alignment)
    return offsets, total


def dispatch_row_bytes(hidden: int, x_element_size: int, with_scales: bool, num_topk: int) -> int:
    """Bytes of one dispatched token: its values, its FP8 scales, top-k ids (int64) and weights (fp32), source index (int32)."""
    scale_bytes = (hidden // SCALE_BLOCK) * 4 if with_scales else 0
    return align_up(hidden * x_element_size + scale_bytes + num_topk * (8 + 4) + 4, ROW_ALIGN)


def combine_row_bytes(hidden: int, x_element_size: int, num_topk: int) -> int:
    """Bytes of one combined token: its values and its top-k weights (fp32)."""
    return align_up(hidden * x_element_size + num_topk * 4, ROW_ALIGN)


def buffer_bytes(num_max_tokens_per_rank: int, num_ranks: int, row_bytes: int, header_words: int) -> int:
    """
    The receive area a rank needs: one slot of `num_max_tokens_per_rank` rows for each source rank (a push
    transport writes into its slot without coordinating with other senders), plus one header per rank.
    """
    return num_ranks * (num_max_tokens_per_rank * row_bytes + align_up(header_words * 8, ROW_ALIGN))


@dataclass
class DispatchHandle:
    """
    The layout of one dispatch, computed once and reused by `combine`, by cached dispatches (`handle=`), and by
    the backward passes. Treat it as opaque; the fields are documented for transport implementers.

    Attributes:
        buffer_id: identity of the `Buffer` that made it; a handle works only with that buffer.
        rank: this rank.
        num_ranks: the number of ranks.
        is_token_in_rank: `[num_tokens, num_ranks]` with `torch.bool`, send side: whether this rank's token goes
            to each rank.
        rank_prefix_matrix: `[num_ranks, num_ranks]` with `torch.int32`; entry `[i, j]` is the number of tokens
            that ranks `0..i` send to rank `j`. Column `rank` gives where each source rank's tokens start in the
            received tensors.
        recv_src_idx: `[num_recv_tokens]` with `torch.int32`, the index of each received token on its source rank.
        num_recv_tokens: the number of tokens received (the rows of `recv_x` before padding).
        num_worst_tokens: rows of the received tensors (padded) when positive; 0 for unpadded.
        num_local_experts: experts held by each rank (0 if the dispatch that made the handle had no top-k).
        transport_state: whatever the transport precomputed for this layout (the reference transport keeps the
            host-side send and receive counts here).
        round: the number of the `Buffer` call that made it, the same on every rank: a cached dispatch or a
            combine checks that every rank passes the handle of the same call.
    """

    buffer_id: int
    rank: int
    num_ranks: int
    is_token_in_rank: torch.Tensor
    rank_prefix_matrix: torch.Tensor
    recv_src_idx: torch.Tensor
    num_recv_tokens: int
    num_worst_tokens: int
    num_local_experts: int
    transport_state: Any = None
    round: int = 0

    def __getitem__(self, index: int):
        """DeepEP's intranode handle is a tuple ``(rank_prefix_matrix, channel_prefix_matrix,
        recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)``: the same indices work here, with
        None for the three that describe DeepEP's channels (none here)."""
        return (self.rank_prefix_matrix, None, None, self.recv_src_idx, self.is_token_in_rank, None)[index]

    def __len__(self) -> int:
        return 6

    @property
    def num_tokens(self) -> int:
        """The number of tokens on this rank before dispatch (the rows `combine` returns)."""
        return self.is_token_in_rank.size(0)

    @property
    def num_recv_rows(self) -> int:
        """Rows of the received tensors: `num_worst_tokens` if set, else `num_recv_tokens`."""
        return self.num_worst_tokens if self.num_worst_tokens > 0 else self.num_recv_tokens


def rank_prefix_matrix_from_counts(tokens_from_to: List[List[int]], device: Optional[torch.device] = None) \
        -> torch.Tensor:
    """`[i][j]` = tokens rank i sends to rank j  ->  the cumulative `[num_ranks, num_ranks]` int32 matrix."""
    return torch.tensor(tokens_from_to, dtype=torch.int32, device=device).cumsum(dim=0, dtype=torch.int32)
