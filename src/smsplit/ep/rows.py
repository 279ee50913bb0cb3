"""Byte sizes and row bookkeeping that every transport shares; no Triton, so that the CPU reference transport (and
`smsplit.ep.layout`, which re-exports them) can use them."""

from typing import List, Optional, Tuple

import torch

SCALE_BLOCK = 128  # FP8 values per fp32 scale
ROW_ALIGN = 16     # bytes; every per-token message is padded to this


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


def rank_prefix_matrix_from_counts(tokens_from_to: List[List[int]], device: Optional[torch.device] = None) \
        -> torch.Tensor:
    """`[i][j]` = tokens rank i sends to rank j  ->  the cumulative `[num_ranks, num_ranks]` int32 matrix."""
    return torch.tensor(tokens_from_to, dtype=torch.int32, device=device).cumsum(dim=0, dtype=torch.int32)
