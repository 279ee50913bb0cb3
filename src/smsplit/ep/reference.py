"""The reference transport: point-to-point `torch.distributed` messages (gloo on CPU, NCCL on GPU).

It is what CPU-only machines and CI run, and the oracle for the GPU transports. Every phase sends one message per
peer (the rows for that peer packed into bytes) and waits for each peer separately, so a missing peer is named.
Waits are bounded by `timeout_s`: gloo waits with a timeout, other backends poll `work.is_completed()`. After a
timeout the group's connection to that peer may be closed (gloo closes it), so the transport refuses further use.
The headers (the few int64 rows every `Buffer` call exchanges first) go through host shared memory where every rank
is on this machine (`smsplit.ep.host_headers`), else through the group.

The same shared memory (set up either way, where the ranks share a machine) carries the aborts: `abort` tells the
peers that this rank failed on its own, and every wait here watches the peers' entries (and, in the header exchange
through shared memory, their processes) and raises `EPAbortError` at once. A wait on gloo blocks in C++; it runs on
a thread of its own while this thread watches.
"""

import datetime
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch
import torch.distributed as dist

from .header import HEADER_WORDS
from .host_headers import HostHeaders
if TYPE_CHECKING:  # (annotations only: the layout module holds Triton kernels, which this one needs not)
    from .layout import DispatchHandle
from .rows import buffer_bytes, combine_row_bytes, dispatch_row_bytes, rank_prefix_matrix_from_counts, to_local_expert_ids
from .transport import (Capabilities, EPAbortError, EPError, EPTimeoutError, Received, Tokens, Traffic, Transport,
                        all_gather_into_tensor, poll_until)

FLOAT_DTYPES = frozenset((torch.bfloat16, torch.float16, torch.float32))


@dataclass
class ReferenceState:
    """The reference transport's plan of one layout, host-side counts (`handle.transport_state` of a layout it made;
    `handle.reference_state` of one another transport made)."""

    send_token_idx: List[torch.Tensor]  # per destination rank: this rank's token indices it sends there, ascending
    send_counts: List[int]              # per destination rank
    recv_counts: List[int]              # per source rank
    recv_offsets: List[int]             # per source rank: first row of its tokens in the received tensors
    # rows another transport placed: this transport's row i is the handle's row rows[i] (None: the same rows)
    rows: Optional[torch.Tensor] = None


def _reference_bytes(num_ranks: int, max_tokens: int, hidden: int, num_topk: int = 0,
                     x_dtype: Optional[torch.dtype] = torch.bfloat16, fp8: bool = False,
                     combine_dtype: Optional[torch.dtype] = torch.bfloat16, combine_only: bool = False) -> int:
    """The reference formula (docs/ep.md, `get_buffer_size_hint`): one slot per source rank holding all of that
    rank's tokens, each row the larger of a dispatch row and a combine row, plus one header per rank.
    ``combine_only``: the combine rows alone (a combine, and the backward of a combine)."""
    x_dtype = x_dtype if x_dtype in FLOAT_DTYPES else torch.bfloat16
    combine_dtype = combine_dtype if combine_dtype in FLOAT_DTYPES else torch.bfloat16
    row = combine_row_bytes(hidden, combine_dtype.itemsize, num_topk)
    if not combine_only:
        row = max(row, dispatch_row_bytes(hidden, 1 if fp8 else x_dtype.itemsize, fp8, num_topk))
    return buffer_bytes(max_tokens, num_ranks, row, HEADER_WORDS + num_ranks)


