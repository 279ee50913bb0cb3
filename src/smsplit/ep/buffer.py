"""`Buffer`: expert-parallel dispatch and combine with the shape of DeepEP's normal (high-throughput) kernels."""

import functools
import numbers
import operator
from typing import List, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist

from .. import fp8 as fp8_lib
from ..timeouts import timeout_problem
from .autograd import Untracked, combine_with_grad, dispatch_with_grad
from .event import EventOverlap
from .layout import (SCALE_BLOCK, DispatchHandle, align_up, buffer_bytes, combine_row_bytes,
                     check_dispatch_layout, compute_dispatch_layout, dispatch_row_bytes, rank_prefix_matrix_from_counts,
                     to_local_expert_ids)
from .reference import ReferenceTransport
from .transport import EPAbortError, EPArgumentError, EPError, EPTimeoutError, check_num_worst_tokens

BACKENDS = ("auto", "reference", "nvlink", "copy_engine", "nvlink_copy_engine")
DEVICE_BACKENDS = ("nvlink", "copy_engine", "nvlink_copy_engine")  # our kernels on symmetric memory, one node
CAPTURABLE_BACKENDS = ("nvlink", "nvlink_copy_engine")  # no host work per call: CUDA-graph capturable
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Header: one int64 row that every rank sends to every rank before any token moves.
OP_INIT, OP_DISPATCH, OP_COMBINE = 1, 2, 3
OP_NAMES = {OP_INIT: "init", OP_DISPATCH: "dispatch", OP_COMBINE: "combine"}
(H_OP, H_ROUND, H_STATUS, H_NUM_TOKENS, H_NUM_EXPERTS, H_HIDDEN, H_DTYPE, H_NUM_TOPK, H_FLAGS,
 H_NUM_WORST, H_NVL_BYTES, H_HANDLE, H_NUM_SMS) = range(13)
HEADER_WORDS = 13  # followed by num_ranks words: the sender's num_tokens_per_rank
# the words `Buffer._agree` needs equal on every rank (op, round and status first)
AGREED_WORDS = operator.itemgetter(H_OP, H_ROUND, H_STATUS, H_HIDDEN, H_DTYPE, H_FLAGS, H_NUM_TOPK, H_NUM_EXPERTS,
                                   H_HANDLE, H_NUM_SMS)
FLAG_SCALES, FLAG_TOPK_IDX, FLAG_TOPK_WEIGHTS, FLAG_CACHED, FLAG_BIAS = 1, 2, 4, 8, 16
DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float8_e4m3fn: 4}

# Status word: 0 = arguments fine, else 1 + the index of the rejected argument here.
ARGUMENTS = ("x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
             "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment", "num_worst_tokens",
             "previous_event", "fp8", "dequantize", "bias", "num_nvl_bytes", "group", "backend", "num_sms",
             "num_rdma_bytes", "low_latency_mode", "config", "timeout_s")

Tensorish = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]
# DeepEP's `deep_ep.topk_idx_t`: the dtype of `topk_idx` (DeepEP's default build; one built with TOPK_IDX_BITS=32
# takes int32, which these kernels and checks do not)
topk_idx_t = torch.int64
NVLINK_MAX_TOPK = 16


def _reject(argument: str, message: str) -> EPArgumentError:
    return EPArgumentError(argument, f"{argument}: {message}")


def _status_code(error: EPArgumentError) -> int:
    return 1 + (ARGUMENTS.index(error.argument) if error.argument in ARGUMENTS else len(ARGUMENTS))


def _on_every_rank(error: BaseException) -> BaseException:
    """Mark ``error`` as one that every rank raises in the same call (an argument error the header exchange made
    every rank see, or a check of a captured call, which every rank captures alike): it does not abort the buffer."""
    error.on_every_rank = True
    return error


def _aborts(method):
    """
    Make the `Buffer` call ``method`` abort the buffer when it raises an error of this rank's own: the peers' waits
    then raise `EPAbortError` at once, naming this rank and the error, instead of `EPTimeoutError` at `timeout_s`,
    and this buffer refuses every later call. Not an error that every rank raises with it (`_on_every_rank`), nor one
    of a wait for a peer (a timeout, a lost peer, ranks out of step: the transport records it as its failure, and the
    other ranks' waits see the same peer themselves); an `EPAbortError` is passed on, with its cause.
    """
    call_name = method.__name__.lstrip("_")

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        rounds = self.transport.header_rounds
        try:
            return method(self, *args, **kwargs)
        except BaseException as error:
            own = self.transport.failure is None or isinstance(error, EPAbortError)
            if own and not getattr(error, "on_every_rank", False):
                if isinstance(error, EPAbortError):  # a peer failed first: pass its rank and error on
                    cause, text = error.peer, error.error
                else:
                    cause, text = self.rank, f"{call_name}: {type(error).__name__}: {error}"
                self.transport.abort(cause, text, inside_call=self.transport.header_rounds > rounds)
            raise

    return call


STATUS_TRANSPORT_FAILED = 1000  # a GPU kernel of this rank recorded a timeout; every rank raises EPError


def _transport_class(backend: str):
    """The transport class of a device backend ("nvlink_copy_engine": `NvlinkTransport` with ``bulk="copy_engine"``)."""
    if backend == "copy_engine":
        from .copy_engine import CopyEngineTransport
        return CopyEngineTransport
    from .nvlink import NvlinkTransport
    return NvlinkTransport


