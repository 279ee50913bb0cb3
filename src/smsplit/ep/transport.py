"""The interface between `Buffer` and the code that moves bytes between ranks, and the errors it raises.

`Buffer` validates arguments, computes layouts, quantizes to FP8, builds handles and wires autograd; a transport
only moves data. `ReferenceTransport` implements these three calls; the NVLink kernels (`smsplit.ep.nvlink`) have an
interface of their own (a fused dispatch with FP8 and top-k conversion inside the kernel) that `Buffer` calls
for `backend="nvlink"`, keeping the reference transport for the host-side header exchange:

1. `exchange_headers`: every rank sends one small int64 row to every rank (the notify step: counts, status,
   argument agreement). The result is on the host; this is where a missing peer is detected.
2. `dispatch`: per-token rows go to the ranks in `handle.is_token_in_rank`; the receiver stores them ordered by
   source rank, then by token index. What a transport precomputes for a layout it keeps in
   `handle.transport_state`, made at the layout's first use.
3. `combine`: the reverse, summing in fp32 the copies that return to each token.
"""

import os
import time
import warnings
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple

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


class Transport:
    """
    Moves bytes between the ranks of one process group.

    Attributes:
        name: the backend name (`Buffer(backend=...)`).
        group: the `torch.distributed` process group.
        rank: this rank in `group`.
        num_ranks: the size of `group`.
        device: the device of the tensors this transport accepts.
        timeout_s: the longest wait for a peer before `EPTimeoutError`.
    """

    name = "abstract"

    def __init__(self, group, device: torch.device, timeout_s: float) -> None:
        self.group = group
        self.rank = group.rank()
        self.num_ranks = group.size()
        self.device = device
        self.timeout_s = timeout_s

    def exchange_headers(self, op: str, what: str, rows: torch.Tensor) -> torch.Tensor:
        """
        Arguments:
            op: the operation, for error messages ("dispatch", "combine", "init").
            what: what the rows are, for error messages ("counts", "status", "expert counts").
            rows: `[num_ranks, width]` int64 host tensor; row `p` goes to rank `p`; `width` is the same on all ranks.

        Returns:
            `[num_ranks, width]` int64 host tensor; row `p` came from rank `p` (row `rank` is this rank's own).
        """
        raise NotImplementedError

    def dispatch(self, op: str, handle: "DispatchHandle", fields: List[torch.Tensor]) -> List[torch.Tensor]:
        """
        Arguments:
            op: the operation, for error messages.
            handle: the layout.
            fields: tensors of shape `[num_tokens, k_i]` (any dtypes), the per-token payload.

        Returns:
            tensors of shape `[handle.num_recv_rows, k_i]`, same dtypes: received rows ordered by source rank, then
            token index; rows past `handle.num_recv_tokens` (padding) are zero.
        """
        raise NotImplementedError

    def combine(self, op: str, handle: "DispatchHandle", fields: List[Optional[torch.Tensor]]) \
            -> List[Optional[torch.Tensor]]:
        """
        Arguments:
            op: the operation, for error messages.
            handle: the layout of the dispatch being reversed.
            fields: tensors of shape `[handle.num_recv_rows, k_i]` (floating point) or None; padding rows are ignored.

        Returns:
            `[num_tokens, k_i]` float32 tensors (None where the field was None): for each token, the sum of the rows
            that the ranks it was dispatched to sent back; zero for tokens dispatched nowhere.
        """
        raise NotImplementedError


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
