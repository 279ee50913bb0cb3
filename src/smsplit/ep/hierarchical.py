"""The hierarchical transport: DeepSeek-V3's dispatch and combine across nodes, on `torch.distributed`
point-to-point messages (gloo on CPU, NCCL on GPUs: the same calls; nothing home-made at the network level).

A group of R ranks forms N nodes of P ranks (`smsplit.nodes.NodeLayout`; rank ``(n, l) = n * P + l``).

Dispatch. A token of rank ``(n, l)`` crosses the network at most once per target node ``m != n`` (a node holding
one of its experts), to rank ``(m, l)``: the *forwarder*, with the source's local index, which passes it on inside
node ``m`` to every rank there that holds one of its experts (itself included). On its own node the source is its
own forwarder. The tokens a rank sends to node ``m`` form a list in token order; chunk ``c`` is tokens
``[c * C, (c + 1) * C)`` of it (C = ``chunk_tokens``, DeepEP's ``num_max_rdma_chunked_send_tokens``). Every rank
walks the same stages: in stage ``c`` it sends chunk ``c`` of each of its lists over the network and receives
chunk ``c`` of each source node's list, while it forwards the network chunks that landed in stage ``c - 1`` (and
chunk ``c`` of its own node's list); so forwarding of chunk ``c`` starts as it lands, while chunk ``c + 1`` is
still on the wire. Each stage is one batch of point-to-point operations (``batch_isend_irecv``): on NCCL, whose
operations run in order on one stream, a stage only waits for operations of the same stage on the peers, so the
stages cannot deadlock; on gloo every operation carries a tag of its phase and stage.

Every message size is known before its receive is posted, from three small notify rounds made before the data:
(1) each rank's token counts per node (skipped where `Tokens.node_counts` has them: the buffer's header),
(2) over the network, to each forwarder, the per-token masks of the local ranks of its node that need each token,
(3) inside the node, from each forwarder to each rank, the rows it will get per source node and chunk.

FP8 on the network leg: with `Tokens.quantize` (bf16/fp16/fp32 values) each send chunk is quantized 1x128
(`smsplit.fp8.quantize_activations`) when it is packed, so its rows cross the network, and are forwarded, as e4m3
values and fp32 scales; e4m3 input (values and scales) moves as it is; other values move as they are.

The received rows, `rank_prefix_matrix` and `recv_src_idx` are the reference transport's: ordered by source rank,
then by the source's token order; so `ReferenceTransport` reads a layout this transport made.

Combine, the reverse: every rank sends each of its received rows back to the forwarder of its token (the rank of
its own node with the source's local index); the forwarder sums each token's rows of its node in fp32 (in
local-index order), rounds the sum to the values' dtype (what crosses the network: one row per token and node,
BF16 for BF16; the top-k weights stay fp32) and sends it, chunk by chunk, to the source, which adds the nodes'
rows in fp32, in node order.

Counted traffic: after each call, `last_traffic` (`Traffic`) holds the rows and bytes this rank posted across
node boundaries, to other ranks of its node, and the rows of its own tokens it kept, counted from the messages it
posted; `message_log`, when a test sets it to a list, gets a `Message` for every message posted and completed.

Waits: every wait is bounded by the reference transport's ``timeout_s`` and raises `EPTimeoutError` naming the
phase, the peer rank and its node; failures and aborts go through the reference transport (the buffer's header
channel), whose failure state this transport shares: after one, both refuse further calls.

CUDA tensors on a gloo group (ranks sharing one GPU in the tests; NCCL refuses two ranks on one GPU): the rows
are packed and quantized on the GPU, each message is copied to the host for gloo and each received one copied
back to the GPU (staged through the host). On an NCCL group the messages go from and to GPU memory directly.
"""

