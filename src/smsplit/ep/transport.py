"""The interface between `Buffer` and the code that moves tokens between ranks (`Transport`), what a transport can
move (`Capabilities`) and what a call asks of it (`Move`), and the errors they raise.

`Buffer` checks arguments, agrees on them with the other ranks (a header exchange), builds handles and wires
autograd; a transport only moves tokens. Four implement the protocol: the reference transport
(`smsplit.ep.reference`, point-to-point `torch.distributed` messages, any device) and the three device transports of
`smsplit.ep.device` (SM push, copy-engine-assisted SM push, copy engine). `smsplit.ep.registry` names them and
chooses one per call; it is the only place that compares backend names.
"""

import os
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:  # (annotations only: the layout module holds Triton kernels, which this one needs not)
    from .layout import DispatchHandle


def symmetric_buffer(numel: int, dtype: torch.dtype, group, device: torch.device) -> Tuple[torch.Tensor, object]:
    """A buffer of ``numel`` elements in torch symmetric memory on ``device`` and its rendezvous handle over
    ``group`` (``handle.buffer_ptrs``: every rank's buffer, mapped into this process), made on every rank."""
    import torch.distributed._symmetric_memory as symm_mem

    name = group.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group") and not symm_mem.is_symm_mem_enabled_for_group(name):
        with warnings.catch_warnings():  # torch 2.11 deprecates the call (not needed there); earlier releases need it
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(name)
    buffer = symm_mem.empty(numel, dtype=dtype, device=device)
    return buffer, symm_mem.rendezvous(buffer, group)


class EPError(RuntimeError):
    """Communication failed (a peer died, ranks called different operations). The buffer is unusable after it."""


class EPAbortError(EPError):
    """
    A peer failed on its own: its `Buffer` call raised an error that the other ranks did not raise with it (say its
    `get_dispatch_layout` rejected an expert id while this rank was in `dispatch`), or its process ended. Raised at
    once by the waits for peers, instead of `EPTimeoutError` at `timeout_s`. The buffer is unusable after it.

    Attributes:
        peer: the rank that failed first (another rank that raised this error passes the same rank on).
        error: what failed there, e.g. "get_dispatch_layout: EPArgumentError: topk_idx: expert ids must lie in
            [-1, 8) (num_experts=8), got values in [0, 9]", or "its process (pid 4242) ended".
    """

    def __init__(self, message: str, peer: int, error: str) -> None:
        super().__init__(message)
        self.peer = peer
        self.error = error


class EPTimeoutError(TimeoutError):
    """
    A peer did not arrive within the buffer's `timeout_s`. The buffer is unusable after it.

    Attributes:
        peer: the rank that did not arrive.
        phase: what this rank was waiting for, e.g. "dispatch: waiting for counts from rank 1".
    """

    def __init__(self, message: str, peer: int, phase: str) -> None:
        super().__init__(message)
        self.peer = peer
        self.phase = phase

    @classmethod
    def on_device(cls, rank: int, peer: int, what: str, timeout_s: float) -> "EPTimeoutError":
        """The error for a wait of a device transport on rank ``rank`` (a kernel's, or its host's) that passed
        ``timeout_s``; ``what`` names the wait and the peer."""
        return cls(f"rank {rank}: {what}; no answer within timeout_s={timeout_s:g}", peer, what)


class EPArgumentError(ValueError):
    """
    An argument is invalid on this or another rank. Raised on every rank, before any token moves.

    Attributes:
        argument: the name of the argument at fault, e.g. "topk_idx".
    """

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


def reject(argument: str, message: str) -> EPArgumentError:
    """The `EPArgumentError` of ``argument``, its message starting with the argument's name."""
    return EPArgumentError(argument, f"{argument}: {message}")


def on_every_rank(error: BaseException) -> BaseException:
    """Mark ``error`` as one that every rank raises in the same call (an argument error the header exchange made
    every rank see, or a check of a captured call, which every rank captures alike): it does not abort the buffer."""
    error.on_every_rank = True
    return error


def worst_tokens_error(rank: int, received: int, num_worst_tokens: int, more: str = "") -> EPArgumentError:
    """The error of a rank that receives more tokens than its `num_worst_tokens` (``more``: appended to the message)."""
    return EPArgumentError("num_worst_tokens", f"num_worst_tokens: rank {rank} receives {received} tokens, more than "
                                               f"num_worst_tokens={num_worst_tokens}{more}")