def _check_tensor(name: str, t, device: torch.device, dtypes, shape: Tuple[Optional[int], ...]) -> None:
    """`shape` entries of None match any size."""
    if not isinstance(t, torch.Tensor):
        raise _reject(name, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise _reject(name, f"expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and want != got for want, got in zip(shape, t.shape)):
        want = tuple("*" if s is None else s for s in shape)
        raise _reject(name, f"expected shape {want}, got {tuple(t.shape)}")
    if t.device != device:
        raise _reject(name, f"expected a tensor on {device} (this buffer's device), got one on {t.device}")


def _check_handle(handle, buffer_id: int) -> None:
    """``handle`` must be a `DispatchHandle` of the buffer with id ``buffer_id`` (a DeepEP tuple rebuilt from one
    has been turned into it by then: `DispatchHandle.from_deepep_tuple`)."""
    if isinstance(handle, DispatchHandle) and handle.buffer_id == buffer_id:
        return
    if isinstance(handle, (tuple, list)):
        raise _reject("handle", f"a {type(handle).__name__} of {len(handle)} is not a handle of this buffer: a "
                                f"DeepEP-style tuple rebuilt from a handle must hold the six objects that unpacking "
                                f"that handle gave, in order (rank_prefix_matrix, None, None, recv_src_idx, "
                                f"is_token_in_rank, None), not copies")
    raise _reject("handle", "expected a handle returned by a dispatch of this buffer")


def _check_event(previous_event) -> None:
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise _reject("previous_event", f"expected an EventOverlap or None, got {type(previous_event).__name__}")


def _check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise _reject("backend", f"expected one of {BACKENDS}, got {backend!r}")


def _plain_int(value):
    """A numpy (or other) integer as a Python int, which the kernels' launches take; anything else as it is (for
    the checks to name)."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


MAX_ROWS = (1 << 31) - 1  # received rows are named by int32 indices (recv_src_idx, the layouts' positions)
MAX_COUNT = (1 << 62) - 1  # a count or size above this cannot be a real one and would overflow the int64 header


def _check_int(name: str, value, minimum: int, maximum: int = MAX_COUNT) -> None:
    """An int (numpy ints too) in [minimum, maximum], else `EPArgumentError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise _reject(name, f"expected an int >= {minimum}, got {value!r}")
    if value > maximum:
        raise _reject(name, f"expected an int <= {maximum}, got {value!r}")


MAX_NUM_SMS = 1 << 16  # far above any GPU's SMs; keeps a count inside the int64 header


def _sms_count(name: str, value, subject: str = "expected") -> int:
    """An SM count as an int in [1, MAX_NUM_SMS] (numpy ints too), else `EPArgumentError` naming ``name`` (its
    message: ``subject`` an int in ...)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= MAX_NUM_SMS:
        raise _reject(name, f"{subject} an int in [1, {MAX_NUM_SMS}], got {value!r}")
    return int(value)


def _check_topk_idx_form(topk_idx, num_tokens: Optional[int], device: torch.device) -> None:
    """``topk_idx``'s type, dtype, device and shape (``[num_tokens, k]``, k >= 1; None: any number of tokens)."""
    _check_tensor("topk_idx", topk_idx, device, (topk_idx_t,), (num_tokens, None))
    if topk_idx.size(1) < 1:
        raise _reject("topk_idx", f"expected at least one top-k column, got shape {tuple(topk_idx.shape)}")


def _check_expert_range(low: int, high: int, num_experts: int) -> None:
    """The smallest and largest top-k ids must lie in [-1, num_experts)."""
    if low < -1 or high >= num_experts:
        raise _reject("topk_idx", f"expert ids must lie in [-1, {num_experts}) (num_experts={num_experts}), "
                                  f"got values in [{low}, {high}]")


def _handle_of(handle):
    """A call's ``handle`` argument as the `DispatchHandle` it stands for: DeepEP's handle is a plain tuple, which
    its callers may unpack and rebuild (`DispatchHandle.from_deepep_tuple`); anything else as it is, for the
    argument checks to accept or reject on every rank."""
    if isinstance(handle, (tuple, list)):
        return DispatchHandle.from_deepep_tuple(handle) or handle
    return handle


def _bias_tuple(bias) -> tuple:
    """``bias`` as a tuple of what it holds (a tensor, or the items of a tuple or list); anything else gives ()
    here, for the argument checks to reject on every rank."""
    if isinstance(bias, torch.Tensor):
        return (bias,)
    return tuple(bias) if isinstance(bias, (tuple, list)) else ()


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the device kernels read it: contiguous, rows indexed densely, and 16-byte aligned (their 16-byte
    vector accesses fault on a view that starts mid-vector; such a view is copied)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _reference_rows(handle) -> Optional[torch.Tensor]:
    """For a handle whose received rows a device transport placed: ``perm`` (int64 ``[num_recv_tokens]``) with the
    reference transport's row i = the handle's row ``perm[i]``, else None. The reference transport puts the rows from
    each source in the source's token order; a device transport need not (`nvlink_copy_engine` fills rows its copies
    skip with later tokens), and ``recv_src_idx`` names each row's token. Made once per handle, on the device (no
    host synchronization)."""
    if getattr(handle, "nvlink_layout", None) is None:
        return None
    perm = getattr(handle, "reference_rows", None)
    if perm is None:
        # a handle made inside a CUDA graph capture has no host count (-1): its recv_src_idx covers every padded row,
        # and rows past the received ones get source R here, so they stay after them, among themselves
        n = handle.num_recv_tokens if handle.num_recv_tokens >= 0 else handle.recv_src_idx.numel()
        ends = handle.rank_prefix_matrix[:, handle.rank].to(torch.int64)  # where each source's rows end
        rows = torch.arange(n, dtype=torch.int64, device=ends.device)
        source = torch.searchsorted(ends, rows, right=True)
        key = source * 2**32 + handle.recv_src_idx[:n].to(device=ends.device, dtype=torch.int64)
        perm = torch.argsort(key, stable=True)
        handle.reference_rows = perm
    return perm


def _rows_to_reference(t: Optional[torch.Tensor], perm: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Rows of ``t`` in a device transport's order -> the reference transport's (padding rows past ``perm`` kept)."""
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


class Config:
    """
    DeepEP's `Config` (`deep_ep.Config`): what one dispatch or combine runs with. Only `num_sms` is read here (pass
    the config as `Buffer.dispatch(..., config=...)` / `Buffer.combine(..., config=...)`); the chunk sizes tune
    DeepEP's ring buffers, which these transports do not have, and are kept only for code that reads them back.

    Arguments:
        num_sms: the SMs (persistent programs) of the call's communication kernels, an int >= 1 (DeepEP's must be
            even; any count works here). DeepEP's own `deep_ep.Config` does not expose its count to Python: passed
            here it gives the buffer's `num_sms`.
        num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens, num_max_rdma_chunked_send_tokens,
        num_max_rdma_chunked_recv_tokens: accepted and kept (DeepEP's chunking of its NVLink and RDMA buffers).
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        self.num_sms = _sms_count("num_sms", num_sms)
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0. DeepEP sizes a ring buffer from the chunk sizes; the device backends here hold a whole dispatch, so
        their size follows the token count: `Buffer.get_buffer_size_hint(num_max_tokens_per_rank, hidden, num_ranks,
        num_topk, backend=...)`. With 0 bytes a `Buffer` runs the reference backend, and a device backend refuses
        the size with that advice."""
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: intranode only (no RDMA buffer)."""
        return 0

    def __repr__(self) -> str:
        return f"Config(num_sms={self.num_sms})"


class Buffer:
    """
    Expert-parallel (EP) communication for Mixture-of-Experts layers: dispatch tokens to the ranks that hold their
    top-k experts, and combine the expert outputs back, with the API and return values of DeepEP's intranode
    normal kernels (`deep_ep.Buffer`).

    Every call is collective over `group`: all ranks call the same methods in the same order. Before any token
    moves, the ranks exchange a small header and agree on the arguments; an invalid argument on any rank raises
    `EPArgumentError` (a `ValueError` naming the argument) on every rank. A peer that does not arrive within
    `timeout_s` raises `EPTimeoutError` naming the peer and the phase; after that (and after `EPError`) the buffer
    is unusable. A call that raises on one rank alone (an error the others do not raise with it: say its
    `get_dispatch_layout` rejects an expert id) aborts the buffer: the peers' waits raise `EPAbortError` naming
    that rank and its error at once, and every rank's buffer refuses later calls (docs/ep.md, "Errors").

    The device backends' kernels wait for peers on the GPU, bounded by `timeout_s` too; a wait that times out
    writes the rank, peer and phase to host memory and the kernel runs to its end; the next call raises `EPError`
    naming it, on every rank, before it launches anything. No call waits for earlier kernels to read that word (the
    host runs ahead of the GPU, as with DeepEP): the first call whose header is built after the timeout raises.
    Kernels queued behind the failed one do not wait for peers any more (the NVLink transports' move nothing and
    signal no peer but free their copy stream; the copy-engine transport's flags carry call numbers, so no copy
    stream waits for ever), and their results are not valid (like the failed call's own). `check_kernels` waits
    for the stream, where a result must be known good without a later call. A device backend makes its symmetric
    buffer (collectively: torch's symmetric-memory rendezvous, then a barrier) at the first dispatch of each hidden
    size, after that call's header exchange: a peer lost between the two is bounded by the process group's timeout,
    not `timeout_s`.

    Dispatch and combine are differentiable: when `x` or `topk_weights` requires grad, the backward of a dispatch
    is a combine of the gradients and the backward of a combine is a dispatch of the gradients.

    Attributes:
        group: the communication group.
        rank: this rank in `group`.
        group_size: the number of ranks in `group`.
        num_nvl_bytes: the size of the receive buffer each rank holds; 0 lets the reference backend allocate on
            demand (the GPU transports need it set: see `get_buffer_size_hint`).
        num_rdma_bytes: 0 (DeepEP's attribute; intranode only).
        num_sms: the SMs a call's communication kernels use when its `config` names none: the granted comm SMs of
            `budget` when one is given, the constructor's `num_sms` when given, else the class attribute
            `Buffer.num_sms` (DeepEP's default, 20; `Buffer.set_num_sms` changes it for every such buffer's
            later calls).
        budget: the `smsplit.budget.SmBudget` whose comm SM count the NVLink kernels use, or None.
        backend: the transport in use ("reference", "nvlink", "nvlink_copy_engine" or "copy_engine").
        device: the device of the tensors this buffer accepts: CPU for gloo groups, the current CUDA device for NCCL.
        timeout_s: the longest wait for a peer, in seconds.
        transport: the `Transport` that moves the bytes.
    """

    num_sms: int = 20  # DeepEP's class default: the SM count of buffers made without one (`set_num_sms`)

    def __init__(self, group: Optional[dist.ProcessGroup] = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False, *,
                 num_sms: Optional[int] = None, budget=None, backend: str = "auto", timeout_s: float = 60.0,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm=None) -> None:
        """
        Create the buffer; collective over `group`. The positional arguments are DeepEP's, in DeepEP's order
        (`Buffer(group, num_nvl_bytes, num_rdma_bytes)` works as it does there); smsplit's own are keyword-only.

        Arguments:
            group: the communication group (the default group if None). Gloo groups work on CPU tensors, NCCL groups
                on CUDA tensors of the current device.
            num_nvl_bytes: the receive buffer size per rank in bytes, the same on every rank; 0 for none (reference
                backend only). Dispatches and combines whose worst case does not fit raise `EPArgumentError`. A
                device backend allocates one buffer of this size per hidden size it dispatches (at the first
                dispatch of that size).
            num_rdma_bytes: must be 0 (intranode only).
            low_latency_mode: must be False (no low-latency kernels).
            num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl: DeepEP's; accepted and ignored (they
                configure its RDMA and low-latency paths).
            num_sms: the SMs the communication kernels use (a call's `config` may name another count); None: the class
                attribute `Buffer.num_sms` at each call (20 unless `Buffer.set_num_sms` changed it, as DeepEP's
                buffers follow it). Ignored when `budget` is given.
            budget: an `SmBudget`; its `comm_sms` replaces `num_sms`. Kernels launch on the current stream: call the
                buffer inside `torch.cuda.stream(budget.comm_stream)` to run them on the comm SMs.
            backend: "reference" (point-to-point `torch.distributed` messages), "nvlink" (the SM-push Triton
                kernels of `smsplit.ep.nvlink`: SMs store tokens into peers' buffers over NVLink), "nvlink_copy_engine"
                (the same kernels with ``bulk="copy_engine"``: copy engines move the token rows, one copy per peer
                for a dispatch and chunks for a combine, the SMs the metadata, this rank's own rows and the sum;
                the rows of an FP8 dispatch that quantizes in the kernel are pushed by the SMs as they are made;
                the fastest of the backends, see BENCHMARKS.md; a token's row among those from its source is not always
                in token order, `recv_src_idx` in the handle names it), "copy_engine" (`smsplit.ep.copy_engine`: SMs
                pack and sum, the copy engines move the bytes), or "auto" (the reference). The device backends need
                an NCCL group of one node; size `num_nvl_bytes` with `get_buffer_size_hint(..., backend=...)`.
                "nvlink" and "nvlink_copy_engine" can be captured in CUDA graphs (see `dispatch`).
            timeout_s: the longest wait for a peer, in seconds, before `EPTimeoutError`: finite, at most
                `smsplit.timeouts.MAX_TIMEOUT_S` (a year; the waits hand it to gloo and to the kernels as nanoseconds).

        DeepEP's keyword arguments whose position differs between its versions, by keyword only:
            use_fabric, enable_shrink, comm: accepted and ignored (fabric memory, elastic ranks, MPI bootstrap).
            explicitly_destroy: accepted; `destroy` works either way.
        """
        if group is None:
            group = dist.group.WORLD
        error = None  # an argument error: raised on every rank after the first header exchange (below)
        try:
            problem = timeout_problem(timeout_s)
            if problem:
                timeout_s = 60.0  # (the exchange that tells the other ranks needs a bound)
                raise _reject("timeout_s", problem)
            if num_rdma_bytes != 0:
                raise _reject("num_rdma_bytes", f"must be 0: intranode only (no RDMA buffer), got {num_rdma_bytes!r} "
                                                f"(the third positional argument, as in DeepEP; num_sms and smsplit's "
                                                f"other arguments are keyword-only)")
            if low_latency_mode:
                raise _reject("low_latency_mode", "must be False: only DeepEP's normal (high-throughput) kernels "
                                                  "exist here")
            _check_backend(backend)
            num_nvl_bytes = _plain_int(num_nvl_bytes)
            _check_int("num_nvl_bytes", num_nvl_bytes, 0)
            if num_sms is not None:
                num_sms = _sms_count("num_sms", num_sms)
        except EPArgumentError as e:
            if group is None:  # no process group to tell the others through
                raise
            error = e

        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = 0  # (DeepEP's attribute: intranode only)
        self.budget = budget
        if budget is not None:
            self.num_sms = int(getattr(budget, "comm_sms", num_sms if num_sms is not None else Buffer.num_sms))
        elif num_sms is not None:
            self.num_sms = num_sms
        # (else no instance attribute: self.num_sms reads the class attribute, which `set_num_sms` changes)
        self.timeout_s = float(timeout_s)
        self.backend = backend if backend in DEVICE_BACKENDS else "reference"
        if str(dist.get_backend(group)).lower() == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if error is None and self.backend in DEVICE_BACKENDS and self.device.type != "cuda":
            error = _reject("backend", f"backend={self.backend!r} moves CUDA tensors over NVLink: it needs an NCCL "
                                       "group (this group is gloo); use backend='reference'")
        if error is None and self.backend in DEVICE_BACKENDS and num_nvl_bytes == 0:
            error = _reject("num_nvl_bytes", f"backend={self.backend!r} needs a receive buffer: size it with "
                                             f"Buffer.get_buffer_size_hint(..., backend={self.backend!r})")
        # a device backend's calls run at most this many persistent programs (`_call_sms`)
        self._device_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                            if error is None and self.backend in DEVICE_BACKENDS else None)
        self.transport = ReferenceTransport(group, self.device, self.timeout_s)
        self._nvlink_transports = {}  # hidden size -> NvlinkTransport, made at the first dispatch of that size
        self._eager_sms = {}  # id(transport) -> the SM count of its last eager call
        self._nvlink_failure: Optional[str] = None
        self._round = 0
        self._destroyed = False

        header = self._header(OP_INIT)
        header[:, H_NVL_BYTES] = num_nvl_bytes if error is None else 0
        header[:, H_NUM_TOKENS] = self.num_sms if error is None else 0  # the NVLink kernels wait for this many
        # programs of every peer
        header[:, H_FLAGS] = BACKENDS.index(self.backend)
        if error is not None:
            header[:, H_STATUS] = _status_code(error)
        headers = self._exchange(OP_INIT, "the buffer size", header, error)
        for word, argument, what in ((H_NVL_BYTES, "num_nvl_bytes", "num_nvl_bytes"),
                                     (H_FLAGS, "backend", "backend"),
                                     (H_NUM_TOKENS, "num_sms", "num_sms (or budget.comm_sms)")):
            values = headers[:, word].tolist()
            if len(set(values)) != 1:
                shown = [BACKENDS[v] for v in values] if word == H_FLAGS else values
                raise _reject(argument, f"{what} must be the same on every rank, got {shown}")

    # -- the SM count (DeepEP's static API) -------------------------------------------------------------

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """
        Set `Buffer.num_sms`, the SM count of every later call of buffers made without `num_sms` or `budget` (and
        of the configs `get_dispatch_config` / `get_combine_config` make), as DeepEP's `Buffer.set_num_sms`. Every
        rank must set the same count: a call whose ranks differ raises `EPArgumentError` naming `config` on every
        rank before any token moves (an eager call; a captured one must use the count of the eager calls before
        it). Any int >= 1 (DeepEP's must be even); a device backend refuses a count above its GPU's SMs at the call.
        """
        Buffer.num_sms = _sms_count("num_sms", new_num_sms)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A `Config` with `Buffer.num_sms` for a dispatch over `num_ranks` ranks (DeepEP's static method; its
        tuned chunk sizes do not apply here)."""
        _check_int("num_ranks", num_ranks, 1)
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """A `Config` with `Buffer.num_sms` for a combine over `num_ranks` ranks (DeepEP's static method)."""
        return Buffer.get_dispatch_config(num_ranks)

    def _call_sms(self, config) -> int:
        """The SM count of one call: ``config.num_sms`` when `config` has one (at most the budget's comm SMs),
        else `num_sms`; for the device backends at most the GPU's SMs (their persistent programs must all be
        resident at once)."""
        sms = getattr(config, "num_sms", None)
        argument = "num_sms" if sms is None else "config"
        if sms is None:
            sms = self.num_sms
        else:
            sms = _sms_count("config", sms, "config.num_sms must be")
            if self.budget is not None and sms > self.num_sms:
                raise _reject("config", f"config.num_sms={sms} exceeds the budget's {self.num_sms} comm SMs")
        if self._device_sms is not None and sms > self._device_sms:
            raise _reject(argument, f"{argument}={sms} (this call's SM count) exceeds the {self._device_sms} SMs of "
                                    f"{self.device}")
        return sms

    def _captured_sms(self, config, transport) -> int:
        """A captured call's SM count: that of the eager calls before it (every rank agreed on it there; a capture
        exchanges nothing, and a combine's copy plan depends on the count)."""
        sms = self._call_sms(config)
        if sms != self._eager_sms.get(id(transport)):
            raise _reject("config", f"a call captured in a CUDA graph runs on the SM count of the eager calls "
                                    f"before it ({self._eager_sms.get(id(transport))}); this one asks {sms} (config.num_sms or "
                                    f"Buffer.set_num_sms): make an eager call with that count first")
        return sms

    # -- sizes ---------------------------------------------------------------------------------------------

    @staticmethod
    def get_buffer_size_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int, num_topk: int = 0,
                             x_dtype: torch.dtype = torch.bfloat16, fp8: bool = False,
                             combine_dtype: torch.dtype = torch.bfloat16, backend: str = "reference") -> int:
        """
        The smallest `num_nvl_bytes` for dispatches and combines of up to `num_max_tokens_per_rank` tokens per rank.

        A rank's receive area holds one slot per source rank, each big enough for all of that rank's tokens
        (dispatch rows: values, FP8 scales, int64 top-k ids, fp32 weights, int32 source index; combine rows:
        values and fp32 weights; each padded to 16 bytes), plus a header per rank.

        Arguments:
            num_max_tokens_per_rank: the most tokens any rank dispatches in one call.
            hidden: the hidden size.
            num_ranks: the number of ranks.
            num_topk: top-k ids per token (0 if dispatched without top-k).
            x_dtype: the dtype of the dispatched values (ignored when `fp8`).
            fp8: whether tokens travel as FP8 with scales.
            combine_dtype: the dtype of the combined values.
            backend: "reference" (or "auto"), "nvlink", "nvlink_copy_engine" or "copy_engine". The nvlink
                transport's symmetric buffer (both nvlink backends) holds a bf16-sized receive area and a combine area
                for every source rank, and top-k columns for up to 16; the copy_engine transport's a bf16-sized
                staging area per destination and a combine area.

        Returns:
            size: bytes.

        Raises `EPArgumentError` (a ValueError) naming the argument for an unknown backend or a count out of range.
        """
        _check_backend(backend)
        for name, value, minimum in (("num_max_tokens_per_rank", num_max_tokens_per_rank, 0), ("hidden", hidden, 1),
                                     ("num_ranks", num_ranks, 1), ("num_topk", num_topk, 0)):
            _check_int(name, value, minimum)
        return int(Buffer._size_hint(num_max_tokens_per_rank, hidden, num_ranks, num_topk, x_dtype, fp8,
                                     combine_dtype, backend))

    @staticmethod
    def _size_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int, num_topk: int = 0,
                   x_dtype: torch.dtype = torch.bfloat16, fp8: bool = False,
                   combine_dtype: torch.dtype = torch.bfloat16, backend: str = "reference") -> int:
        """`get_buffer_size_hint` for arguments already checked (the calls' own checks)."""
        if backend in DEVICE_BACKENDS:
            return _transport_class(backend).buffer_bytes(num_ranks, num_max_tokens_per_rank, hidden, NVLINK_MAX_TOPK)
        dispatch_bytes = dispatch_row_bytes(hidden, 1 if fp8 else x_dtype.itemsize, fp8, num_topk)
        combine_bytes = combine_row_bytes(hidden, combine_dtype.itemsize, num_topk)
        return buffer_bytes(num_max_tokens_per_rank, num_ranks, max(dispatch_bytes, combine_bytes),
                            HEADER_WORDS + num_ranks)

    @staticmethod
    def _combine_size(num_tokens: int, hidden: int, num_ranks: int, num_topk: int, dtype: torch.dtype) -> int:
        """The reference formula's bytes for combining ``num_tokens`` tokens of ``dtype`` with ``num_topk`` weights:
        its combine rows only (a buffer sized for an FP8 dispatch holds no BF16 dispatch rows)."""
        return buffer_bytes(num_tokens, num_ranks, combine_row_bytes(hidden, dtype.itemsize, num_topk),
                            HEADER_WORDS + num_ranks)

    # -- events ----------------------------------------------------------------------------------------------

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current CUDA stream (an empty EventOverlap without CUDA); `Buffer.capture()` or
        `buffer.capture()`, as in DeepEP."""
        if not torch.cuda.is_available():
            return EventOverlap()
        return EventOverlap.record_current_stream(torch.device("cuda", torch.cuda.current_device()))

    def get_comm_stream(self):
        """
        The stream this buffer's communication runs on, as DeepEP's `get_comm_stream()`. DeepEP's buffer owns a
        stream and runs every call on it; this one has none: each call runs on the current stream (docs/ep.md,
        "Differences from DeepEP"). So: `budget.comm_stream` where the buffer has a budget (the stream whose SMs
        the budget keeps for communication: code that launches its calls under
        ``torch.cuda.stream(buffer.get_comm_stream())``, as DeepEP-based code does to overlap, puts them there);
        else the current stream of the buffer's device, which the calls made now run on. Either way, a stream that
        waits for the returned one and for the calling stream waits for the calls. A CPU (gloo) buffer gives
        `torch.cpu.current_stream()`, whose waits do nothing (CPU calls finish before they return).
        """
        if self.device.type != "cuda":
            return torch.cpu.current_stream()
        if self.budget is not None:
            return self.budget.comm_stream
        return torch.cuda.current_stream(self.device)

    @staticmethod
    def is_sm90_compiled() -> bool:
        """
        Whether the kernels are built with Hopper's (sm_90) features, as DeepEP's static `is_sm90_compiled()`; its
        callers read it as "FP8 dispatch is available" (DeepEP's own tests skip their FP8 cases without it). DeepEP
        answers from how its extension was compiled, not from the GPU present, and so does this: True where Triton
        has its NVIDIA backend, which builds every kernel here for sm_90 (at a kernel's first launch on a GPU; on a
        machine without one, `smsplit.ptx.compile_for_sm90`). FP8 dispatch works on the reference backend either
        way. Whether this process's GPU can run the device backends (written for Hopper) is not part of the
        answer: see `torch.cuda.get_device_capability()`.
        """
        from triton.backends import backends

        return "nvidia" in backends

    def _check_alive(self) -> None:
        if self._destroyed:
            raise EPError(f"rank {self.rank}: this Buffer was destroyed (Buffer.destroy)")
        self.transport._check_usable()  # (after an abort, a timeout, a lost peer)

    def destroy(self) -> None:
        """End this buffer: later calls raise `EPError`. Its memory is released when the object is collected (no
        collective here: it needs no peer)."""
        self._destroyed = True

    # -- layout ----------------------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) \
            -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """
        Compute the layout that `dispatch` needs; local, no communication.

        Arguments:
            topk_idx: `[num_tokens, num_topk]` with `torch.int64`, the experts each token selected, `-1` for none.
            num_experts: the number of experts over all ranks, a multiple of the number of ranks.
            previous_event: the event the current stream waits for before the call reads its inputs.
            async_finish: also return an event recorded after the layout's work on the current stream (no effect on
                CPU).
            allocate_on_comm_stream: accepted for DeepEP compatibility; every backend ignores it (the results are
                allocated on the current stream).

        Returns:
            num_tokens_per_rank: `[num_ranks]` with `torch.int`, the number of tokens sent to each rank.
            num_tokens_per_rdma_rank: always None (intranode only).
            num_tokens_per_expert: `[num_experts]` with `torch.int`, the number of tokens sent to each expert.
            is_token_in_rank: `[num_tokens, num_ranks]` with `torch.bool`, whether a token goes to a rank.
            event: the event after the computation (meaningful only with `async_finish` on CUDA).
        """
        # Errors of the arguments' types and shapes leave the buffer usable: the same code passes them alike on every
        # rank. Any later error (ids out of range: data, which differ between ranks) aborts it (docs/ep.md, "Errors").
        num_experts = _plain_int(num_experts)
        _check_int("num_experts", num_experts, 1)
        _check_event(previous_event)
        if num_experts % self.group_size:
            raise _reject("num_experts", f"{num_experts} experts do not divide evenly over {self.group_size} ranks")
        _check_topk_idx_form(topk_idx, None, self.device)
        return self._get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish)

    @_aborts
    def _get_dispatch_layout(self, topk_idx, num_experts: int, previous_event, async_finish: bool):
        """`get_dispatch_layout` after the checks of its plain arguments."""
        self._check_alive()
        self._wait_previous(previous_event)  # before reading topk_idx on the host: it may come from another stream
        self._check_topk_idx(topk_idx, None, num_experts, values=not self._capturing())
        num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank = \
            compute_dispatch_layout(topk_idx, num_experts, self.group_size)
        return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, self._finish_event(async_finish)

    # -- dispatch --------------------------------------------------------------------------------------------

    @_aborts
    def dispatch(self, x: Tensorish, handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, fp8: bool = False, dequantize: bool = False) \
            -> Tuple[Tensorish, Optional[torch.Tensor], Optional[torch.Tensor], Optional[List[int]],
                     DispatchHandle, EventOverlap]:
        """
        Send each token to every rank that holds one of its top-k experts. Collective.

        Two modes: with layout arguments (`num_tokens_per_rank`, `is_token_in_rank`, `num_tokens_per_expert`, from
        `get_dispatch_layout`), or with `handle=` from an earlier dispatch, which reuses that layout (the cached
        mode: only `x` moves; `topk_idx` and `topk_weights` must be None; the layout arguments are ignored).

        Arguments:
            x: `[num_tokens, hidden]` with `torch.bfloat16` (or `torch.float16` / `torch.float32`), or a tuple
                `(x_fp8, scales)`: `[num_tokens, hidden]` with `torch.float8_e4m3fn` and `[num_tokens, hidden // 128]`
                with `torch.float32` (`hidden` a multiple of 128), as made by `smsplit.fp8.quantize_1x128`; `hidden`
                at least 1.
                Any strides and offset: the device backends copy a view that is not contiguous or does not start on
                a 16-byte boundary before their kernels read it.
            handle: a handle returned by an earlier `dispatch` of this buffer, or the tuple of its six DeepEP fields
                that unpacking it gave (`DispatchHandle.from_deepep_tuple`); selects the cached mode.
            num_tokens_per_rank: `[num_ranks]` with `torch.int`, the number of tokens sent to each rank.
            num_tokens_per_rdma_rank: must be None (intranode only; accepted for DeepEP compatibility).
            is_token_in_rank: `[num_tokens, num_ranks]` with `torch.bool`, whether a token goes to a rank.
            num_tokens_per_expert: `[num_experts]` with `torch.int`, the number of tokens sent to each expert;
                `num_experts` must be a multiple of the number of ranks and the same on every rank.
            topk_idx: `[num_tokens, num_topk]` with `torch.int64`, the experts each token selected, `-1` for none;
                ids must lie in `[-1, num_experts)`. May be None (then nothing top-k is received).
            topk_weights: `[num_tokens, num_topk]` with `torch.float`, the weight of each selection; needs `topk_idx`.
            expert_alignment: round each entry of `num_recv_tokens_per_expert_list` up to a multiple of this.
            num_worst_tokens: if positive, the received tensors have exactly this many rows (the rows past the
                received tokens are zero, their `recv_topk_idx` is -1) and `num_recv_tokens_per_expert_list` is an
                empty list; the nvlink backend's kernels then need no host synchronization, so the call can be
                captured in a CUDA graph (where it runs with none), and so can the nvlink_copy_engine backend's in the
                cached mode (`handle` of an eager dispatch, which planned the copies on the host). An eager call still
                checks its arguments' values and exchanges a header with every rank on the host (a synchronization)
                before it launches anything. Must be at least the number of tokens this rank receives.
            config: a `Config` (`smsplit.ep.Config`, or anything with an int `num_sms`): the SMs of this call's
                kernels, at most the budget's comm SMs; None, or an object without a readable `num_sms` (DeepEP's
                own `deep_ep.Config`): `num_sms`. Every rank must give the same count; a call captured in a CUDA
                graph must use that of the eager calls before it. Backward passes use `num_sms`. The other fields
                tune DeepEP's ring buffers and are ignored.
            previous_event: the event the current stream waits for before the call reads its inputs (the argument
                checks read the layout on the host after it).
            async_finish: also return an event recorded after the call's work, for another stream to wait for; the
                work itself runs on the current stream either way (there is no separate communication stream, see
                docs/ep.md "Differences from DeepEP"); the reference backend always finishes before returning.
            allocate_on_comm_stream: accepted for DeepEP compatibility; every backend ignores it (the results are
                allocated on the current stream).
            fp8: quantize a floating-point `x` to FP8 e4m3 with one fp32 scale per 128 values before sending
                (`smsplit.fp8.quantize_1x128`); `recv_x` is then `(recv_x_fp8, recv_scales)`. An inf or NaN in
                `x` makes its whole 128-value tile NaN after dequantization (its scale is inf or NaN), as with
                DeepEP's cast; nothing checks for them (that would cost a host synchronization).
            dequantize: with FP8 on the wire (`fp8=True` or an FP8 `x`), dequantize on receive: `recv_x` is a
                tensor of the input dtype (bfloat16 for an FP8 `x`).

        Returns:
            recv_x: the received tokens, `[num_recv_tokens, hidden]` (`[num_worst_tokens, hidden]` if set), ordered by
                source rank, then by token index on the source rank (backend "nvlink_copy_engine": within a
                source's block the last few tokens may take the rows of tokens not sent here, see
                `smsplit.ep.nvlink_plan.prefix_plan`; the same rows for every dispatch with one handle); a tuple
                `(recv_x_fp8, recv_scales)` when FP8 travelled and `dequantize` is False.
            recv_topk_idx: `[num_recv_tokens, num_topk]` with `torch.int64`: the top-k ids as local expert ids of
                this rank (`0 .. num_local_experts - 1`), -1 for experts on other ranks and for `-1` entries; None in
                the cached mode or without `topk_idx`.
            recv_topk_weights: `[num_recv_tokens, num_topk]` with `torch.float`: the weights, 0 where
                `recv_topk_idx` is -1; None in the cached mode or without `topk_weights`.
            num_recv_tokens_per_expert_list: Python list `[num_local_experts]`, the tokens received for each local
                expert, rounded up to `expert_alignment`; empty if `num_worst_tokens` is set; None in the cached mode.
            handle: the layout, for `combine`, cached dispatches and backward (the same handle in the cached mode).
            event: the event after the communication (meaningful only with `async_finish` on CUDA).
        """
        self._check_alive()
        handle = _handle_of(handle)
        expert_alignment, num_worst_tokens = _plain_int(expert_alignment), _plain_int(num_worst_tokens)
        float_x = isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float8_e4m3fn
        grad_x = float_x and x.requires_grad and not (fp8 and not dequantize)
        grad_w = isinstance(topk_weights, torch.Tensor) and topk_weights.requires_grad
        if torch.is_grad_enabled() and (grad_x or grad_w):
            fields = dict(handle=handle, num_tokens_per_rank=num_tokens_per_rank,
                          num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                          num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
                          expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                          previous_event=previous_event, async_finish=async_finish, fp8=fp8, dequantize=dequantize,
                          config=config)
            return dispatch_with_grad(self._untracked(), x, topk_weights, fields)
        return self._dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                              num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                              previous_event, async_finish, fp8, dequantize, config=config)

    @_aborts
    def _dispatch(self, x: Tensorish, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                  num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, previous_event,
                  async_finish, fp8, dequantize, internal: bool = False, config=None):
        """`dispatch` without autograd. `internal` allows the cached mode to carry `topk_weights` (for backward)
        and `x=None`."""
        if self._capturing():
            try:
                return self._dispatch_captured(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                               is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                               expert_alignment, num_worst_tokens, previous_event, async_finish, fp8,
                                               dequantize, internal, config)
            except EPArgumentError as error:
                raise _on_every_rank(error)
        self._wait_previous(previous_event)  # before the checks read the layout's values on the host
        header = self._header(OP_DISPATCH)
        error = None
        sms = 0
        try:
            sms = self._call_sms(config)
            header[:, H_NUM_SMS] = sms
            spec = self._check_dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                        num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                        num_worst_tokens, previous_event, fp8, dequantize, internal)
            self._fill_header(header, spec)
            header[:, H_HANDLE] = handle.round if handle is not None else 0
        except EPArgumentError as e:
            error = e
            header[:, H_STATUS] = _status_code(e)
        headers = self._exchange(OP_DISPATCH, "counts", header, error)

        values, scales = spec["values"], spec["scales"]
        fp8_on_wire = fp8 or scales is not None
        cached = handle is not None
        use_nvlink = self._nvlink_moves(values, handle, quantize=fp8 and scales is None)
        if fp8 and values is not None and scales is None and not use_nvlink:
            values, scales = fp8_lib.quantize_activations(values)
        if cached:
            num_local_experts = handle.num_local_experts
        else:
            tokens_from_to = headers[:, HEADER_WORDS:].tolist()
            num_local_experts = spec["num_experts"] // self.group_size
            recv_per_rank = [sum(row[q] for row in tokens_from_to) for q in range(self.group_size)]
            try:
                check_num_worst_tokens(recv_per_rank, headers[:, H_NUM_WORST].tolist())
            except EPArgumentError as error:  # (every rank checks the same headers)
                raise _on_every_rank(error)
            per_expert = torch.tensor(spec["host_layout"]["num_tokens_per_expert"]).view(self.group_size,
                                                                                         num_local_experts)
            recv_per_expert = self.transport.exchange_headers("dispatch", "expert counts", per_expert).sum(0)
            handle = DispatchHandle(
                buffer_id=id(self), rank=self.rank, num_ranks=self.group_size,
                is_token_in_rank=is_token_in_rank,
                # (NvlinkTransport's from its own count exchange, on the device: `_dispatch_nvlink`)
                rank_prefix_matrix=(None if use_nvlink and self.backend != "copy_engine"
                                    else rank_prefix_matrix_from_counts(tokens_from_to, self.device)),
                recv_src_idx=torch.empty(0, dtype=torch.int32, device=self.device),
                num_recv_tokens=recv_per_rank[self.rank], num_worst_tokens=num_worst_tokens,
                num_local_experts=num_local_experts, round=self._round)
            # (the reference transport's own plan of the layout is made when it first moves data with it)

        if use_nvlink:
            recv_values, recv_scales, recv_topk_idx, recv_topk_weights = self._dispatch_nvlink(
                handle, cached, values, scales, fp8 and scales is None, topk_idx, topk_weights, num_local_experts, sms)
        else:
            payload = [t for t in (values, scales, topk_idx, topk_weights) if t is not None]
            if not cached:
                num_tokens = handle.num_tokens
                payload.append(torch.arange(num_tokens, dtype=torch.int32, device=self.device).view(num_tokens, 1))
            received = iter(self.transport.dispatch("dispatch", handle, payload))
            # a cached dispatch of a device transport's layout: its rows where that transport put them
            perm = _reference_rows(handle) if cached else None
            recv_values = _rows_from_reference(next(received), perm) if values is not None else None
            recv_scales = _rows_from_reference(next(received), perm) if scales is not None else None
            recv_topk_idx = _rows_from_reference(next(received), perm) if topk_idx is not None else None
            recv_topk_weights = _rows_from_reference(next(received), perm) if topk_weights is not None else None
            if not cached:  # padded to the received rows, as DeepEP's, with -1 (DeepEP leaves them unwritten)
                handle.recv_src_idx = next(received)[:, 0].contiguous()
                handle.recv_src_idx[handle.num_recv_tokens:] = -1
            if recv_topk_idx is not None:
                recv_topk_idx[handle.num_recv_tokens:] = -1
                recv_topk_idx = to_local_expert_ids(recv_topk_idx, self.rank, num_local_experts)
        recv_x, recv_topk_weights = self._received(spec, recv_values, recv_scales, recv_topk_idx, recv_topk_weights,
                                                   fp8_on_wire, dequantize)
        if cached:
            num_recv_tokens_per_expert_list = None
        elif num_worst_tokens > 0:
            num_recv_tokens_per_expert_list = []
        else:
            counts = recv_per_expert.tolist()
            num_recv_tokens_per_expert_list = (counts if expert_alignment == 1
                                               else [align_up(c, expert_alignment) for c in counts])
        return (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
                self._finish_event(async_finish))

    @staticmethod
    def _received(spec, recv_values, recv_scales, recv_topk_idx, recv_topk_weights, fp8_on_wire, dequantize):
        """``recv_x`` in the form `dispatch` returns, and the weights zeroed where the top-k id is -1."""
        if recv_topk_idx is not None and recv_topk_weights is not None:
            recv_topk_weights = recv_topk_weights.masked_fill(recv_topk_idx < 0, 0.0)
        if fp8_on_wire and dequantize:
            out_dtype = spec["values"].dtype if spec["scales"] is None else torch.bfloat16
            return fp8_lib.dequantize_1x128(recv_values, recv_scales, out_dtype), recv_topk_weights
        if fp8_on_wire:
            return (recv_values, recv_scales), recv_topk_weights
        return recv_values, recv_topk_weights

    # -- inside a CUDA graph capture -------------------------------------------------------------------------

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _dispatch_captured(self, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                           num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                           previous_event, async_finish, fp8, dequantize, internal, config):
        """`_dispatch` while the current stream is captured into a CUDA graph: no host synchronization and no
        host exchange, so the nvlink backend only, with `num_worst_tokens` (or a handle of such a dispatch), after
        an eager dispatch of the same hidden size (it allocates the symmetric buffer). Shapes, dtypes and the
        agreement of ranks are not exchanged: the eager call before the capture checks them; the values of the
        layout tensors are not checked."""
        if self.backend not in CAPTURABLE_BACKENDS:
            raise _reject("backend", f"only the {' and '.join(CAPTURABLE_BACKENDS)} backends run inside a CUDA graph "
                                     f"capture (no host synchronization); this buffer's is {self.backend!r}")
        if self.backend == "nvlink_copy_engine" and handle is None:
            raise _reject("handle", "the nvlink_copy_engine backend plans its copies on the host: a captured dispatch "
                                    "needs the handle of an eager dispatch (cached mode)")
        spec = self._check_dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                    num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                                    previous_event, fp8, dequantize, internal, check_values=False)
        worst = handle.num_worst_tokens if handle is not None else num_worst_tokens
        if worst <= 0:
            raise _reject("num_worst_tokens", "a dispatch captured in a CUDA graph needs num_worst_tokens > 0 (a "
                                              "fixed number of received rows: no host synchronization)")
        values, scales = spec["values"], spec["scales"]
        quantize = fp8 and scales is None
        if not self._nvlink_moves(values, handle, quantize):
            raise _reject("x", "a captured dispatch moves bf16 or FP8 values (or quantizes floating-point ones with "
                               "fp8=True) of a layout the nvlink kernels made")
        if values.size(1) not in self._nvlink_transports:
            raise _reject("x", f"make one dispatch of hidden size {values.size(1)} before capturing (it allocates "
                               f"the symmetric buffer, which a capture cannot)")
        sms = self._captured_sms(config, self._nvlink_transports[values.size(1)])
        self._wait_previous(previous_event)
        cached = handle is not None
        if not cached:
            handle = DispatchHandle(
                buffer_id=id(self), rank=self.rank, num_ranks=self.group_size, is_token_in_rank=is_token_in_rank,
                rank_prefix_matrix=torch.empty(0, dtype=torch.int32, device=self.device),
                recv_src_idx=torch.empty(0, dtype=torch.int32, device=self.device),
                num_recv_tokens=-1, num_worst_tokens=worst, num_local_experts=spec["num_experts"] // self.group_size,
                round=self._round)
        recv_values, recv_scales, recv_topk_idx, recv_topk_weights = self._dispatch_nvlink(
            handle, cached, values, scales, quantize, topk_idx, topk_weights, handle.num_local_experts, sms)
        recv_x, recv_topk_weights = self._received(spec, recv_values, recv_scales, recv_topk_idx, recv_topk_weights,
                                                   fp8 or scales is not None, dequantize)
        return (recv_x, recv_topk_idx, recv_topk_weights, None if cached else [], handle,
                self._finish_event(async_finish))

    @_aborts
    def check_kernels(self) -> None:
        """
        Raise `EPError` if a kernel of this rank recorded a timeout (a peer that never arrived) since the last
        Buffer call; waits for the current stream. Every eager call does this itself; call it after replaying
        CUDA graphs, where no host code of the buffer runs.
        """
        failure = self._check_nvlink_kernels(whole_stream=True)
        if failure:
            self._nvlink_failure = failure
            raise EPError(f"rank {self.rank}: {failure}")

    # -- combine ---------------------------------------------------------------------------------------------

    @_aborts
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None, config=None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) \
            -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """
        Send each received token back to the rank it came from and add up the copies (**without** weights), in
        fp32. Collective; the reverse of the dispatch that made `handle`.

        Arguments:
            x: `[num_recv_tokens, hidden]` (or `[num_worst_tokens, hidden]` if the dispatch padded; the padding rows
                are ignored) with `torch.bfloat16` (or `torch.float16` / `torch.float32`), rows in the order
                `dispatch` returned them; any strides and offset, as for `dispatch`.
            handle: the handle returned by the dispatch being reversed, or the tuple of its six DeepEP fields that
                unpacking it gave (`DispatchHandle.from_deepep_tuple`).
            topk_weights: `[num_recv_tokens, num_topk]` with `torch.float`, summed the same way, or None.
            bias: None, or one or two `[num_tokens, hidden]` tensors of `x`'s dtype added to the result.
            config: as for `dispatch`: the SMs of this call's kernels (`config.num_sms`), else `num_sms`.
            previous_event: the event the current stream waits for before the call reads its inputs.
            async_finish: also return an event recorded after the call's work, for another stream to wait for; the
                work itself runs on the current stream either way (there is no separate communication stream, see
                docs/ep.md "Differences from DeepEP"); the reference backend always finishes before returning.
            allocate_on_comm_stream: accepted for DeepEP compatibility; every backend ignores it (the results are
                allocated on the current stream).

        Returns:
            combined_x: `[num_tokens, hidden]`, `x`'s dtype: for each token of this rank, the sum of the rows that
                the ranks it was dispatched to sent back (plus `bias`); zero for tokens dispatched nowhere.
            combined_topk_weights: `[num_tokens, num_topk]` with `torch.float`, summed the same way, or None.
            event: the event after the communication (meaningful only with `async_finish` on CUDA).
        """
        self._check_alive()
        handle = _handle_of(handle)
        biases = _bias_tuple(bias)
        needs_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in (x, topk_weights, *biases))
        # (a bias the checks reject, on every rank: untracked, to be rejected there)
        trackable = len(biases) <= 2 and (bias is None or isinstance(bias, (torch.Tensor, tuple, list)))
        if torch.is_grad_enabled() and needs_grad and trackable:
            return combine_with_grad(self._untracked(), x, handle, topk_weights, biases, previous_event, async_finish,
                                     config)
        return self._combine(x, handle, topk_weights, bias, previous_event, async_finish, config=config)

    @_aborts
    def _combine(self, x, handle, topk_weights, bias, previous_event, async_finish, internal: bool = False,
                 config=None):
        """`combine` without autograd; `internal` allows `x=None` (backward of weights only)."""
        if self._capturing():  # no host exchange: the nvlink kernels only (see _dispatch_captured)
            try:
                biases = self._check_combine(x, handle, topk_weights, bias, previous_event, internal)
                if not self._nvlink_combines(x, handle):
                    raise _reject("x", "a captured combine takes bf16 rows of a dispatch made by the nvlink kernels")
                sms = self._captured_sms(config, handle.nvlink_transport)
            except EPArgumentError as error:
                raise _on_every_rank(error)
            self._wait_previous(previous_event)
            combined_x, summed_weights = self._combine_nvlink(x, handle, topk_weights, biases, sms)
            return combined_x, summed_weights, self._finish_event(async_finish)
        self._wait_previous(previous_event)
        header = self._header(OP_COMBINE)
        error = None
        sms = 0
        try:
            biases = self._check_combine(x, handle, topk_weights, bias, previous_event, internal)
            sms = self._call_sms(config)
            header[:, H_NUM_SMS] = sms
            header[:, H_HANDLE] = handle.round
            if x is not None:
                header[:, H_HIDDEN] = x.size(1)
                header[:, H_DTYPE] = DTYPE_CODES[x.dtype]
            header[:, H_NUM_TOPK] = topk_weights.size(1) if topk_weights is not None else -1
            header[:, H_FLAGS] = FLAG_TOPK_WEIGHTS * (topk_weights is not None)
        except EPArgumentError as e:
            error = e
            header[:, H_STATUS] = _status_code(e)
        self._exchange(OP_COMBINE, "status", header, error)

        if self._nvlink_combines(x, handle):
            combined_x, summed_weights = self._combine_nvlink(x, handle, topk_weights, biases, sms)
            return combined_x, summed_weights, self._finish_event(async_finish)
        rows = handle.num_recv_rows
        perm = _reference_rows(handle)  # rows of a device transport's dispatch, in the reference transport's order
        summed_x, summed_weights = self.transport.combine(
            "combine", handle, [_rows_to_reference(x[:rows], perm) if x is not None else None,
                                _rows_to_reference(topk_weights[:rows], perm) if topk_weights is not None else None])
        combined_x = None
        if summed_x is not None:
            for b in biases:
                summed_x += b.float()
            combined_x = summed_x.to(x.dtype)
        return combined_x, summed_weights, self._finish_event(async_finish)

    @staticmethod
    def _nvlink_combines(x, handle) -> bool:
        """Whether the nvlink kernels combine these rows: bf16 rows of a dispatch they made."""
        nvlink = getattr(handle, "nvlink_transport", None)
        return nvlink is not None and x is not None and x.dtype == torch.bfloat16 and x.size(1) == nvlink.hidden

    def _combine_nvlink(self, x, handle, topk_weights, biases, sms: int):
        rows = handle.num_recv_rows
        self._eager_sms[id(handle.nvlink_transport)] = sms  # (for `_captured_sms`)
        out, summed_weights = handle.nvlink_transport.combine(
            _dense(x[:rows]), _dense(topk_weights[:rows]) if topk_weights is not None else None,
            handle.nvlink_layout, num_sms=sms)
        if not biases:
            return out, summed_weights
        summed_x = out.float()  # rounded to bf16 by the kernel: with a bias, one rounding more than the reference
        for b in biases:
            summed_x += b.float()
        return summed_x.to(x.dtype), summed_weights

    # -- the nvlink transport ----------------------------------------------------------------------------------

    def _nvlink_moves(self, values, handle, quantize: bool) -> bool:
        """Whether this dispatch goes through the device kernels (the same answer on every rank: it depends on
        arguments the header exchange has made agree). They move bf16 and FP8 values, and quantize bf16, fp16
        or fp32 values to FP8 inside the kernel (`quantize`); anything else, and cached dispatches of layouts
        they did not make, take the reference transport."""
        if self.backend not in DEVICE_BACKENDS or values is None:
            return False
        movable = (torch.bfloat16, torch.float8_e4m3fn) + ((torch.float16, torch.float32) if quantize else ())
        if values.dtype not in movable:
            return False
        return handle is None or getattr(handle, "nvlink_layout", None) is not None

    def _nvlink(self, hidden: int, sms: int):
        """The NVLink transport for this hidden size, made (collectively) at its first dispatch; its kernels run
        ``sms`` programs from this call on (every rank's calls agree on the count)."""
        transport = self._nvlink_transports.get(hidden)
        if transport is None:
            Transport = _transport_class(self.backend)
            tokens = 1
            while Transport.buffer_bytes(self.group_size, tokens * 2, hidden, NVLINK_MAX_TOPK) <= self.num_nvl_bytes:
                tokens *= 2
            low, high = tokens, tokens * 2  # the largest token count that fits lies in [low, high)
            while high - low > 1:
                mid = (low + high) // 2
                fits = Transport.buffer_bytes(self.group_size, mid, hidden, NVLINK_MAX_TOPK) <= self.num_nvl_bytes
                low, high = (mid, high) if fits else (low, mid)
            bulk = {"bulk": "copy_engine"} if self.backend == "nvlink_copy_engine" else {}
            transport = Transport(self.group, self.device, low, hidden, NVLINK_MAX_TOPK,
                                  timeout_s=self.timeout_s, **bulk)
            self._nvlink_transports[hidden] = transport
        self._eager_sms[id(transport)] = sms  # (for `_captured_sms`)
        return transport

    def _dispatch_nvlink(self, handle, cached, values, scales, quantize, topk_idx, topk_weights, num_local_experts,
                         sms: int):
        """The data phase of a dispatch through the NVLink kernels, on ``sms`` programs. The received tensors are
        copied out of the transport's buffer, so they stay valid like the reference backend's."""
        transport = self._nvlink(values.size(1), sms)
        dense = lambda t: None if t is None else _dense(t)  # noqa: E731
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src, layout = transport.dispatch(
            dense(values), dense(scales), dense(topk_idx), dense(topk_weights), handle.is_token_in_rank.contiguous(),
            num_local_experts, num_sms=sms, quantize=quantize, num_worst_tokens=handle.num_worst_tokens,
            cached=handle.nvlink_layout if cached else None, num_recv_tokens=None if cached else handle.num_recv_tokens)
        if not cached:
            handle.nvlink_layout, handle.nvlink_transport = layout, transport
            if getattr(layout, "rank_prefix_matrix", None) is not None:
                handle.rank_prefix_matrix = layout.rank_prefix_matrix
            handle.recv_src_idx = recv_src[:handle.num_recv_rows].clone()  # padding rows: -1 from the kernels
            if hasattr(transport, "plan"):  # every copy plan of the layout now, on the host (bulk="copy_engine"),
                # so that later dispatches and combines with this handle can be captured in a CUDA graph
                transport.plan(layout, handle.is_token_in_rank, num_sms=sms)
        if not transport.returns_views:
            return recv_x, recv_scales, recv_topk_idx, recv_topk_weights
        clone = lambda t: None if t is None else t.clone()  # noqa: E731
        return clone(recv_x), clone(recv_scales), clone(recv_topk_idx), clone(recv_topk_weights)

    # -- validation ------------------------------------------------------------------------------------------

    def _check_topk_idx(self, topk_idx, num_tokens: Optional[int], num_experts: int, values: bool = True) -> None:
        """``values``: also check the ids (reads them on the host: not while capturing a CUDA graph)."""
        _check_topk_idx_form(topk_idx, num_tokens, self.device)
        if values and topk_idx.numel():
            _check_expert_range(*torch.stack(torch.aminmax(topk_idx)).tolist(), num_experts)  # one copy to the host

    def _check_dispatch(self, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                        num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                        previous_event, fp8, dequantize, internal, check_values: bool = True) -> dict:
        """Raise EPArgumentError for the first invalid argument; return what the header and payload need.
        ``check_values``: also check the values of the layout tensors (host reads: not while capturing a CUDA graph)."""
        num_ranks = self.group_size
        if isinstance(x, tuple):
            if len(x) != 2:
                raise _reject("x", f"an FP8 input is a tuple (x_fp8, scales), got a tuple of {len(x)}")
            values, scales = x
            _check_tensor("x", values, self.device, (torch.float8_e4m3fn,), (None, None))
            num_tokens, hidden = values.shape
            if hidden % SCALE_BLOCK:
                raise _reject("x", f"FP8 hidden size must be a multiple of {SCALE_BLOCK}, got {hidden}")
            _check_tensor("x", scales, self.device, (torch.float32,), (num_tokens, hidden // SCALE_BLOCK))
            if fp8:
                raise _reject("fp8", "x is already FP8; fp8=True quantizes a floating-point x")
        elif x is None and internal:
            values = scales = None
            num_tokens, hidden = handle.num_tokens, 0
        else:
            _check_tensor("x", x, self.device, FLOAT_DTYPES, (None, None))
            values, scales = x, None
            num_tokens, hidden = x.shape
            if fp8 and hidden % SCALE_BLOCK:
                raise _reject("x", f"fp8=True needs a hidden size that is a multiple of {SCALE_BLOCK}, got {hidden}")
        if values is not None and hidden < 1:
            raise _reject("x", f"expected a hidden size >= 1, got shape {tuple(values.shape)}")
        if not isinstance(fp8, bool):
            raise _reject("fp8", f"expected a bool, got {fp8!r}")
        if not isinstance(dequantize, bool):
            raise _reject("dequantize", f"expected a bool, got {dequantize!r}")
        if dequantize and not (fp8 or scales is not None):
            raise _reject("dequantize", "dequantize=True needs FP8 on the wire (fp8=True or an FP8 x)")
        _check_int("expert_alignment", expert_alignment, 1)
        _check_int("num_worst_tokens", num_worst_tokens, 0, MAX_ROWS)
        _check_event(previous_event)
        if num_tokens_per_rdma_rank is not None:
            raise _reject("num_tokens_per_rdma_rank", "must be None: this buffer is intranode only")

        num_experts = 0
        host_layout = None
        if handle is not None:
            _check_handle(handle, id(self))
            if handle.num_tokens != num_tokens:
                raise _reject("handle", f"the handle is for {handle.num_tokens} tokens, x has {num_tokens}")
            if topk_idx is not None or (topk_weights is not None and not internal):
                name = "topk_idx" if topk_idx is not None else "topk_weights"
                raise _reject(name, "must be None with handle= (the cached mode moves only x)")
            if topk_weights is not None:
                _check_tensor("topk_weights", topk_weights, self.device, (torch.float32,), (num_tokens, None))
        else:
            _check_tensor("num_tokens_per_expert", num_tokens_per_expert, self.device, (torch.int32, torch.int64),
                          (None,))
            num_experts = num_tokens_per_expert.numel()
            if num_experts == 0 or num_experts % num_ranks:
                raise _reject("num_tokens_per_expert", f"{num_experts} experts do not divide evenly over "
                                                       f"{num_ranks} ranks")
            _check_tensor("is_token_in_rank", is_token_in_rank, self.device, (torch.bool,), (num_tokens, num_ranks))
            _check_tensor("num_tokens_per_rank", num_tokens_per_rank, self.device, (torch.int32, torch.int64),
                          (num_ranks,))
            if topk_idx is not None:
                self._check_topk_idx(topk_idx, num_tokens, num_experts, values=False)
                if topk_weights is not None:
                    _check_tensor("topk_weights", topk_weights, self.device, (torch.float32,),
                                  (num_tokens, topk_idx.size(1)))
            elif topk_weights is not None:
                raise _reject("topk_weights", "needs topk_idx")
            if check_values:
                host_layout = self._layout_on_host(num_tokens_per_rank, is_token_in_rank, topk_idx,
                                                   num_tokens_per_expert, num_experts)

        num_topk = topk_idx.size(1) if topk_idx is not None else (
            topk_weights.size(1) if topk_weights is not None else 0)
        if self.backend in DEVICE_BACKENDS and hidden > 0:
            name = self.backend
            if hidden % SCALE_BLOCK:
                raise _reject("x", f"the {name} backend needs a hidden size that is a multiple of {SCALE_BLOCK}, "
                                   f"got {hidden}")
            need = self._size_hint(num_tokens, hidden, num_ranks, num_topk, backend=name)
            if need > self.num_nvl_bytes:
                raise _reject("num_nvl_bytes", f"{num_tokens} tokens of hidden {hidden} need {need} bytes with the "
                                               f"{name} backend (get_buffer_size_hint(..., backend={name!r})) but "
                                               f"the buffer has {self.num_nvl_bytes}")
            if num_topk > NVLINK_MAX_TOPK:
                raise _reject("topk_idx", f"the {name} backend moves up to {NVLINK_MAX_TOPK} top-k columns, got "
                                          f"{num_topk}")
        elif self.num_nvl_bytes > 0 and hidden > 0:
            if internal and handle is not None:  # the backward of a combine: its rows, as that combine checked them
                need = self._combine_size(num_tokens, hidden, num_ranks, num_topk, values.dtype)
            else:
                need = self._size_hint(num_tokens, hidden, num_ranks, num_topk,
                                       values.dtype if scales is None and not fp8 else torch.bfloat16,
                                       fp8 or scales is not None,
                                       values.dtype if values.dtype in FLOAT_DTYPES else torch.bfloat16)
            if need > self.num_nvl_bytes:
                raise _reject("num_nvl_bytes", f"{num_tokens} tokens of hidden {hidden} need {need} bytes "
                                               f"(get_buffer_size_hint) but the buffer has {self.num_nvl_bytes}")
        flags = (FLAG_SCALES * (fp8 or scales is not None) + FLAG_TOPK_IDX * (topk_idx is not None)
                 + FLAG_TOPK_WEIGHTS * (topk_weights is not None) + FLAG_CACHED * (handle is not None))
        return dict(values=values, scales=scales, num_tokens=num_tokens, hidden=hidden, num_experts=num_experts,
                    num_topk=num_topk, flags=flags, num_worst_tokens=num_worst_tokens, host_layout=host_layout)

    def _layout_on_host(self, num_tokens_per_rank, is_token_in_rank, topk_idx, num_tokens_per_expert,
                        num_experts: int) -> dict:
        """Check the values of an uncached dispatch's layout tensors; return the counts as Python lists. One copy
        to the host (one synchronization) for all of them."""
        num_ranks = self.group_size
        with_topk = topk_idx is not None and topk_idx.numel() > 0
        # the layout must be topk_idx's (ids out of range, rejected below, are left out of it)
        summary = (check_dispatch_layout(topk_idx, num_experts, is_token_in_rank) if with_topk
                   else is_token_in_rank.sum(0))
        values = torch.cat([num_tokens_per_rank, num_tokens_per_expert, summary]).tolist()  # (int64: promoted)
        per_rank, per_expert = values[:num_ranks], values[num_ranks:num_ranks + num_experts]
        in_rank = values[num_ranks + num_experts:2 * num_ranks + num_experts]
        if per_rank != in_rank:
            raise _reject("num_tokens_per_rank", "does not match is_token_in_rank.sum(0)")
        num_tokens = is_token_in_rank.size(0)
        if topk_idx is not None and not with_topk and any(per_expert):
            raise _reject("num_tokens_per_expert", "must be all 0: topk_idx chooses no expert (it is empty)")
        if any(not 0 <= count <= num_tokens for count in per_expert):
            raise _reject("num_tokens_per_expert", f"expected counts in [0, {num_tokens}] (the tokens), got "
                                                   f"{min(per_expert)} to {max(per_expert)}")
        if with_topk:
            implied_per_expert = values[2 * num_ranks + num_experts:2 * num_ranks + 2 * num_experts]
            outside, differ = values[-2:]
            if outside:  # (only now the exact range, for the message)
                _check_expert_range(*torch.stack(torch.aminmax(topk_idx)).tolist(), num_experts)
            if differ:
                raise _reject("is_token_in_rank", f"does not match topk_idx in {differ} entries (a token goes to "
                                                  f"the ranks of its experts: get_dispatch_layout(topk_idx, ...))")
            if implied_per_expert != per_expert:
                raise _reject("num_tokens_per_expert", "does not match topk_idx (the tokens that chose each expert: "
                                                       "get_dispatch_layout(topk_idx, ...))")
        return dict(num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert)

    def _check_combine(self, x, handle, topk_weights, bias, previous_event, internal) -> Tuple[torch.Tensor, ...]:
        _check_handle(handle, id(self))
        rows = handle.num_recv_rows
        if x is None and internal:
            hidden = None
        else:
            _check_tensor("x", x, self.device, FLOAT_DTYPES, (rows, None))
            hidden = x.size(1)
            if hidden < 1:
                raise _reject("x", f"expected a hidden size >= 1, got shape {tuple(x.shape)}")
            if self.num_nvl_bytes > 0:
                num_topk = topk_weights.size(1) if isinstance(topk_weights, torch.Tensor) else 0
                need = self._combine_size(handle.num_tokens, hidden, self.group_size, num_topk, x.dtype)
                if need > self.num_nvl_bytes:
                    raise _reject("num_nvl_bytes", f"combining {handle.num_tokens} tokens of hidden {hidden} needs "
                                                   f"{need} bytes (get_buffer_size_hint) but the buffer has "
                                                   f"{self.num_nvl_bytes}")
        if topk_weights is not None:
            _check_tensor("topk_weights", topk_weights, self.device, (torch.float32,), (rows, None))
            if self.backend in DEVICE_BACKENDS and topk_weights.size(1) > NVLINK_MAX_TOPK:
                raise _reject("topk_weights", f"the {self.backend} backend combines up to {NVLINK_MAX_TOPK} top-k "
                                              f"columns, got {topk_weights.size(1)}")
        if bias is not None and not isinstance(bias, (torch.Tensor, tuple, list)):
            raise _reject("bias", f"expected None, a tensor, or a tuple of two tensors, got {type(bias).__name__}")
        biases = _bias_tuple(bias)
        if len(biases) > 2 or (biases and x is None):
            raise _reject("bias", "expected None, a tensor, or a tuple of two tensors")
        for b in biases:
            _check_tensor("bias", b, self.device, (x.dtype,), (handle.num_tokens, hidden))
        _check_event(previous_event)
        return biases

    # -- agreement between ranks -----------------------------------------------------------------------------

    def _header(self, op: int) -> np.ndarray:
        """This call's header rows, one per rank (numpy: filling a tensor's columns cost microseconds each)."""
        self._round += 1
        header = np.zeros((self.group_size, HEADER_WORDS + self.group_size), dtype=np.int64)
        header[:, H_OP] = op
        header[:, H_ROUND] = self._round
        self._nvlink_failure = self._nvlink_failure or self._check_nvlink_kernels()
        if self._nvlink_failure:
            header[:, H_STATUS] = STATUS_TRANSPORT_FAILED
        return header

    def _check_nvlink_kernels(self, whole_stream: bool = False) -> Optional[str]:
        """The timeout a device kernel of this rank has recorded so far, if any (its status word in pinned host
        memory, written when the wait gives up; read without waiting for the kernels, see `Buffer`). With
        ``whole_stream``, first wait for the current stream (`check_kernels`)."""
        if not self._nvlink_transports:
            return None
        if whole_stream:
            torch.cuda.current_stream(self.device).synchronize()
        for transport in self._nvlink_transports.values():
            try:
                transport.raise_if_failed()
            except (EPTimeoutError, ValueError) as error:
                return str(error)
        return None

    @staticmethod
    def _fill_header(header: np.ndarray, spec: dict) -> None:
        header[:, H_NUM_TOKENS] = spec["num_tokens"]
        header[:, H_NUM_EXPERTS] = spec["num_experts"]
        header[:, H_HIDDEN] = spec["hidden"]
        header[:, H_DTYPE] = DTYPE_CODES[spec["values"].dtype] if spec["values"] is not None else 0
        header[:, H_NUM_TOPK] = spec["num_topk"]
        header[:, H_FLAGS] = spec["flags"]
        header[:, H_NUM_WORST] = spec["num_worst_tokens"]
        if spec["host_layout"] is not None:
            header[:, HEADER_WORDS:] = spec["host_layout"]["num_tokens_per_rank"]

    def _exchange(self, op: int, what: str, header: np.ndarray, own_error: Optional[EPArgumentError]) -> torch.Tensor:
        """Send this rank's header rows (`what`, for error messages), agree on the rows every rank sent (`_agree`);
        returns them, row q from rank q."""
        headers = self.transport.exchange_headers(OP_NAMES[op], what, torch.from_numpy(header))
        self._agree(op, headers, own_error)
        return headers

    def _agree(self, op: int, headers: torch.Tensor, own_error: Optional[EPArgumentError]) -> None:
        """Every rank sees the same headers, so every rank reaches the same verdict here."""
        rows = headers.tolist()  # Python ints: indexing the tensor costs microseconds per element
        first = AGREED_WORDS(rows[0])
        if (own_error is None and first[:3] == (op, self._round, 0)
                and all(AGREED_WORDS(row) == first for row in rows)):
            return  # every rank made this call with arguments that agree: what the checks below find, sooner
        name = OP_NAMES[op]
        for r, row in enumerate(rows):
            if row[H_OP] != op or row[H_ROUND] != self._round:
                self.transport.failure = "ranks out of step"
                raise EPError(f"{name}: rank {r} is in {OP_NAMES.get(row[H_OP], '?')} call "
                              f"#{row[H_ROUND]} while rank {self.rank} is in {name} call #{self._round}; "
                              f"every rank must make the same Buffer calls in the same order")
        failed = [r for r, row in enumerate(rows) if row[H_STATUS] == STATUS_TRANSPORT_FAILED]
        if failed:
            self.transport.failure = f"an NVLink kernel failed on rank {failed[0]}"
            own = f" (here: {self._nvlink_failure})" if self._nvlink_failure else ""
            raise EPError(f"{name}: an NVLink kernel of rank(s) {failed} timed out in an earlier call{own}; this "
                          f"buffer is unusable, make a new group and Buffer")
        if own_error is not None:
            raise _on_every_rank(own_error)
        for r, row in enumerate(rows):
            status = row[H_STATUS]
            if status:
                argument = ARGUMENTS[status - 1] if status <= len(ARGUMENTS) else "arguments"
                raise _on_every_rank(_reject(argument, f"rejected on rank {r} (that rank's error says why); {name} "
                                                       f"did not start"))
        if op == OP_INIT:
            return
        checks = [(H_FLAGS, FLAG_CACHED, "handle", "the cached mode (handle=)"),
                  (H_HIDDEN, None, "x", "the hidden size"), (H_DTYPE, None, "x", "the dtype"),
                  (H_FLAGS, FLAG_SCALES, "fp8", "FP8 on the wire"),
                  (H_FLAGS, FLAG_TOPK_IDX, "topk_idx", "whether topk_idx is given"),
                  (H_FLAGS, FLAG_TOPK_WEIGHTS, "topk_weights", "whether topk_weights is given"),
                  # (a combine's num_topk is its topk_weights' width)
                  (H_NUM_TOPK, None, "topk_idx" if op == OP_DISPATCH else "topk_weights", "num_topk")]
        if op == OP_DISPATCH:
            checks.append((H_NUM_EXPERTS, None, "num_tokens_per_expert", "num_experts"))
        # the handle of a cached dispatch or a combine: made by the same dispatch call on every rank
        checks.append((H_HANDLE, None, "handle", "the dispatch call that made the handle (call numbers)"))
        # the device kernels of every rank wait for the same number of programs from each peer
        checks.append((H_NUM_SMS, None, "config", "the SM count (config.num_sms, or Buffer.set_num_sms)"))
        for word, mask, argument, what in checks:
            values = [row[word] if mask is None else row[word] & mask for row in rows]
            if len(set(values)) != 1:
                raise _on_every_rank(_reject(argument, f"{what} differs between ranks: {values} on ranks "
                                                       f"0..{self.group_size - 1}"))

    # -- events ----------------------------------------------------------------------------------------------

    def _wait_previous(self, previous_event: Optional[EventOverlap]) -> None:
        """Make the current stream wait for `previous_event` (anything else is left to the argument checks,
        which reject it on every rank)."""
        if isinstance(previous_event, EventOverlap):
            previous_event.current_stream_wait()

    def _untracked(self) -> Untracked:
        """This buffer's calls without autograd, for `smsplit.ep.autograd` (its internal contract: `Untracked`)."""
        return Untracked(self.device, self._dispatch, self._combine, self._finish_event)

    def _finish_event(self, async_finish: bool) -> EventOverlap:
        return EventOverlap.record_current_stream(self.device) if async_finish else EventOverlap()