def _rows_to_reference(t: Optional[torch.Tensor], perm: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Rows of ``t`` in another transport's order -> this transport's (padding rows past ``perm`` kept)."""
    if t is None or perm is None:
        return t
    return torch.cat([t.index_select(0, perm.to(t.device)), t[perm.numel():]])


def _rows_from_reference(t: Optional[torch.Tensor], perm: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The inverse of `_rows_to_reference`."""
    if t is None or perm is None:
        return t
    out = torch.empty_like(t)
    out[perm.to(t.device)] = t[:perm.numel()]
    out[perm.numel():] = t[perm.numel():]
    return out


def pack_rows(fields: List[torch.Tensor]) -> torch.Tensor:
    """`[n, k_i]` tensors of any dtypes -> `[n, sum_i k_i * itemsize_i]` uint8, one row per token."""
    return torch.cat([f.reshape(f.size(0), _inner_numel(f)).contiguous().view(torch.uint8) for f in fields], dim=1)


def unpack_column(rows: torch.Tensor, start: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """Bytes `[start, start + width)` of every row, as a fresh tensor of `like`'s dtype and trailing shape."""
    column = torch.empty(rows.size(0), width, dtype=torch.uint8, device=rows.device)
    column.copy_(rows[:, start:start + width])
    return column.view(like.dtype).view(rows.size(0), *like.shape[1:])


WATCH_S = 0.02  # how often a wait on a thread of its own looks at the peers' abort entries
ENDED_EVERY_S = 0.05  # how often a header wait looks for ended peer processes (a read of /proc per peer)


def _inner_numel(field: torch.Tensor) -> int:
    n = 1
    for s in field.shape[1:]:
        n *= s
    return n


class ReferenceTransport(Transport):
    """`Buffer`'s ``backend="reference"`` (see the module's docstring): the transport calls on ``group``'s own
    backend, tensors on ``device``, every wait bounded by ``timeout_s`` (`EPTimeoutError` naming the peer and
    phase)."""

    name = "reference"
    # Headers through host shared memory where every rank is on one machine. Tests set this False (before the
    # transport is made) to run the path through the group on one machine; the shared file still carries aborts.
    host_headers_allowed = True

    @classmethod
    def capabilities(cls) -> Capabilities:
        every = FLOAT_DTYPES | {torch.float8_e4m3fn}
        return Capabilities(moves=every, quantizes=frozenset(), combines=FLOAT_DTYPES, weights_only=True,
                            capture="never", reads_any_layout=True, needs_cuda=False, one_node=False,
                            needs_buffer=False, hidden_multiple=1, max_topk=0, max_ranks=0,
                            buffer_bytes=_reference_bytes)

    def __init__(self, group, device: torch.device, timeout_s: float) -> None:
        super().__init__(group, device, timeout_s)
        self.backend = str(dist.get_backend(group)).lower()
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.num_ranks)]
        self.failure: Optional[str] = None
        self._header_stream = None  # NCCL: a stream of its own for the header exchange (made at the first one)
        # Headers through host shared memory where every rank is on this machine (set up at the first exchange,
        # False where it cannot be), else through the group.
        self._host_headers = None if self.host_headers_allowed else False
        self._shared = None  # the shared file (headers and aborts; None until the first exchange, False: none)
        self.header_rounds = 0  # header exchanges made (the measure of progress in abort entries)
        # ranks per node of the buffer's node layout (set once it is agreed), for `last_traffic`: one node until then
        self.ranks_per_node = self.num_ranks
        self._ended_checked = 0.0

    # -- messaging ----------------------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise EPError(f"this buffer is unusable after an earlier failure ({self.failure}); make a new group and Buffer")

    # -- aborts -------------------------------------------------------------------------------------------------

    def abort(self, cause: int, error: str, inside_call: bool) -> None:
        """
        This rank failed on its own (``cause``: this rank, or the peer whose failure made it fail; ``error``: what
        failed there): the transport is unusable from now on, and the peers' waits raise `EPAbortError` naming
        ``cause`` and ``error`` once they wait for something this rank will not send. ``inside_call``: whether the
        failing call had exchanged headers (it may have sent nothing since); else this rank finished every call
        whose headers it exchanged. Without shared memory (ranks on other machines) only this rank knows.
        """
        if self.failure is None:
            self.failure = error if cause == self.rank else f"rank {cause} failed: {error}"
        if self._shared:
            self._shared.abort(2 * self.header_rounds + (0 if inside_call else 1), cause, error)

    def _watch(self, op: str, doing: str, waiting: Optional[List[int]] = None) -> None:
        """Raise `EPAbortError` if a peer has aborted before finishing what this rank waits for now (its abort
        code, see `abort`, at most this rank's progress), or (``waiting``: the peers a header exchange through
        shared memory waits for) if one of those ended."""
        shared = self._shared
        for q in range(self.num_ranks):
            failure = shared.failure(q) if q != self.rank else None
            if failure is not None and failure[0] <= 2 * self.header_rounds:
                _, cause, error = failure
                self._fail_for(op, doing, q, cause, error)
        if waiting and time.monotonic() - self._ended_checked > ENDED_EVERY_S:
            self._ended_checked = time.monotonic()
            for q in waiting:
                pid = shared.ended(q)
                if pid is not None:
                    self._fail_for(op, doing, q, q, f"its process (pid {pid}) ended")

    def _fail_for(self, op: str, doing: str, q: int, cause: int, error: str) -> None:
        via = "" if q == cause else f" (rank {q} stopped for it)"
        message = f"{op}: {doing}: rank {cause} failed{via}: {error}"
        self.failure = message
        raise EPAbortError(f"{message}; this buffer is unusable, make a new group and Buffer", cause, error)

    def _wait_watched(self, wait, op: str, doing: str) -> None:
        """``wait()`` (a blocking wait on gloo works) on a thread of its own while this one watches the peers'
        aborts; its exception, if any, raised here. A wait left behind by an abort ends at its own deadline."""
        if not self._shared:
            wait()
            return
        done, raised = threading.Event(), []

        def run():
            try:
                wait()
            except BaseException as error:  # (handed to the caller's thread)
                raised.append(error)
            finally:
                done.set()

        threading.Thread(target=run, name="smsplit-ep-wait", daemon=True).start()
        while not done.wait(WATCH_S):
            self._watch(op, doing)
        if raised:
            raise raised[0]

    def _wait(self, work, op: str, phase: str, peer: int, deadline: float, who: Optional[str] = None) -> None:
        """Wait for ``work`` until ``deadline``: `EPTimeoutError` (``"{op}: {phase} {who}"``, ``who`` by default
        ``"rank {peer}"``) past it, `EPError` if it failed; either makes this transport unusable."""
        remaining = deadline - time.monotonic()
        try:
            if self.backend == "gloo":
                work.wait(datetime.timedelta(seconds=max(remaining, 0.001)))
            else:
                watched = ((lambda: self._watch(op, f"{phase} {who or f'rank {peer}'}") or work.is_completed())
                           if self._shared
                           else work.is_completed)
                if not poll_until(watched, deadline):
                    raise TimeoutError
                work.wait()
        except (RuntimeError, TimeoutError) as error:
            message = f"{op}: {phase} {who or f'rank {peer}'}"
            timed_out = isinstance(error, TimeoutError) or "timed out" in str(error).lower() \
                or time.monotonic() >= deadline
            self.failure = self.failure or message  # (a wait left behind by an abort ends later: the abort's kept)
            if timed_out:
                raise EPTimeoutError(f"{message} (no answer within timeout_s={self.timeout_s:g})", peer, message) \
                    from None
            raise EPError(f"{message} failed: {error}") from error

    def _exchange(self, op: str, what: str, send: List[Optional[torch.Tensor]], recv_nbytes: List[int]) \
            -> List[Optional[torch.Tensor]]:
        """Send `send[p]` (uint8, flat) to each peer p, receive `recv_nbytes[p]` bytes from it; skip empty messages."""
        self._check_usable()
        recv: List[Optional[torch.Tensor]] = [None] * self.num_ranks
        recv[self.rank] = send[self.rank]
        ops, kinds = [], []
        for peer in range(self.num_ranks):
            if peer == self.rank:
                continue
            if recv_nbytes[peer] > 0:
                recv[peer] = torch.empty(recv_nbytes[peer], dtype=torch.uint8, device=self.device)
                ops.append(dist.P2POp(dist.irecv, recv[peer], self.global_ranks[peer], self.group))
                kinds.append(("recv", peer))
            if send[peer] is not None and send[peer].numel() > 0:
                ops.append(dist.P2POp(dist.isend, send[peer].contiguous(), self.global_ranks[peer], self.group))
                kinds.append(("send", peer))
        if not ops:
            return recv
        deadline = time.monotonic() + self.timeout_s
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as error:  # (gloo: a peer's connection closed, e.g. after it gave up)
            message = f"{op}: posting {what} to and from ranks {sorted({peer for _, peer in kinds})}"
            self.failure = message
            raise EPError(f"{message} failed: {error}") from error
        if len(works) == len(ops):
            # Receives first: a peer that never arrives is named by the first receive that times out.
            order = sorted(range(len(ops)), key=lambda i: (kinds[i][0] != "recv", kinds[i][1]))

            def wait_all():
                for i in order:
                    kind, peer = kinds[i]
                    phase = f"waiting for {what} from" if kind == "recv" else f"waiting to deliver {what} to"
                    self._wait(works[i], op, phase, peer, deadline)

            if self.backend == "gloo":
                self._wait_watched(wait_all, op, f"waiting for {what}")
            else:
                wait_all()
        else:  # a coalesced backend (NCCL) returns one work for the whole batch
            for work in works:
                self._wait_any(work, op, what, sorted({peer for _, peer in kinds}), deadline)
        return recv

    def _wait_any(self, work, op: str, what: str, peers: List[int], deadline: float) -> None:
        """`_wait` for one work that covers several peers (a coalesced batch, a collective): names the first."""
        self._wait(work, op, f"waiting for {what} from one of ranks {peers}, e.g.", peers[0], deadline)

    # -- Transport --------------------------------------------------------------------------------------------

    def exchange_headers(self, op: str, what: str, rows: torch.Tensor) -> torch.Tensor:
        self._check_usable()
        if self._shared is None:  # the first exchange, made by every rank: set up the shared file
            self._shared = HostHeaders.connect(
                self.rank, self.num_ranks, lambda w, r: self._group_headers(op, w, r)) or False
            if self._host_headers is None:
                self._host_headers = self._shared
        self.header_rounds += 1
        if self._host_headers and self._host_headers.fits(rows):
            try:
                return self._host_headers.exchange(op, what, rows.cpu(), self.timeout_s,
                                                   lambda waiting: self._watch(op, f"waiting for {what}", waiting))
            except EPTimeoutError as error:
                self.failure = error.phase
                raise
            except EPAbortError:
                raise
            except EPError:
                self.failure = "ranks out of step"
                raise
        return self._group_headers(op, what, rows)

    def _group_headers(self, op: str, what: str, rows: torch.Tensor) -> torch.Tensor:
        """`exchange_headers` through the process group."""
        if self.backend == "nccl":
            return self._gather_headers(op, what, rows)
        rows = rows.to(device=self.device, dtype=torch.int64).contiguous()
        width = rows.size(1)
        send = [rows[p].view(torch.uint8) for p in range(self.num_ranks)]
        recv = self._exchange(op, what, send, [width * 8] * self.num_ranks)
        return torch.stack([r.view(torch.int64) for r in recv]).cpu()

    def _gather_headers(self, op: str, what: str, rows: torch.Tensor) -> torch.Tensor:
        """`exchange_headers` on NCCL: one all-gather of every rank's rows (a collective costs the host far less
        than a batch of point-to-point messages), on a stream of its own (``cuStreamCreate``), so that it waits
        for no GPU work queued before it: a call's headers cross while the GPU still runs earlier work."""
        if self._header_stream is None:
            from ..cuda_driver import StreamOps

            self._stream_ops = StreamOps(self.device)  # owns the stream: destroyed with it
            self._header_stream = self._stream_ops.new_stream()
        with torch.cuda.stream(self._header_stream):
            rows = rows.to(device=self.device, dtype=torch.int64).contiguous()
            gathered = torch.empty(self.num_ranks, *rows.shape, dtype=torch.int64, device=self.device)
            deadline = time.monotonic() + self.timeout_s
            work = all_gather_into_tensor(gathered, rows, group=self.group, async_op=True)
            peers = [p for p in range(self.num_ranks) if p != self.rank]
            if peers:
                self._wait_any(work, op, what, peers, deadline)
            return gathered[:, self.rank].cpu()  # row q: what rank q sent this rank

    @property
    def one_node(self) -> bool:
        """Whether every rank is on this machine (the header file in shared memory is mapped by every rank: known,
        and the same on every rank, after the first header exchange)."""
        return bool(self._shared)

    def check_usable(self) -> None:
        """Raise `EPError` if this transport failed (a timeout, a lost peer, an abort): the group's connections may
        be broken."""
        self._check_usable()

    # -- the layout ---------------------------------------------------------------------------------------------

    def _state(self, handle: "DispatchHandle", counts: Optional[List[List[int]]] = None) -> ReferenceState:
        """This transport's plan of ``handle``: made here by an uncached dispatch (``counts`` from the header
        exchange, else from ``rank_prefix_matrix``), or at the first use of a layout another transport made (its
        rows as that transport placed them)."""
        if isinstance(handle.transport_state, ReferenceState):
            return handle.transport_state
        if handle.transport_state is None:  # a new layout of this transport
            handle.rank_prefix_matrix = rank_prefix_matrix_from_counts(counts, self.device)
            column = [sum(row[self.rank] for row in counts[:p + 1]) for p in range(self.num_ranks)]
            handle.transport_state = self._plan(handle, column, None)
            return handle.transport_state
        if handle.reference_state is None:
            column = handle.rank_prefix_matrix[:, self.rank].cpu().tolist()
            handle.reference_state = self._plan(handle, column, self._placed_rows(handle))
        return handle.reference_state

    def _plan(self, handle: "DispatchHandle", column: List[int], rows: Optional[torch.Tensor]) -> ReferenceState:
        recv_counts = [column[0]] + [column[p] - column[p - 1] for p in range(1, self.num_ranks)]
        send_token_idx = [torch.nonzero(handle.is_token_in_rank[:, p]).flatten() for p in range(self.num_ranks)]
        return ReferenceState(send_token_idx=send_token_idx,
                              send_counts=[int(idx.numel()) for idx in send_token_idx], recv_counts=recv_counts,
                              recv_offsets=[column[p] - recv_counts[p] for p in range(self.num_ranks)], rows=rows)

    @staticmethod
    def _placed_rows(handle: "DispatchHandle") -> torch.Tensor:
        """For a layout whose rows another transport placed: ``perm`` (int64 ``[num_recv_tokens]``) with this
        transport's row i = the handle's row ``perm[i]``. This transport puts the rows from each source in the
        source's token order; a device transport need not (`nvlink_copy_engine` fills rows its copies skip with
        later tokens), and ``recv_src_idx`` names each row's token. Made on the device (no host synchronization)."""
        # a handle made inside a CUDA graph capture has no host count (-1): its recv_src_idx covers every padded row,
        # and rows past the received ones get source R here, so they stay after them, among themselves
        n = handle.num_recv_tokens if handle.num_recv_tokens >= 0 else handle.recv_src_idx.numel()
        ends = handle.rank_prefix_matrix[:, handle.rank].to(torch.int64)  # where each source's rows end
        rows = torch.arange(n, dtype=torch.int64, device=ends.device)
        source = torch.searchsorted(ends, rows, right=True)
        key = source * 2**32 + handle.recv_src_idx[:n].to(device=ends.device, dtype=torch.int64)
        return torch.argsort(key, stable=True)

    # -- Transport ----------------------------------------------------------------------------------------------

    def dispatch(self, handle: "DispatchHandle", tokens: Tokens, *, num_sms: int, stream=None) -> Received:
        """`Transport.dispatch` (``num_sms`` and ``stream`` have no effect: the messages are torch.distributed's).
        FP8 values come quantized (`Capabilities.quantizes` is empty)."""
        cached = handle.transport_state is not None
        state = self._state(handle, tokens.counts)
        fields = [tokens.values, tokens.scales, tokens.topk_idx, tokens.topk_weights]
        payload = [t for t in fields if t is not None]
        if not cached:
            num_tokens = handle.num_tokens
            payload.append(torch.arange(num_tokens, dtype=torch.int32, device=self.device).view(num_tokens, 1))
        received = iter(self.move_rows("dispatch", handle, payload, state))
        got = [_rows_from_reference(next(received), state.rows) if t is not None else None for t in fields]
        if not cached:  # padded to the received rows, as DeepEP's, with -1 (DeepEP leaves them unwritten)
            handle.recv_src_idx = next(received)[:, 0].contiguous()
            handle.recv_src_idx[handle.num_recv_tokens:] = -1
        values, scales, topk_idx, topk_weights = got
        if topk_idx is not None:
            topk_idx[handle.num_recv_tokens:] = -1
            topk_idx = to_local_expert_ids(topk_idx, self.rank, tokens.num_local_experts)
        return Received(values, scales, topk_idx, topk_weights)

    def combine(self, handle: "DispatchHandle", x: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], *,
                num_sms: int, stream=None) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """`Transport.combine`: fp32 sums (``num_sms`` and ``stream`` have no effect)."""
        state = self._state(handle)
        rows = handle.num_recv_rows
        summed_x, summed_weights = self.sum_rows(
            "combine", handle, [_rows_to_reference(x[:rows], state.rows) if x is not None else None,
                                _rows_to_reference(topk_weights[:rows], state.rows) if topk_weights is not None
                                else None], state)
        return summed_x, summed_weights

    # -- rows of any dtypes -------------------------------------------------------------------------------------

    def move_rows(self, op: str, handle: "DispatchHandle", fields: List[torch.Tensor], state: ReferenceState) \
            -> List[torch.Tensor]:
        """
        Per-token rows `[num_tokens, k_i]` of any dtypes to the ranks in `handle.is_token_in_rank`; returned as
        `[handle.num_recv_rows, k_i]`, ordered by source rank then token; padding rows zero.
        """
        layout = state
        widths = [_inner_numel(f) * f.element_size() for f in fields]
        row_bytes = sum(widths)
        send = [pack_rows([f[idx] for f in fields]).flatten() for idx in layout.send_token_idx]
        self._count(op, row_bytes, layout.send_counts)
        recv = self._exchange(op, "tokens", send, [n * row_bytes for n in layout.recv_counts])
        out = [torch.zeros(handle.num_recv_rows, *f.shape[1:], dtype=f.dtype, device=self.device) for f in fields]
        for peer in range(self.num_ranks):
            count, start = layout.recv_counts[peer], layout.recv_offsets[peer]
            if count == 0:
                continue
            rows = recv[peer].view(count, row_bytes)
            col = 0
            for f, o, w in zip(fields, out, widths):
                o[start:start + count] = unpack_column(rows, col, w, f)
                col += w
        return out

    def _count(self, op: str, row_bytes: int, rows_to: List[int]) -> None:
        """`last_traffic` of a flat exchange that sends ``rows_to[p]`` rows of ``row_bytes`` to each rank p."""
        node = self.rank // self.ranks_per_node
        traffic = Traffic(op, row_bytes=row_bytes, local_rows=rows_to[self.rank])
        for peer, rows in enumerate(rows_to):
            if peer == self.rank or rows == 0:
                continue
            traffic.messages += 1
            if peer // self.ranks_per_node == node:
                traffic.intranode_rows += rows
            else:
                traffic.internode_rows += rows
        traffic.intranode_bytes, traffic.internode_bytes = (traffic.intranode_rows * row_bytes,
                                                            traffic.internode_rows * row_bytes)
        self.last_traffic = traffic

    def sum_rows(self, op: str, handle: "DispatchHandle", fields: List[Optional[torch.Tensor]],
                 state: ReferenceState) -> List[Optional[torch.Tensor]]:
        """The reverse of `move_rows`: fields `[handle.num_recv_rows, k_i]` (or None) back to their tokens' ranks,
        summed there in fp32: `[num_tokens, k_i]` float32 (None where the field was None); zero for tokens
        dispatched nowhere."""
        layout = state
        present = [f for f in fields if f is not None]
        widths = [_inner_numel(f) * f.element_size() for f in present]
        row_bytes = sum(widths)
        send = [pack_rows([f[start:start + count] for f in present]).flatten()
                for start, count in zip(layout.recv_offsets, layout.recv_counts)]
        self._count(op, row_bytes, layout.recv_counts)
        recv = self._exchange(op, "tokens", send, [n * row_bytes for n in layout.send_counts])
        sums = [torch.zeros(handle.num_tokens, *f.shape[1:], dtype=torch.float32, device=self.device)
                for f in present]
        for peer in range(self.num_ranks):
            count = layout.send_counts[peer]
            if count == 0:
                continue
            rows = recv[peer].view(count, row_bytes)
            col = 0
            for f, s, w in zip(present, sums, widths):
                values = unpack_column(rows, col, w, f)
                s.index_add_(0, layout.send_token_idx[peer].to(self.device), values.float())
                col += w
        result, it = [], iter(sums)
        for f in fields:
            result.append(next(it) if f is not None else None)
        return result