def check_num_worst_tokens(received: Sequence[int], num_worst_tokens: Sequence[int]) -> None:
    """
    The rule of `num_worst_tokens` against the tokens each rank receives, checked on the host before any token
    moves (by `Buffer` after its header exchange; by a device transport's layout when called without one): rank q's
    ``received[q]`` must fit its ``num_worst_tokens[q]`` where that is positive (0: unpadded).

    Raises:
        EPArgumentError: naming `num_worst_tokens`, the first rank that receives too many, and the counts. (A
            CUDA-graph replay cannot be checked on the host: its kernels record the same case, and the transport's
            `raise_if_failed` raises this error, from `worst_tokens_error`.)
    """
    for rank, (got, worst) in enumerate(zip(received, num_worst_tokens)):
        if 0 < worst < got:
            raise worst_tokens_error(rank, got, worst)


@dataclass(frozen=True)
class Capabilities:
    """
    What a transport can move: the one declaration (`Transport.capabilities`) that the registry's choice and the
    argument checks read.

    Attributes:
        moves: dtypes of values a dispatch moves as they are.
        quantizes: dtypes a dispatch with ``fp8=True`` quantizes to e4m3 inside its kernels (any other dtype with
            ``fp8=True``: `Buffer` quantizes first and hands over e4m3 values, when ``moves`` has e4m3).
        combines: dtypes a combine sums.
        weights_only: whether it moves top-k weights without values (the weights-only backward passes).
        capture: inside a CUDA graph capture: "never", "cached" (dispatches with a handle, and combines) or
            "always" (with ``num_worst_tokens``).
        reads_any_layout: whether a cached dispatch or a combine may reuse a layout another transport made (its
            rows where that transport placed them); else only its own.
        needs_cuda: needs an NCCL group and CUDA tensors.
        one_node: needs every rank on one machine (symmetric memory).
        needs_buffer: needs `num_nvl_bytes` > 0 (its buffer is allocated, per hidden size, at the first dispatch);
            else 0 means "allocate per call" and only a positive `num_nvl_bytes` is checked.
        hidden_multiple: the hidden size must be a multiple of this.
        max_topk: the most top-k columns it moves (0: any).
        max_ranks: the most ranks it serves (0: any).
        buffer_bytes: ``buffer_bytes(num_ranks, max_tokens, hidden, num_topk, x_dtype, fp8, combine_dtype,
            combine_only)``: the `num_nvl_bytes` a dispatch of ``max_tokens`` tokens per rank needs (``combine_only``:
            a dispatch that carries a combine's rows back, the backward of a combine).
        hierarchical: moves a token node by node (once across the network per target node, then inside it):
            "auto" takes it only where the buffer's node layout has several nodes.
    """

    moves: FrozenSet[torch.dtype]
    quantizes: FrozenSet[torch.dtype]
    combines: FrozenSet[torch.dtype]
    weights_only: bool
    capture: str
    reads_any_layout: bool
    needs_cuda: bool
    one_node: bool
    needs_buffer: bool
    hidden_multiple: int
    max_topk: int
    max_ranks: int
    buffer_bytes: Callable[..., int]
    hierarchical: bool = False


class Move(NamedTuple):  # (a tuple: made twice per eager call, it costs a fifth of a frozen dataclass)
    """
    What one call asks a transport to move, from arguments every rank agrees on (the header exchange checks them),
    so that every rank chooses the same transport (`smsplit.ep.registry.choose`).

    Attributes:
        op: "dispatch" or "combine".
        dtype: the values' dtype (e4m3 for FP8 input), None for weights only.
        quantize: ``fp8=True`` with floating-point values.
        hidden: the values' hidden size (0 for weights only).
        num_topk: top-k columns.
        max_tokens: the most tokens a rank dispatches (checked against a buffer's size; 0 for a combine, whose
            dispatch was checked).
        num_sms: the call's SM count; ``sms_argument``: the argument it came from ("config" or "num_sms").
        layout_of: the transport whose dispatch made the layout reused (a cached dispatch, a combine), else None.
        layout_hidden: the hidden size of the dispatch that made that layout (0: none).
        captured: the call is being captured into a CUDA graph.
        worst: ``num_worst_tokens`` of the call (or of its handle's dispatch).
        combine_rows: a dispatch that carries a combine's rows back (the backward of a combine): its size is
            checked against the combine rows alone.
    """

    op: str
    dtype: Optional[torch.dtype]
    quantize: bool = False
    hidden: int = 0
    num_topk: int = 0
    max_tokens: int = 0
    num_sms: int = 1
    sms_argument: str = "num_sms"
    layout_of: Optional[str] = None
    layout_hidden: int = 0
    captured: bool = False
    worst: int = 0
    combine_rows: bool = False


