"""The hierarchical transport's plan of one layout (`HierarchicalState`), the messages it posts (`Message` in its
log, `_Op` while planned) and the packing of a message's rows (`smsplit.ep.hierarchical` moves them)."""

from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from .reference import _inner_numel, unpack_column
from .rows import SCALE_BLOCK


class Message(NamedTuple):
    """One entry of `HierarchicalTransport.message_log`.

    Attributes:
        op: "dispatch" or "combine".
        phase: "counts", "masks", "chunk counts" (the notify rounds), "network" (dispatch: a chunk to the
            forwarder on another node), "forward" (dispatch: rows of a chunk to a rank of the forwarder's node),
            "return" (combine: rows back to their forwarder), "sums" (combine: a node's sums to the source).
        kind: "send" or "recv".
        peer: the other rank.
        chunk: the chunk's index in its source's list (-1 for notify messages).
        source: the rank whose tokens the rows are (the sender for notify messages).
        rows: rows in the message (0 for notify messages).
        bytes: bytes in the message.
        event: "posted" or "completed".
        order: this entry's place among the transport's log entries (0, 1, 2, ...).
    """

    op: str
    phase: str
    kind: str
    peer: int
    chunk: int
    source: int
    rows: int
    bytes: int
    event: str
    order: int


@dataclass
class HierarchicalState:
    """The hierarchical transport's plan of one layout (`handle.transport_state`), host-side counts.

    Attributes:
        chunk_tokens: C, tokens per chunk of a list.
        send_lists: per node m: this rank's tokens with an expert on node m, ascending (int64, on the device).
        fwd_masks: per source node n: ``[count, P]`` bool, for each token of rank (n, l)'s list for this node
            (l: this rank's local index), which ranks of this node need it (this rank's own list for its node).
        fwd_counts: ``[n][c][j]``: rows of chunk c of source node n's list that go to local rank j.
        recv_counts: per source rank: the rows of each chunk of its list for this node that this rank receives.
        recv_starts: per source rank: the first received row of each of those chunks.
    """

    chunk_tokens: int
    send_lists: List[torch.Tensor]
    fwd_masks: List[torch.Tensor]
    fwd_counts: List[List[List[int]]]
    recv_counts: List[List[int]]
    recv_starts: List[List[int]]
    _selections: Dict[Tuple[int, int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def chunk(self, tokens: torch.Tensor, c: int) -> torch.Tensor:
        return tokens[c * self.chunk_tokens:(c + 1) * self.chunk_tokens]

    def selection(self, n: int, c: int, j: int) -> torch.Tensor:
        """The rows (indices within chunk c of source node n's list) that go to local rank j."""
        key = (n, c, j)
        sel = self._selections.get(key)
        if sel is None:
            sel = torch.nonzero(self.chunk(self.fwd_masks[n], c)[:, j]).flatten()
            self._selections[key] = sel
        return sel


@dataclass
class _Op:
    kind: str  # "send" or "recv"
    peer: int
    phase: str
    chunk: int
    source: int
    rows: int
    tensor: torch.Tensor  # flat uint8, on the transport's device: what to send, or where to receive
    wire: Optional[torch.Tensor] = None  # what the group moves (a host copy where staged)


def _chunks(count: int, chunk_tokens: int) -> int:
    return -(-count // chunk_tokens)


def _likes(fields: List[torch.Tensor], quantize: bool) -> List[torch.Tensor]:
    """Empty tensors of the dtypes and trailing shapes of the packed columns (``fields[0]``, the values, as e4m3
    values and fp32 scales where ``quantize``)."""
    likes = []
    for i, f in enumerate(fields):
        if i == 0 and quantize:
            hidden = f.size(1)
            likes.append(torch.empty(0, hidden, dtype=torch.float8_e4m3fn))
            likes.append(torch.empty(0, hidden // SCALE_BLOCK, dtype=torch.float32))
        else:
            likes.append(torch.empty(0, *f.shape[1:], dtype=f.dtype))
    return likes


def _widths(likes: List[torch.Tensor]) -> List[int]:
    return [_inner_numel(like) * like.element_size() for like in likes]


def _unpack(rows: torch.Tensor, likes: List[torch.Tensor]) -> List[torch.Tensor]:
    out, col = [], 0
    for like, width in zip(likes, _widths(likes)):
        out.append(unpack_column(rows, col, width, like))
        col += width
    return out
