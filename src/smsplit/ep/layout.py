"""Dispatch layout (who sends what where), the dispatch handle, and the byte sizes every transport shares.

A dispatch moves each token to every rank that holds one of its top-k experts. Experts are split evenly and
contiguously: rank `r` holds experts `[r * num_local_experts, (r + 1) * num_local_experts)`. On every rank, the
received tokens are ordered by source rank, then by token index on the source rank.
"""

import contextlib
import copy
import weakref
from dataclasses import dataclass
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..launch import FastLaunch


MAX_KERNEL_TOPK = 16  # the layout kernels unroll a loop over pairs of top-k columns: more columns take torch's way
MAX_SCAN_TOKENS = 16384  # token_positions_kernel scans in one program: longer inputs take torch's (parallel) scan


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1), in plain Python: `triton.next_power_of_2` goes through Triton's
    constexpr-function machinery on the host (nine calls per eager dispatch + combine of the SM push)."""
    return 1 << (max(1, n) - 1).bit_length()


def compute_dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) \
        -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    Count tokens per rank and per expert from the top-k choices (no communication). On a GPU, one kernel
    (`layout_kernel`, up to `MAX_KERNEL_TOPK` top-k columns); elsewhere torch operations.

    Arguments:
        topk_idx: `[num_tokens, num_topk]` with `torch.int64`, expert ids in `[0, num_experts)`, `-1` for none (ids
            outside `[0, num_experts)` count nowhere).
        num_experts: the number of experts, a multiple of `num_ranks`.
        num_ranks: the number of ranks in the group.

    Returns:
        num_tokens_per_rank: `[num_ranks]` with `torch.int32`, tokens that go to each rank (a token counts once per
            rank, however many of its experts that rank holds).
        num_tokens_per_expert: `[num_experts]` with `torch.int32`, tokens that chose each expert (once per token).
        is_token_in_rank: `[num_tokens, num_ranks]` with `torch.bool`.
    """
    if num_ranks < 1 or num_experts < num_ranks or num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of num_ranks ({num_ranks})")
    num_tokens = topk_idx.size(0)
    if _layout_kernel_takes(topk_idx):
        is_token_in_rank = torch.empty(num_tokens, num_ranks, dtype=torch.bool, device=topk_idx.device)
        counts = _launch_layout_kernel(topk_idx, num_experts, num_ranks, is_token_in_rank, check=False)
        return counts[:num_ranks], counts[num_ranks:num_ranks + num_experts], is_token_in_rank
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    # Column `num_experts` collects the other entries and is dropped.
    counts = torch.zeros(num_tokens, num_experts + 1, dtype=torch.int32, device=topk_idx.device)
    counts.scatter_add_(1, torch.where(valid, topk_idx, num_experts), torch.ones_like(topk_idx, dtype=torch.int32))
    is_token_in_expert = counts[:, :num_experts] > 0
    is_token_in_rank = is_token_in_expert.view(num_tokens, num_ranks, num_experts // num_ranks).any(dim=2)
    num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
    num_tokens_per_expert = is_token_in_expert.sum(dim=0, dtype=torch.int32)
    return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank


def check_dispatch_layout(topk_idx: torch.Tensor, num_experts: int, is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """
    What a dispatch's argument checks need to compare a given layout with its top-k choices, in one int32 tensor on
    their device (on a GPU made by one kernel, `layout_kernel`): ``[num_ranks + num_experts + 2]``, the column sums of
    `is_token_in_rank`, the tokens that chose each expert according to `topk_idx` (ids in `[0, num_experts)`, once
    per token), the number of ids outside `[-1, num_experts)`, and the number of entries of `is_token_in_rank` that
    differ from the ranks of each token's experts.
    """
    num_ranks = is_token_in_rank.size(1)
    if _layout_kernel_takes(topk_idx):
        return _launch_layout_kernel(topk_idx, num_experts, num_ranks, is_token_in_rank, check=True)
    _, implied_per_expert, implied_in_rank = compute_dispatch_layout(topk_idx, num_experts, num_ranks)
    outside = ((topk_idx < -1) | (topk_idx >= num_experts)).sum().view(1)
    differ = (implied_in_rank != is_token_in_rank).sum().view(1)
    return torch.cat([is_token_in_rank.sum(0), implied_per_expert, outside, differ]).to(torch.int32)


def token_positions(is_token_in_rank: torch.Tensor, with_counts: bool = False):
    """
    Where each token lands among the tokens this rank sends to each rank. On a GPU one kernel
    (`token_positions_kernel`, up to `MAX_SCAN_TOKENS` tokens); elsewhere torch operations.

    Arguments:
        is_token_in_rank: `[num_tokens, num_ranks]` with `torch.bool`.
        with_counts: also return the tokens sent to each rank.

    Returns:
        `[num_tokens, num_ranks]` contiguous `torch.int32`: entry `[t, r]` counts the tokens before `t` that go
        to rank `r` if `t` goes there, else -1; with `with_counts`, also `[num_ranks]` int32, the column sums.
    """
    num_tokens, num_ranks = is_token_in_rank.shape
    device = is_token_in_rank.device
    if is_token_in_rank.is_cuda and num_tokens <= MAX_SCAN_TOKENS:
        positions = torch.empty(num_tokens, num_ranks, dtype=torch.int32, device=device)
        counts = torch.empty(num_ranks, dtype=torch.int32, device=device)
        with _on_device_of(is_token_in_rank):
            launch_token_positions(1, is_token_in_rank.contiguous(), positions, counts, num_tokens, num_ranks,
                                   BT=512 if num_ranks <= 8 else 128, RP=next_pow2(num_ranks), num_warps=4)
        return (positions, counts) if with_counts else positions
    if num_tokens == 0:
        positions = torch.empty(0, num_ranks, dtype=torch.int32, device=device)
    else:
        # One scan over the ranks' rows laid end to end, then each row's start taken off: torch scans a 1-D tensor
        # with one parallel (CUB) scan, while its scan down each column of [num_tokens, num_ranks] is a serial loop.
        flat = is_token_in_rank.t().contiguous().view(-1)
        running = torch.cumsum(flat, 0, dtype=torch.int32).view(num_ranks, num_tokens)
        before_row = torch.cat([running.new_zeros(1), running[:-1, -1]])
        positions = torch.where(is_token_in_rank, (running - before_row[:, None] - 1).t(), -1).contiguous()
    return (positions, is_token_in_rank.sum(0, dtype=torch.int32)) if with_counts else positions


@triton.jit
def layout_kernel(topk_ptr, given_ptr, in_rank_ptr, counts_ptr, T, K, R, E, L,
                  CHECK: tl.constexpr, BT: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr):
    """BT tokens per program. For each token, the ranks its experts are on (ids in [0, E), L experts a rank) and,
    once per token and expert, a count for each expert it chose: counts_ptr (int32, zeroed) [R, R + E). Without
    CHECK: those ranks into in_rank_ptr (bool [T, R]) and their column sums into counts [0, R); with CHECK: the
    column sums of given_ptr (bool [T, R]) into [0, R) and the entries where it differs into [R + E + 1]. Always
    the ids outside [-1, E) into [R + E]."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    row = t.to(tl.int64) * K
    r = tl.arange(0, RP)
    rmask = r < R
    trmask = tmask[:, None] & rmask[None, :]
    ranks = tl.zeros([BT, RP], dtype=tl.int32)
    outside = tl.zeros([BT], dtype=tl.int32)
    for k in tl.static_range(KP):
        kmask = tmask & (k < K)
        ids = tl.load(topk_ptr + row + k, mask=kmask, other=-1)
        valid = kmask & (ids >= 0) & (ids < E)
        outside += (kmask & ((ids < -1) | (ids >= E))).to(tl.int32)
        first = valid
        for j in tl.static_range(k):  # an expert chosen twice by a token counts once
            first = first & (tl.load(topk_ptr + row + j, mask=kmask, other=-1) != ids)
        tl.atomic_add(counts_ptr + R + tl.where(first, ids, 0), first.to(tl.int32), mask=first)
        rank_of = tl.where(valid, ids, 0).to(tl.int32) // L  # (ids in [0, E) fit: a 32-bit division)
        ranks = tl.where(valid[:, None] & (rank_of[:, None] == r[None, :]), 1, ranks)
    cells = t.to(tl.int64)[:, None] * R + r[None, :]
    if CHECK:
        given = (tl.load(given_ptr + cells, mask=trmask, other=0) != 0).to(tl.int32)
        tl.atomic_add(counts_ptr + r, tl.sum(given, axis=0), mask=rmask)
        differ = tl.sum(tl.sum(tl.where(trmask & (given != ranks), 1, 0), axis=1), axis=0)
        tl.atomic_add(counts_ptr + R + E + 1, differ)
    else:
        tl.store(in_rank_ptr + cells, ranks != 0, mask=trmask)
        tl.atomic_add(counts_ptr + r, tl.sum(ranks, axis=0), mask=rmask)
    tl.atomic_add(counts_ptr + R + E, tl.sum(outside, axis=0))


@triton.jit
def token_positions_kernel(in_rank_ptr, positions_ptr, counts_ptr, T, R, BT: tl.constexpr, RP: tl.constexpr):
    """One program: a running count down each column of in_rank (bool [T, R]), BT tokens a step; positions (int32
    [T, R]) gets the count before the token where it is set, else -1; counts ([R]) the column sums."""
    r = tl.arange(0, RP)
    rmask = r < R
    carry = tl.zeros([RP], dtype=tl.int32)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        mask = (t < T)[:, None] & rmask[None, :]
        cells = t.to(tl.int64)[:, None] * R + r[None, :]
        flags = (tl.load(in_rank_ptr + cells, mask=mask, other=0) != 0).to(tl.int32)
        before = carry[None, :] + tl.cumsum(flags, axis=0) - flags
        tl.store(positions_ptr + cells, tl.where(flags != 0, before, -1), mask=mask)
        carry += tl.sum(flags, axis=0)
    tl.store(counts_ptr + r, carry, mask=rmask)


launch_layout, launch_token_positions = FastLaunch(layout_kernel), FastLaunch(token_positions_kernel)


def _launch_layout_kernel(topk_idx, num_experts: int, num_ranks: int, in_rank: torch.Tensor, check: bool):
    num_tokens, num_topk = topk_idx.shape
    counts = torch.zeros(num_ranks + num_experts + 2, dtype=torch.int32, device=topk_idx.device)
    block = 128 if num_ranks <= 16 else 32
    if num_tokens > 0:
        with _on_device_of(topk_idx):
            launch_layout(triton.cdiv(num_tokens, block), topk_idx.contiguous(),
                          in_rank.contiguous() if check else in_rank, in_rank, counts, num_tokens, num_topk,
                          num_ranks, num_experts, num_experts // num_ranks, CHECK=check, BT=block,
                          KP=next_pow2(num_topk), RP=next_pow2(num_ranks), num_warps=4)
    return counts


def _layout_kernel_takes(topk_idx: torch.Tensor) -> bool:
    """Whether `layout_kernel` serves these top-k ids (on a GPU, up to `MAX_KERNEL_TOPK` columns)."""
    return topk_idx.is_cuda and topk_idx.size(1) <= MAX_KERNEL_TOPK


def _on_device_of(t: torch.Tensor):
    """A context on ``t``'s GPU: a Triton launch goes to the current device (and its current stream)."""
    return contextlib.nullcontext() if t.device.index == torch.cuda.current_device() else torch.cuda.device(t.device)


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
        recv_src_idx: `[num_recv_rows]` with `torch.int32`, the index of each received token on its source rank; -1
            on the padding rows of a dispatch with `num_worst_tokens` (DeepEP's has `num_worst_tokens` entries too,
            the padding ones left unwritten).
        num_recv_tokens: the number of tokens received (the rows of `recv_x` before padding).
        num_worst_tokens: rows of the received tensors (padded) when positive; 0 for unpadded.
        num_local_experts: experts held by each rank (0 if the dispatch that made the handle had no top-k).
        hidden: the hidden size of the dispatch that made it (0: weights only).
        transport: the name of the transport whose dispatch made this layout and placed its rows
            (`smsplit.ep.registry`), the same on every rank.
        transport_state: that transport's own state for this layout, a dataclass of its own
            (`smsplit.ep.reference.ReferenceState`, `smsplit.ep.device.DeviceState`).
        reference_state: the reference transport's plan of a layout that another transport made (made when the
            reference first moves rows of it: a dtype the device kernels do not move, a weights-only backward).
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
    hidden: int = 0
    transport: str = ""
    transport_state: Any = None
    reference_state: Any = None
    round: int = 0

    def __getitem__(self, index: int):
        """DeepEP's intranode handle is a tuple ``(rank_prefix_matrix, channel_prefix_matrix,
        recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)``: the same indices work here, with
        None for the three that describe DeepEP's channels (none here). A tuple or list of these six objects,
        as indexing or unpacking gives them, works as the handle again (`from_deepep_tuple`)."""
        _remember_tuple(self)
        return self._deepep_tuple()[index]

    def __len__(self) -> int:
        return 6

    def _deepep_tuple(self) -> tuple:
        return (self.rank_prefix_matrix, None, None, self.recv_src_idx, self.is_token_in_rank, None)

    @staticmethod
    def from_deepep_tuple(fields) -> Optional["DispatchHandle"]:
        """
        The handle that a tuple or list rebuilt from a handle's DeepEP fields stands for, or None if ``fields`` is
        not one. DeepEP's handle is a plain tuple, so code written for it may unpack it and pass a rebuilt tuple to
        `combine` or a cached dispatch. Here the six items must be the objects (not copies) that indexing or
        unpacking a handle gave, in DeepEP's order; the handle object itself need not be alive any more.
        """
        if not isinstance(fields, (tuple, list)) or len(fields) != 6:
            return None
        entry = _TUPLE_HANDLES.get(id(fields[3]))
        if entry is None or entry.recv_src_idx() is not fields[3]:
            return None
        handle = entry.handle()
        if handle is None:  # the caller kept only the tuple: the handle again, from what it held besides these
            handle = copy.copy(entry.rest)
            handle.recv_src_idx = fields[3]
            _TUPLE_HANDLES[id(fields[3])] = entry._replace(handle=weakref.ref(handle))
        if any(given is not own for given, own in zip(fields, handle._deepep_tuple())):
            return None
        return handle

    @property
    def num_tokens(self) -> int:
        """The number of tokens on this rank before dispatch (the rows `combine` returns)."""
        return self.is_token_in_rank.size(0)

    @property
    def num_recv_rows(self) -> int:
        """Rows of the received tensors: `num_worst_tokens` if set, else `num_recv_tokens`."""
        return self.num_worst_tokens if self.num_worst_tokens > 0 else self.num_recv_tokens


class _TupleEntry(NamedTuple):
    recv_src_idx: "weakref.ref[torch.Tensor]"
    handle: "weakref.ref[DispatchHandle]"
    rest: DispatchHandle  # a shallow copy without recv_src_idx (see _remember_tuple)


# Handles read as DeepEP's tuple, by id(recv_src_idx): a tensor that is one handle's only (each dispatch makes its
# own). An entry lives as long as that tensor, not as long as the handle, so that a tuple the caller keeps instead
# of the handle still finds it. Its copy of the handle leaves recv_src_idx out: holding it would keep the tensor,
# and so the entry, alive for ever. Entries are made at the first tuple-style read, not at every dispatch, so that
# callers who pass the handle itself pay nothing for them.
_TUPLE_HANDLES: Dict[int, _TupleEntry] = {}


def _remember_tuple(handle: DispatchHandle) -> None:
    src = handle.recv_src_idx
    entry = _TUPLE_HANDLES.get(id(src))
    if entry is not None and entry.handle() is handle and entry.recv_src_idx() is src:
        return
    rest = copy.copy(handle)
    rest.recv_src_idx = None
    _TUPLE_HANDLES[id(src)] = _TupleEntry(weakref.ref(src), weakref.ref(handle), rest)
    # (called while the tensor is freed, before its id can name another object)
    weakref.finalize(src, _TUPLE_HANDLES.pop, id(src), None)