class Environment(NamedTuple):
    """What a `Buffer` runs on, the same on every rank: CUDA tensors on an NCCL group, every rank on one machine
    (known after the constructor's header exchange), its ranks, `num_nvl_bytes`, the GPU's SM count (0: no
    GPU), and the nodes of its node layout (`smsplit.nodes`: real, or emulated with ``ranks_per_node``)."""

    cuda: bool
    one_node: bool
    num_ranks: int
    num_nvl_bytes: int
    device_sms: int
    device: str = "cpu"
    num_nodes: int = 1


@dataclass
class Tokens:
    """
    The payload of one dispatch (`Transport.dispatch`).

    Attributes:
        values: ``[num_tokens, hidden]`` values (e4m3 with ``scales`` for FP8), None for weights only.
        scales: ``[num_tokens, hidden // 128]`` float32 FP8 scales, or None.
        topk_idx: ``[num_tokens, k]`` int64 global expert ids, or None (none in the cached mode).
        topk_weights: ``[num_tokens, k]`` float32, or None.
        quantize: quantize ``values`` to e4m3 inside the transport's kernels (its `Capabilities.quantizes`).
        num_local_experts: experts per rank (for the local expert ids the received top-k ids become).
        counts: an eager uncached dispatch's ``counts[i][j]``, tokens rank i sends to rank j (from the header
            exchange), else None.
        node_counts: an eager uncached dispatch's ``node_counts[i][m]``, tokens rank i sends to node m (to any of
            its ranks; counted once per token and node), for the hierarchical transport (`smsplit.ep.hierarchical`),
            which exchanges them itself where this is None.
    """

    values: Optional[torch.Tensor]
    scales: Optional[torch.Tensor] = None
    topk_idx: Optional[torch.Tensor] = None
    topk_weights: Optional[torch.Tensor] = None
    quantize: bool = False
    num_local_experts: int = 0
    counts: Optional[List[List[int]]] = None
    node_counts: Optional[List[List[int]]] = None


@dataclass
class Received:
    """What a dispatch returns: ``[handle.num_recv_rows, ...]`` tensors, None where nothing of that kind moved;
    ``topk_idx`` as local expert ids (-1 for experts elsewhere and on padding rows), ``scales`` with FP8 values."""

    values: Optional[torch.Tensor]
    scales: Optional[torch.Tensor]
    topk_idx: Optional[torch.Tensor]
    topk_weights: Optional[torch.Tensor]


@dataclass
class Traffic:
    """What one dispatch or combine of this rank posted, counted from its messages (`Transport.last_traffic`,
    `Buffer.last_traffic`). On the hierarchical transport a token crosses the network once per target node; on the
    reference transport (a flat exchange) once per destination rank on another node.

    Attributes:
        op: "dispatch" or "combine".
        row_bytes: bytes of one row in this call's messages (values, FP8 scales, top-k ids and weights, and in an
            uncached dispatch the source index).
        internode_rows / internode_bytes: rows (bytes) this rank sent to ranks on other nodes: hierarchical, a
            dispatch's network chunks (one row per token and target node other than its own), a combine's node
            sums; reference, one row per token and destination rank on another node (a combine: per received row
            whose source is on another node).
        intranode_rows / intranode_bytes: rows (bytes) this rank sent to other ranks of its node: hierarchical, a
            dispatch's forwarded rows, a combine's rows returned to their forwarders; reference, rows to the other
            ranks of its node.
        local_rows: rows of this rank's own tokens that stayed on it (its own experts; no message).
        notify_bytes: bytes of the notify rounds (counts, masks, chunk counts; a dispatch that made its layout).
        messages: messages posted (notify rounds included).
        max_nodes_crossed: a dispatch: the most network crossings of any of this rank's tokens (the number of
            network lists holding it); a combine: the most node sums any of its tokens received over the network.
    """

    op: str
    row_bytes: int = 0
    internode_rows: int = 0
    internode_bytes: int = 0
    intranode_rows: int = 0
    intranode_bytes: int = 0
    local_rows: int = 0
    notify_bytes: int = 0
    messages: int = 0
    max_nodes_crossed: int = 0


