"""Host planning of the NVLink transport: the regions of its symmetric buffer and its context table, and, with
``bulk="copy_engine"``, which rows the copy engines move (a dispatch's copied prefixes, a combine's chunks)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .._args import check_int
from .kernels import common
from .transport import EPError

SCALE_BLOCK = 128
ALIGN = 256
MAX_HOLE_SHARE = 0.125  # bulk="copy_engine": a peer's copied prefix may hold at most this share of tokens not sent there
MAX_CHUNKS = 8  # bulk="copy_engine": the most chunks a combine's copies are cut into


def check_num_sms(num_sms) -> int:
    """The SM count of one call: persistent programs of its kernels (every rank passes the same count)."""
    return check_int("num_sms", num_sms, 1)


def region_bytes(R: int, M: int, H: int, K: int) -> dict:
    """Bytes of each region of the symmetric buffer: flags, the count matrix, the copy-engine flags (per source:
    the dispatch's, then each combine chunk's) and where each source's combine chunks end, the receive area (one
    row for every token of every source, bf16-sized) with scales, top-k, weights and source index, and the
    combine area (one slot per source rank and position of a token among those sent there)."""
    rows = R * M
    return {"signals": common.SIGNAL_SLOTS * 64, "counts": R * R * 4, "copied": (1 + MAX_CHUNKS) * R * 4,
            "chunk_ends": R * MAX_CHUNKS * 4,
            "x": rows * H * 2, "scales": rows * (H // SCALE_BLOCK) * 4, "topk": rows * K * 8,
            "weights": rows * K * 4, "src": rows * 4,
            "cx": R * M * H * 2, "cw": R * M * K * 4}


def context_table(bases: list, offsets: dict, timeout_ns: int, status_addr: int, rank: int = 0,
                  state_addr: int = 0) -> list:
    """The words of a transport's context table (`smsplit.ep.kernels.common`): every rank's buffer address, then
    the constants the kernels load (``state_addr``: this rank's local state words)."""
    words = [0] * common.CTX_WORDS
    words[:len(bases)] = bases
    for index, value in ((common.CTX_TIMEOUT, timeout_ns), (common.CTX_STATUS, status_addr),
                         (common.CTX_SIG, offsets["signals"]), (common.CTX_COUNTS, offsets["counts"]),
                         (common.CTX_X, offsets["x"]), (common.CTX_SCALES, offsets["scales"]),
                         (common.CTX_TOPK, offsets["topk"]), (common.CTX_WEIGHTS, offsets["weights"]),
                         (common.CTX_SRC, offsets["src"]), (common.CTX_COPIED, offsets["copied"]),
                         (common.CTX_CX, offsets["cx"]), (common.CTX_CW, offsets["cw"]),
                         (common.CTX_CHUNK_ENDS, offsets["chunk_ends"]), (common.CTX_RANK, rank),
                         (common.CTX_STATE, state_addr)):
        words[index.value] = value
    return words


def share_of(share: float, n: int) -> int:
    """``ceil(share * n)``, not tripped up by binary fractions (0.7 * 300 is 210.00000000000003)."""
    return min(n, math.ceil(round(share * n, 6)))


def prefix_plan(to_peer: np.ndarray) -> tuple[int, np.ndarray]:
    """Where a dispatch with ``bulk="copy_engine"`` puts the rows it sends one peer (``to_peer``: bool ``[T]``, the
    tokens sent there): ``(m, pos)``, ``pos[t]`` the row of token t among this rank's rows there (-1: not sent).

    One copy moves rows ``0 .. m-1`` of x into rows ``0 .. m-1`` there, ``m`` the number of tokens sent there, so
    token ``t < m`` sent there lands on row t. The tokens before m that are not sent there (holes) are overwritten,
    once that copy has landed, by the tokens after m that are sent there (as many). A prefix with more than
    ``MAX_HOLE_SHARE`` holes is not worth copying: then ``m = 0`` and the kernel pushes the rows in token order.
    (Copying fewer rows and pushing the rest at the same time was slower: docs/design-notes.md.)"""
    sent = np.flatnonzero(to_peer)
    m = len(sent)
    holes = np.flatnonzero(~to_peer[:m])
    if len(holes) > MAX_HOLE_SHARE * m:
        m, holes = 0, holes[:0]
    pos = np.full(len(to_peer), -1, np.int32)
    head, tail = sent[sent < m], sent[sent >= m]
    pos[head] = head
    pos[tail[: len(holes)]] = holes  # (there are as many: m = sent)
    pos[tail[len(holes):]] = m + np.arange(len(tail) - len(holes))
    return m, pos


@dataclass
class DispatchSplit:
    """What a dispatch with ``bulk="copy_engine"`` gives the copy engines (`prefix_plan` per peer), per layout.

    Attributes:
        copies: ``[(peer, rows m, first row there)]``, rows ``0 .. m-1`` of x to that peer.
        plan: int32 device ``[R + 2]``: m per rank (0 for this rank and peers the SMs serve), then ``fill_from,
            fill_to``: the tokens that fill holes lie in ``fill_from <= t < fill_to`` (both ``num_tokens``: no holes).
        pos: int32 device ``[num_tokens, R]``, the rows (this rank's own column: token order).
    """

    copies: list
    plan: torch.Tensor
    pos: torch.Tensor


def dispatch_split(rank: int, in_rank: np.ndarray, send_start: list, max_rows: int, device) -> DispatchSplit:
    """The copy-engine prefixes of a dispatch (`prefix_plan` per peer) from ``in_rank`` (bool ``[T, R]``, the
    host's copy of ``is_token_in_rank``) and ``send_start`` (where this rank's rows start on each rank).
    ``max_rows``: the rows of a receive area (a layout putting rows past it raises `EPError`)."""
    T, R = in_rank.shape
    pos = np.full((T, R), -1, np.int32)
    plan = np.zeros(R + 2, np.int32)
    copies, fill_from, fill_to = [], T, 0
    for d in range(R):
        sent = int(in_rank[:, d].sum())
        if d == rank:
            pos[:, d] = np.where(in_rank[:, d], np.cumsum(in_rank[:, d]) - 1, -1)
            continue
        if sent and not 0 <= send_start[d] + sent <= max_rows:
            raise EPError(f"rank {rank}: the layout puts rows past the end of rank {d}'s receive area")
        m, pos[:, d] = prefix_plan(in_rank[:, d])
        plan[d] = m
        if m:
            copies.append((d, m, int(send_start[d])))
            if in_rank[:m, d].sum() < m:  # holes: filled from token m on
                fill_from = min(fill_from, m)
                fillers = np.nonzero((pos[m:, d] >= 0) & (pos[m:, d] < m))[0]
                if len(fillers):
                    fill_to = max(fill_to, m + int(fillers[-1]) + 1)
    plan[R], plan[R + 1] = fill_from, (fill_to if fill_from < T else T)
    return DispatchSplit(copies, torch.from_numpy(plan).to(device), torch.from_numpy(pos).to(device))


def default_combine_chunks(num_sms: int) -> tuple[float, ...]:
    """The chunks (increasing fractions of the copied rows) a combine's copies are cut into, by comm SMs: from 20
    SMs on four, below three. More chunks let the sum start sooner but each costs a flag and a wait: with the
    DeepSeek-V3 shape on two GPUs, four were faster from 20 SMs on and slower at 16."""
    return (0.4, 0.7, 0.9, 1.0) if num_sms >= 20 else (0.5, 0.8, 1.0)


def combine_split(rank: int, starts: list, fractions: tuple, device, call_words: tuple = ()):
    """``(chunks, chunk_ends)`` of a combine whose copy engines return every row received from each source
    (``starts``: where each source's rows start here, then the total), cut into ``fractions``: ``chunks[c]`` lists
    the copies ``(source, first row, rows, first slot)`` of chunk c, ``chunk_ends`` (int32 device ``[R,
    len(fractions)]``) where each source's chunks end, counted in rows received from it. ``call_words``: values of
    the layout that follow the ends in the same device memory (`smsplit.ep.kernels.combine.combine_copied_kernel`
    reads its tokens and receive rows there: made once per layout and chunking, they cost no call a copy)."""
    R = len(starts) - 1
    ends = np.zeros((R, len(fractions)), np.int32)
    chunks = [[] for _ in fractions]
    for source in range(R):
        if source == rank:
            continue
        copied = starts[source + 1] - starts[source]
        begin = 0
        for c, fraction in enumerate(fractions):
            ends[source, c] = end = share_of(fraction, copied)
            if end > begin:
                chunks[c].append((source, starts[source] + begin, end - begin, begin))
            begin = end
    words = torch.tensor(np.concatenate([ends.ravel(), np.asarray(call_words, np.int32)]), device=device)
    return chunks, words[:ends.size].view(ends.shape)