import numbers
import time
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..fp8 import quantize_activations
from .reference import FLOAT_DTYPES, ReferenceTransport, _reference_bytes, pack_rows
from .rows import rank_prefix_matrix_from_counts, to_local_expert_ids
from .hierarchical_plan import HierarchicalState, Message, _chunks, _likes, _Op, _unpack, _widths
from .transport import Capabilities, EPError, Received, Tokens, Traffic, Transport

if TYPE_CHECKING:  # (smsplit.nodes imports smsplit.ep.layout: imported where needed, after the package)
    from ..nodes import NodeLayout

DEFAULT_CHUNK_TOKENS = 128  # DeepEP's default num_max_rdma_chunked_send_tokens is of this order

# gloo tags: phase code << 16 | stage (a stage finishes before the next starts, so stages may wrap)
_PHASES = {"counts": 1, "masks": 2, "chunk counts": 3, "network": 4, "forward": 5, "return": 6, "sums": 7}
_NOTIFY = ("counts", "masks", "chunk counts")


class HierarchicalTransport(Transport):
    """
    `Buffer`'s ``backend="hierarchical"`` (see the module's docstring).

    Arguments:
        reference: the buffer's `ReferenceTransport` (its header channel): its group, device and ``timeout_s``,
            its bounded waits, abort watching and failure state are this transport's.
        nodes: the group's `NodeLayout` (``nodes.group_size`` must be the group's size), or ranks per node as an
            int (the group's size must be a multiple of it).
        chunk_tokens: C, tokens per chunk of a source's list for one node (DeepEP's
            ``Config.num_max_rdma_chunked_send_tokens``).

    Raises:
        ValueError: a layout that does not fit the group, or a bad ``chunk_tokens``, on every rank, before anything
            moves.
    """

    name = "hierarchical"

    @classmethod
    def capabilities(cls) -> Capabilities:
        every = FLOAT_DTYPES | {torch.float8_e4m3fn}
        return Capabilities(moves=every, quantizes=FLOAT_DTYPES, combines=FLOAT_DTYPES, weights_only=True,
                            capture="never", reads_any_layout=False, needs_cuda=False, one_node=False,
                            needs_buffer=False, hidden_multiple=1, max_topk=0, max_ranks=0,
                            buffer_bytes=_reference_bytes, hierarchical=True)

    def __init__(self, reference: ReferenceTransport, nodes: Union["NodeLayout", int],
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        from ..nodes import NodeLayout

        if not isinstance(reference, ReferenceTransport):
            raise ValueError(f"reference: expected the buffer's ReferenceTransport, got {type(reference).__name__}")
        super().__init__(reference.group, reference.device, reference.timeout_s)
        if isinstance(nodes, numbers.Integral) and not isinstance(nodes, bool):
            if nodes < 1 or self.num_ranks % nodes:
                raise ValueError(f"ranks_per_node={nodes} does not divide the group's {self.num_ranks} ranks into "
                                 f"whole nodes")
            nodes = NodeLayout(int(nodes), self.num_ranks // int(nodes))
        if not isinstance(nodes, NodeLayout):
            raise ValueError(f"nodes: expected a smsplit.nodes.NodeLayout or ranks per node, got {nodes!r}")
        if nodes.group_size != self.num_ranks:
            raise ValueError(f"nodes: a layout of {nodes.num_nodes} nodes x {nodes.ranks_per_node} ranks does not "
                             f"fit the group's {self.num_ranks} ranks")
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, numbers.Integral) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
        self.reference = reference
        self.nodes = nodes
        self.chunk_tokens = int(chunk_tokens)
        self.backend = reference.backend
        self.global_ranks = reference.global_ranks
        self.last_traffic: Optional[Traffic] = None
        self.message_log: Optional[List[Message]] = None
        # gloo moves host memory: CUDA tensors on a gloo group are staged through the host
        self._staged = self.backend == "gloo" and torch.device(self.device).type != "cpu"
        self._traffic: Optional[Traffic] = None  # the call's, while it runs

    def tokens_per_node(self, is_token_in_rank: torch.Tensor) -> List[int]:
        """This rank's row of `Tokens.node_counts`: how many of its tokens (``is_token_in_rank``, ``[tokens, R]``)
        go to each node (to any of its ranks). `Buffer` can put these N numbers into its header, so that an
        uncached dispatch skips the first notify round."""
        from ..nodes import tokens_per_node

        return tokens_per_node(is_token_in_rank, self.nodes).tolist()

    # -- messaging ----------------------------------------------------------------------------------------------

    def _who(self, rank: int) -> str:
        return f"rank {rank} (node {rank // self.nodes.ranks_per_node})"

    def _describe(self, o: _Op) -> str:
        """The phase of a wait for ``o`` (the peer, with its node, follows it in the error)."""
        if o.phase in _NOTIFY:
            what = {"counts": "the token counts per node", "masks": "the local-rank masks of the tokens",
                    "chunk counts": "the row counts per chunk"}[o.phase]
        else:
            if o.source == o.peer:
                whose = "its tokens"
            elif o.source == self.rank:
                whose = "this rank's tokens"
            else:
                whose = f"the tokens of {self._who(o.source)}"
            what = {"return": "the expert outputs of ", "sums": "the node sums of "}.get(o.phase, "")
            what += f"chunk {o.chunk} of {whose}"
        return f"{o.phase}: waiting for {what} from" if o.kind == "recv" else \
            f"{o.phase}: waiting to deliver {what} to"

    def _log(self, op: str, o: _Op, event: str) -> None:
        if self.message_log is not None:
            self.message_log.append(Message(op, o.phase, o.kind, o.peer, o.chunk, o.source, o.rows,
                                            int(o.tensor.numel()), event, len(self.message_log)))

    def _count(self, o: _Op) -> None:
        traffic = self._traffic
        nbytes = int(o.tensor.numel())
        traffic.messages += 1
        if o.phase in _NOTIFY:
            traffic.notify_bytes += nbytes
        elif o.peer // self.nodes.ranks_per_node != self.rank // self.nodes.ranks_per_node:
            traffic.internode_rows += o.rows
            traffic.internode_bytes += nbytes
        else:
            traffic.intranode_rows += o.rows
            traffic.intranode_bytes += nbytes

    def _stage(self, op: str, stage: int, ops: List[_Op]) -> None:
        """Post ``ops`` as one batch and wait for all of them, each wait bounded by ``timeout_s`` (receives first:
        a peer that never arrives is named by the first receive that times out)."""
        ref = self.reference
        ref._check_usable()
        ops = [o for o in ops if o.tensor.numel() > 0]
        if not ops:
            return
        p2p = []
        for o in ops:
            if self._staged:
                o.wire = o.tensor.cpu() if o.kind == "send" else torch.empty(o.tensor.numel(), dtype=torch.uint8)
            else:
                o.wire = o.tensor.contiguous()
            p2p.append(dist.P2POp(dist.isend if o.kind == "send" else dist.irecv, o.wire, self.global_ranks[o.peer],
                                  self.group, tag=(_PHASES[o.phase] << 16) | (stage & 0xFFFF)))
        phases = " and ".join(dict.fromkeys(o.phase for o in ops))
        deadline = time.monotonic() + self.timeout_s
        try:
            works = dist.batch_isend_irecv(p2p)
        except RuntimeError as error:  # (gloo: a peer's connection closed, e.g. after it gave up)
            peers = sorted({o.peer for o in ops})
            message = f"{op}: posting {phases} messages to and from ranks {peers}"
            ref.failure = ref.failure or message
            raise EPError(f"{message} failed: {error}") from error
        for o in ops:
            self._log(op, o, "posted")
            if o.kind == "send":
                self._count(o)
        if len(works) == len(ops):
            order = sorted(range(len(ops)), key=lambda i: ops[i].kind != "recv")

            def wait_all():
                for i in order:
                    o = ops[i]
                    ref._wait(works[i], op, self._describe(o), o.peer, deadline, self._who(o.peer))
                    self._log(op, o, "completed")

            if self.backend == "gloo":
                ref._wait_watched(wait_all, op, f"waiting for {phases} messages")
            else:
                wait_all()
        else:  # a coalesced backend (NCCL) returns one work for the whole batch
            peers = sorted({o.peer for o in ops})
            for work in works:
                ref._wait(work, op, f"{phases}: waiting for the messages of stage {stage} with ranks {peers}, e.g.",
                          peers[0], deadline, self._who(peers[0]))
            for o in ops:
                self._log(op, o, "completed")
        if self._staged:
            for o in ops:
                if o.kind == "recv":
                    o.tensor.copy_(o.wire)

    # -- the layout ---------------------------------------------------------------------------------------------

    def _plan(self, handle, tokens: Tokens) -> HierarchicalState:
        """The notify rounds of a new layout, and the plan of its stages."""
        op = "dispatch"
        R, P, N = self.num_ranks, self.nodes.ranks_per_node, self.nodes.num_nodes
        me = self.rank
        a, l = divmod(me, P)
        C = self.chunk_tokens
        device = self.device
        mask = handle.is_token_in_rank.to(device=device, dtype=torch.bool)
        T = mask.size(0)
        per_node = mask.view(T, N, P)
        hit = per_node.any(-1)
        send_lists = [torch.nonzero(hit[:, m]).flatten() for m in range(N)]
        send_masks = [per_node[send_lists[m], m] for m in range(N)]
        to_node = [int(t.numel()) for t in send_lists]

        # (1) the tokens each rank sends to this rank's node
        if tokens.node_counts is not None:
            column = [int(tokens.node_counts[s][a]) for s in range(R)]
        else:
            ops, got = [], {}
            for q in range(R):
                if q == me:
                    continue
                count = torch.tensor([to_node[q // P]], dtype=torch.int64, device=device)
                ops.append(_Op("send", q, "counts", -1, me, 0, count.view(torch.uint8)))
                got[q] = torch.empty(8, dtype=torch.uint8, device=device)
                ops.append(_Op("recv", q, "counts", -1, q, 0, got[q]))
            self._stage(op, 0, ops)
            column = [to_node[a] if q == me else int(got[q].view(torch.int64)[0]) for q in range(R)]

        # (2) over the network, to each forwarder: which of its node's ranks need each token
        ops, got = [], {}
        for m in range(N):
            if m != a and to_node[m]:
                ops.append(_Op("send", m * P + l, "masks", -1, me, 0,
                               send_masks[m].to(torch.uint8).contiguous().view(-1)))
        for n in range(N):
            s = n * P + l
            if n != a and column[s]:
                got[n] = torch.empty(column[s] * P, dtype=torch.uint8, device=device)
                ops.append(_Op("recv", s, "masks", -1, s, 0, got[n]))
        self._stage(op, 0, ops)
        fwd_masks = []
        for n in range(N):
            if n == a:
                fwd_masks.append(send_masks[a])
            elif n in got:
                fwd_masks.append(got[n].view(-1, P).bool())
            else:
                fwd_masks.append(torch.zeros(0, P, dtype=torch.bool, device=device))
        fwd_counts = []
        for m in fwd_masks:
            per_chunk = torch.zeros(_chunks(m.size(0), C), P, dtype=torch.int64, device=device)
            per_chunk.index_add_(0, torch.arange(m.size(0), device=device) // C, m.to(torch.int64))
            fwd_counts.append(per_chunk.tolist())

        # (3) inside the node, from each forwarder to each rank: its rows per source node and chunk
        ops, got = [], {}
        for j in range(P):
            if j == l:
                continue
            rows = [fwd_counts[n][c][j] for n in range(N) for c in range(len(fwd_counts[n]))]
            if rows:
                ops.append(_Op("send", a * P + j, "chunk counts", -1, me, 0,
                               torch.tensor(rows, dtype=torch.int32, device=device).view(torch.uint8)))
            expected = sum(_chunks(column[n * P + j], C) for n in range(N))
            if expected:
                got[j] = torch.empty(expected * 4, dtype=torch.uint8, device=device)
                ops.append(_Op("recv", a * P + j, "chunk counts", -1, a * P + j, 0, got[j]))
        self._stage(op, 0, ops)
        recv_counts: List[List[int]] = [[] for _ in range(R)]
        for n in range(N):
            recv_counts[n * P + l] = [fwd_counts[n][c][l] for c in range(len(fwd_counts[n]))]
        for j, buf in got.items():
            values, at = buf.view(torch.int32).tolist(), 0
            for n in range(N):
                k = _chunks(column[n * P + j], C)
                recv_counts[n * P + j] = values[at:at + k]
                at += k
        recv_starts: List[List[int]] = []
        row = 0
        for s in range(R):
            total = sum(recv_counts[s])
            if tokens.counts is not None and total != tokens.counts[s][me]:
                self.reference.failure = self.reference.failure or "ranks out of step"
                raise EPError(f"dispatch: rank {me} is told {total} rows from {self._who(s)} by its node's "
                              f"forwarder, the header says {tokens.counts[s][me]}: ranks out of step")
            starts = []
            for count in recv_counts[s]:
                starts.append(row)
                row += count
            recv_starts.append(starts)
        return HierarchicalState(C, send_lists, fwd_masks, fwd_counts, recv_counts, recv_starts)

    def _own_state(self, handle) -> HierarchicalState:
        state = handle.transport_state
        if not isinstance(state, HierarchicalState):
            raise ValueError(f"handle: the hierarchical backend moves only layouts its own dispatches made; this "
                             f"handle's dispatch ran on {handle.transport or 'another transport'}")
        return state

    # -- Transport ----------------------------------------------------------------------------------------------

    def dispatch(self, handle, tokens: Tokens, *, num_sms: int, stream=None) -> Received:
        """`Transport.dispatch` (``num_sms`` and ``stream`` have no effect: the messages are torch.distributed's).
        An uncached dispatch needs ``tokens.counts`` (the header's), for `rank_prefix_matrix`."""
        op = "dispatch"
        self.reference._check_usable()
        cached = handle.transport_state is not None
        if cached:
            state = self._own_state(handle)
        elif tokens.counts is None:
            raise ValueError("tokens.counts: an uncached dispatch of the hierarchical backend needs the header's "
                             "token counts (rank_prefix_matrix)")
        self._traffic = Traffic(op)
        if not cached:
            state = self._plan(handle, tokens)
        P, N = self.nodes.ranks_per_node, self.nodes.num_nodes
        me = self.rank
        a, l = divmod(me, P)
        device = self.device
        values = tokens.values
        quantize = bool(tokens.quantize) and values is not None and values.dtype in FLOAT_DTYPES
        fields = [t for t in (values, tokens.scales, tokens.topk_idx, tokens.topk_weights) if t is not None]
        present = [t is not None for t in (values, tokens.scales, tokens.topk_idx, tokens.topk_weights)]
        if not cached:
            fields.append(torch.arange(handle.num_tokens, dtype=torch.int32, device=device).view(-1, 1))
        fields = [f.to(device) for f in fields]
        quantize_first = quantize and present[0]
        likes = _likes(fields, quantize_first)
        row_bytes = sum(_widths(likes))
        self._traffic.row_bytes = row_bytes
        recv = torch.zeros(handle.num_recv_rows, row_bytes, dtype=torch.uint8, device=device)
        crossings = torch.zeros(handle.num_tokens, dtype=torch.int64, device=device)  # per token: network lists

        def pack(idx: torch.Tensor) -> torch.Tensor:
            """The rows of tokens ``idx``, packed (and quantized) as one chunk: ``[len(idx), row_bytes]``."""
            parts = []
            for i, f in enumerate(fields):
                rows = f.index_select(0, idx)
                if i == 0 and quantize_first:
                    parts.extend(quantize_activations(rows))
                else:
                    parts.append(rows)
            return pack_rows(parts)

        C = state.chunk_tokens
        to_node = [int(t.numel()) for t in state.send_lists]
        from_node = [int(m.size(0)) for m in state.fwd_masks]
        stages = max([_chunks(c, C) for c in to_node + from_node] + [len(c) for c in state.recv_counts] + [0]) + 1
        landed: Dict[int, torch.Tensor] = {}
        for stage in range(stages):
            ops: List[_Op] = []
            # network: chunk `stage` of each of this rank's lists for the other nodes, to their forwarders
            for m in range(N):
                if m == a or stage >= _chunks(to_node[m], C):
                    continue
                idx = state.chunk(state.send_lists[m], stage)
                crossings.index_add_(0, idx, torch.ones_like(idx))
                ops.append(_Op("send", m * P + l, "network", stage, me, int(idx.numel()), pack(idx).view(-1)))
            arriving: Dict[int, torch.Tensor] = {}
            for n in range(N):
                if n == a or stage >= _chunks(from_node[n], C):
                    continue
                rows = min(C, from_node[n] - stage * C)
                arriving[n] = torch.empty(rows, row_bytes, dtype=torch.uint8, device=device)
                ops.append(_Op("recv", n * P + l, "network", stage, n * P + l, rows, arriving[n].view(-1)))
            # forward: chunk `stage` of this rank's own list for its node, and the network chunks of stage - 1
            for n in range(N):
                c = stage if n == a else stage - 1
                if c < 0 or c >= _chunks(from_node[n], C):
                    continue
                chunk = pack(state.chunk(state.send_lists[a], c)) if n == a else landed[n]
                source = n * P + l
                for j in range(P):
                    count = state.fwd_counts[n][c][j]
                    if count == 0:
                        continue
                    rows = chunk.index_select(0, state.selection(n, c, j))
                    if j == l:
                        start = state.recv_starts[source][c]
                        recv[start:start + count] = rows
                        if n == a:
                            self._traffic.local_rows += count
                    else:
                        ops.append(_Op("send", a * P + j, "forward", c, source, count, rows.view(-1)))
            # the rows the node's other forwarders pass on to this rank (in source-node order, as they send them)
            for j in range(P):
                if j == l:
                    continue
                for n in range(N):
                    s = n * P + j
                    c = stage if n == a else stage - 1
                    if c < 0 or c >= len(state.recv_counts[s]) or state.recv_counts[s][c] == 0:
                        continue
                    count, start = state.recv_counts[s][c], state.recv_starts[s][c]
                    ops.append(_Op("recv", a * P + j, "forward", c, s, count, recv[start:start + count].view(-1)))
            self._stage(op, stage, ops)
            landed = arriving

        self._traffic.max_nodes_crossed = int(crossings.max()) if handle.num_tokens else 0
        self.last_traffic, self._traffic = self._traffic, None
        got = iter(_unpack(recv, likes))
        if quantize_first:
            out_values, out_scales = next(got), next(got)
        else:
            out_values = next(got) if present[0] else None
            out_scales = next(got) if present[1] else None
        topk_idx = next(got) if present[2] else None
        topk_weights = next(got) if present[3] else None
        if not cached:
            handle.transport_state = state
            handle.rank_prefix_matrix = rank_prefix_matrix_from_counts(tokens.counts, device)
            # padded to the received rows, as DeepEP's, with -1 (DeepEP leaves them unwritten)
            handle.recv_src_idx = next(got)[:, 0].contiguous()
            handle.recv_src_idx[handle.num_recv_tokens:] = -1
        if topk_idx is not None:
            topk_idx[handle.num_recv_tokens:] = -1
            topk_idx = to_local_expert_ids(topk_idx, me, tokens.num_local_experts)
        return Received(out_values, out_scales, topk_idx, topk_weights)

    def combine(self, handle, x: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], *, num_sms: int,
                stream=None) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """`Transport.combine`: per-node fp32 sums rounded to ``x``'s dtype on the forwarders, their fp32 sum on
        the source (``num_sms`` and ``stream`` have no effect)."""
        op = "combine"
        self.reference._check_usable()
        state = self._own_state(handle)
        P, N = self.nodes.ranks_per_node, self.nodes.num_nodes
        me = self.rank
        a, l = divmod(me, P)
        device = self.device
        C = state.chunk_tokens
        rows_in = handle.num_recv_rows
        fields = [f[:rows_in].to(device) for f in (x, topk_weights) if f is not None]
        present = [x is not None, topk_weights is not None]
        if not fields:
            return None, None
        likes = _likes(fields, False)
        row_bytes = sum(_widths(likes))
        self._traffic = Traffic(op, row_bytes=row_bytes)
        to_node = [int(t.numel()) for t in state.send_lists]
        from_node = [int(m.size(0)) for m in state.fwd_masks]
        stages = max([_chunks(c, C) for c in to_node + from_node] + [len(c) for c in state.recv_counts] + [0]) + 1
        own_sums: Dict[int, List[torch.Tensor]] = {}  # chunk -> this node's sums of this rank's own tokens
        node_sums: Dict[Tuple[int, int], torch.Tensor] = {}  # (node, chunk) -> packed sums from another node
        pending: Dict[int, torch.Tensor] = {}  # source node -> packed sums of the previous stage's chunk
        for stage in range(stages):
            ops: List[_Op] = []
            # return: this rank's rows of chunk `stage` of each source's list, to the source's forwarder
            for j in range(P):
                if j == l:
                    continue
                for n in range(N):
                    s = n * P + j
                    if stage >= len(state.recv_counts[s]) or state.recv_counts[s][stage] == 0:
                        continue
                    count, start = state.recv_counts[s][stage], state.recv_starts[s][stage]
                    ops.append(_Op("send", a * P + j, "return", stage, s, count,
                                   pack_rows([f[start:start + count] for f in fields]).view(-1)))
            returned: Dict[Tuple[int, int], torch.Tensor] = {}
            for j in range(P):
                if j == l:
                    continue
                for n in range(N):
                    if stage >= len(state.fwd_counts[n]) or state.fwd_counts[n][stage][j] == 0:
                        continue
                    count = state.fwd_counts[n][stage][j]
                    returned[(n, j)] = torch.empty(count, row_bytes, dtype=torch.uint8, device=device)
                    ops.append(_Op("recv", a * P + j, "return", stage, n * P + l, count,
                                   returned[(n, j)].view(-1)))
            # sums: this node's sums of the previous stage's chunks to their sources, and this rank's from others
            for n in range(N):
                if n in pending:
                    rows = pending[n].size(0)
                    ops.append(_Op("send", n * P + l, "sums", stage - 1, n * P + l, rows, pending[n].view(-1)))
            for m in range(N):
                c = stage - 1
                if m == a or c < 0 or c >= _chunks(to_node[m], C):
                    continue
                rows = min(C, to_node[m] - c * C)
                node_sums[(m, c)] = torch.empty(rows, row_bytes, dtype=torch.uint8, device=device)
                ops.append(_Op("recv", m * P + l, "sums", c, me, rows, node_sums[(m, c)].view(-1)))
            self._stage(op, stage, ops)
            # this node's sums of chunk `stage` of each source node's list, in fp32 in local-index order, rounded
            pending = {}
            for n in range(N):
                if stage >= len(state.fwd_counts[n]):
                    continue
                length = min(C, from_node[n] - stage * C)
                acc = [torch.zeros(length, *f.shape[1:], dtype=torch.float32, device=device) for f in fields]
                for j in range(P):
                    count = state.fwd_counts[n][stage][j]
                    if count == 0:
                        continue
                    if j == l:
                        start = state.recv_starts[n * P + l][stage]
                        parts = [f[start:start + count] for f in fields]
                        if n == a:
                            self._traffic.local_rows += count
                    else:
                        parts = _unpack(returned[(n, j)], likes)
                    sel = state.selection(n, stage, j)
                    for total, part in zip(acc, parts):
                        total.index_add_(0, sel, part.float())
                rounded = [total.to(f.dtype) for total, f in zip(acc, fields)]
                if n == a:
                    own_sums[stage] = rounded
                else:
                    pending[n] = pack_rows(rounded)

        # the source: the nodes' sums in fp32, in node order
        out = [torch.zeros(handle.num_tokens, *f.shape[1:], dtype=torch.float32, device=device) for f in fields]
        crossings = torch.zeros(handle.num_tokens, dtype=torch.int64, device=device)
        for m in range(N):
            for c in range(_chunks(to_node[m], C)):
                idx = state.chunk(state.send_lists[m], c)
                parts = own_sums[c] if m == a else _unpack(node_sums[(m, c)], likes)
                if m != a:
                    crossings.index_add_(0, idx, torch.ones_like(idx))
                for total, part in zip(out, parts):
                    total.index_add_(0, idx, part.float())
        self._traffic.max_nodes_crossed = int(crossings.max()) if handle.num_tokens else 0
        self.last_traffic, self._traffic = self._traffic, None
        result = iter(out)
        return tuple(next(result) if p else None for p in present)

    # -- Buffer's hooks --------------------------------------------------------------------------------------------

    def check_usable(self) -> None:
        """Raise `EPError` if this transport (or the reference transport it shares its state with) failed."""
        self.reference._check_usable()


def nccl_options(max_ctas: int, min_ctas: int = 1):
    """
    ``torch.distributed.ProcessGroupNCCL.Options`` whose communicator runs at most ``max_ctas`` CTAs per kernel
    (NCCL's ``ncclConfig_t.maxCTAs``; ``min_ctas``: ``minCTAs``). NCCL's kernels run outside smsplit's green contexts,
    so this is how the hierarchical transport's network leg on NCCL stays within a comm budget: pass it where the EP
    group is made, ``dist.new_group(ranks, backend="nccl", pg_options=nccl_options(12))`` (or to
    ``init_process_group``). Fewer CTAs cost NCCL bandwidth on NVLink (each CTA drives a channel); on a 400 Gb/s NIC a
    few saturate the link. The figure for our machines needs two or more GPUs (`bench/internode.py
    --nccl-max-ctas`).

    Raises:
        RuntimeError: this torch build has no NCCL (a CPU build: the transport runs on gloo there).
        ValueError: counts that are not ints with 1 <= min_ctas <= max_ctas <= 64 (NCCL's channel limit).
    """
    if not dist.is_nccl_available():
        raise RuntimeError("nccl_options: this torch build has no NCCL (the hierarchical transport runs on gloo "
                           "there, with no CTAs to cap)")
    for name, value in (("max_ctas", max_ctas), ("min_ctas", min_ctas)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= 64:
            raise ValueError(f"{name}: expected an int in [1, 64], got {value!r}")
    if min_ctas > max_ctas:
        raise ValueError(f"min_ctas={min_ctas} exceeds max_ctas={max_ctas}")
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = int(max_ctas)
    options.config.min_ctas = int(min_ctas)
    return options


__all__ = ["DEFAULT_CHUNK_TOKENS", "HierarchicalState", "HierarchicalTransport", "Message", "nccl_options"]