class Transport:
    """
    Moves tokens between the ranks of one process group: the protocol every transport implements. The SM count
    and the stream come with each call; nothing about a call is set on the transport beforehand.

    Attributes:
        name: the backend name (`Buffer(backend=...)`).
        group: the `torch.distributed` process group.
        rank: this rank in `group`.
        num_ranks: the size of `group`.
        device: the device of the tensors this transport accepts.
        timeout_s: the longest wait for a peer before `EPTimeoutError`.
    """

    name = "abstract"
    last_traffic: Optional[Traffic] = None  # what the last dispatch or combine posted (None: not counted)

    def __init__(self, group, device: torch.device, timeout_s: float) -> None:
        self.group = group
        self.rank = group.rank()
        self.num_ranks = group.size()
        self.device = device
        self.timeout_s = timeout_s

    @classmethod
    def capabilities(cls) -> Capabilities:
        """What this transport can move (see `Capabilities`)."""
        raise NotImplementedError

    def dispatch(self, handle: "DispatchHandle", tokens: Tokens, *, num_sms: int, stream=None) -> Received:
        """
        Send each token to the ranks in ``handle.is_token_in_rank``, on ``num_sms`` SMs (the same on every rank) and
        ``stream`` (None: the current stream). A handle whose ``transport_state`` is None is a new layout: the
        transport records what it made of it (``handle.transport_state``, its `rank_prefix_matrix` and
        ``recv_src_idx``); else the cached mode reuses it. Received rows are ordered by source rank and, within a
        source, as the transport places them (``recv_src_idx`` names each row's token); padding rows (past
        ``handle.num_recv_tokens``) are zero, their top-k ids -1.
        """
        raise NotImplementedError

    def combine(self, handle: "DispatchHandle", x: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], *,
                num_sms: int, stream=None) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """
        The reverse of the dispatch that made ``handle``: rows ``[handle.num_recv_rows, hidden]`` (padding rows
        ignored) go back to their tokens' ranks, which sum them in fp32. Returns ``(summed x, summed weights)``:
        ``[num_tokens, ...]``, x as fp32 or rounded once to its dtype, the weights fp32; None where the input was.
        """
        raise NotImplementedError

    def plan(self, handle: "DispatchHandle", *, num_sms: int) -> None:
        """Make on the host whatever later calls with ``handle`` on ``num_sms`` SMs need, so that they can be
        captured in a CUDA graph (a host synchronization). Nothing by default."""

    def prepared(self, hidden: int) -> bool:
        """Whether calls of this hidden size need no collective setup (a device transport's buffer for it exists),
        so that they can be captured in a CUDA graph. True by default."""
        return True

    def raise_if_failed(self) -> None:
        """Raise the error a kernel of this transport recorded (a peer that never arrived), without waiting for the
        GPU; nothing if none (or if the transport has no kernels)."""



SPIN_S = 0.002  # how long a host wait polls without sleeping (a sleep lasts 60-150 us: longer than most waits)
_yield = getattr(os, "sched_yield", lambda: None)  # give the core to a peer process between polls


def check_combine_weights(weights: Optional[torch.Tensor], rows: int, max_topk: int) -> None:
    """A device transport's combine writes ``weights`` (float32 ``[rows, k]``, contiguous) into slots sized for
    ``max_topk`` columns on the peers: anything else is a ``ValueError`` naming ``topk_weights``, raised before a
    kernel could write past the slots."""
    if weights is None:
        return
    if (weights.dtype != torch.float32 or weights.dim() != 2 or weights.size(0) != rows
            or not 1 <= weights.size(1) <= max_topk):
        raise ValueError(f"topk_weights: expected float32 [{rows}, k] with 1 <= k <= {max_topk}, got "
                         f"{weights.dtype} {tuple(weights.shape)}")
    if not weights.is_contiguous():
        raise ValueError("topk_weights: the kernels index rows densely; pass a contiguous tensor")


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """``torch.distributed.all_gather_into_tensor``: rank r's ``input`` into ``output``'s r-th slice. Under the name
    torch 2.13 keeps for it (``all_gather_single``; the old name warns there), where torch has it."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def poll_until(ready: Callable[[], bool], deadline: float) -> bool:
    """Call `ready()` until it returns True (then True) or `time.monotonic()` passes `deadline` (then False): without
    sleeping for the first `SPIN_S`, then every 100 us."""
    spin_until = time.monotonic() + SPIN_S
    while not ready():
        now = time.monotonic()
        if now > deadline:
            return False
        if now > spin_until:
            time.sleep(1e-4)
        else:
            _yield()
    return True
