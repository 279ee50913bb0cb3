"""The checks of `Buffer`'s arguments: each rule once, each failure an `EPArgumentError` (a `ValueError`) whose message
starts with the argument's name. What a transport cannot move is the registry's to say
(`smsplit.ep.registry.problem`); everything else is here."""

import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .. import _args as args
from ..timeouts import timeout_problem
from .event import EventOverlap
from .header import FLAG_CACHED, FLAG_SCALES, FLAG_TOPK_IDX, FLAG_TOPK_WEIGHTS, HEADER_WORDS
from .layout import DispatchHandle, check_dispatch_layout
from .rows import SCALE_BLOCK, buffer_bytes, combine_row_bytes
from .registry import check_backend
from .transport import EPArgumentError, reject

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# DeepEP's `deep_ep.topk_idx_t`: the dtype of `topk_idx` (DeepEP's default build; one built with TOPK_IDX_BITS=32
# takes int32, which these kernels and checks do not)
topk_idx_t = torch.int64
MAX_ROWS = (1 << 31) - 1  # received rows are named by int32 indices (recv_src_idx, the layouts' positions)
MAX_COUNT = args.MAX_INT  # a count or size above this cannot be a real one and would overflow the int64 header
MAX_NUM_SMS = 1 << 16  # far above any GPU's SMs; keeps a count inside the int64 header


@dataclass(frozen=True)
class Where:
    """What the checks of one buffer's calls compare with: its device, ranks, identity (of its handles),
    `num_nvl_bytes` and the nodes of its node layout."""

    device: torch.device
    num_ranks: int
    buffer_id: int
    num_nvl_bytes: int
    num_nodes: int = 1


@dataclass
class DispatchSpec:
    """What a checked dispatch's header and payload need: its values (e4m3 with ``scales`` for FP8 input, None for
    weights only), sizes, header flags and, for an uncached eager dispatch, its layout's counts on the host
    (``host_layout``: ``num_tokens_per_rank``, ``num_tokens_per_expert`` as lists)."""

    values: Optional[torch.Tensor]
    scales: Optional[torch.Tensor]
    num_tokens: int
    hidden: int
    num_experts: int
    num_topk: int
    flags: int
    num_worst_tokens: int
    host_layout: Optional[dict]


def combine_bytes(num_tokens: int, hidden: int, num_ranks: int, num_topk: int, dtype: torch.dtype) -> int:
    """The bytes of combining ``num_tokens`` tokens of ``dtype`` with ``num_topk`` weights: combine rows only (a
    buffer sized for an FP8 dispatch holds no BF16 dispatch rows), for every backend."""
    return buffer_bytes(num_tokens, num_ranks, combine_row_bytes(hidden, dtype.itemsize, num_topk),
                        HEADER_WORDS + num_ranks)


def check_topk_idx(topk_idx, num_tokens: Optional[int], num_experts: int, device: torch.device,
                   values: bool = True) -> None:
    """``topk_idx``'s form; ``values``: also its ids (read on the host: not while capturing a CUDA graph)."""
    check_topk_idx_form(topk_idx, num_tokens, device)
    if values and topk_idx.numel():
        check_expert_range(*torch.stack(torch.aminmax(topk_idx)).tolist(), num_experts)  # one copy to the host


def call_sms(config, num_sms: int, budgeted: bool) -> Tuple[int, str]:
    """The SM count of one call and the argument it came from: ``config.num_sms`` when `config` has one (at most
    the budget's comm SMs, ``num_sms``, when ``budgeted``), else ``num_sms`` (the buffer's)."""
    sms = getattr(config, "num_sms", None)  # (DeepEP's own Config, or any object, has none readable: the buffer's)
    if sms is None:
        return num_sms, "num_sms"
    sms = sms_count("config", sms, "config.num_sms must be")
    if budgeted and sms > num_sms:
        raise reject("config", f"config.num_sms={sms} exceeds the budget's {num_sms} comm SMs")
    return sms, "config"


def captured_sms(sms: int, eager_sms: Optional[int]) -> None:
    """A captured call's SM count must be that of the eager calls before it (every rank agreed on it there; a
    capture exchanges nothing, and a combine's copy plan depends on the count)."""
    if sms != eager_sms:
        raise reject("config", f"a call captured in a CUDA graph runs on the SM count of the eager calls before it "
                              f"({eager_sms}); this one asks {sms} (config.num_sms or Buffer.set_num_sms): make an "
                              f"eager call with that count first")


def check_tensor(name: str, t, device: torch.device, dtypes, shape: Tuple[Optional[int], ...]) -> None:
    """`shape` entries of None match any size."""
    if not isinstance(t, torch.Tensor):
        raise reject(name, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise reject(name, f"expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and want != got for want, got in zip(shape, t.shape)):
        want = tuple("*" if s is None else s for s in shape)
        raise reject(name, f"expected shape {want}, got {tuple(t.shape)}")
    if t.device != device:
        raise reject(name, f"expected a tensor on {device} (this buffer's device), got one on {t.device}")


def check_handle(handle, buffer_id: int) -> None:
    """``handle`` must be a `DispatchHandle` of the buffer with id ``buffer_id`` (a DeepEP tuple rebuilt from one
    has been turned into it by then: `DispatchHandle.from_deepep_tuple`)."""
    if isinstance(handle, DispatchHandle) and handle.buffer_id == buffer_id:
        return
    if isinstance(handle, (tuple, list)):
        raise reject("handle", f"a {type(handle).__name__} of {len(handle)} is not a handle of this buffer: a "
                               f"DeepEP-style tuple rebuilt from a handle must hold the six objects that unpacking "
                               f"that handle gave, in order (rank_prefix_matrix, None, None, recv_src_idx, "
                               f"is_token_in_rank, None), not copies")
    raise reject("handle", "expected a handle returned by a dispatch of this buffer")


def check_event(previous_event) -> None:
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise reject("previous_event", f"expected an EventOverlap or None, got {type(previous_event).__name__}")


def plain_int(value):
    """A numpy (or other) integer as a Python int, which the kernels' launches take; anything else as it is (for
    the checks to name)."""
    if type(value) is int:  # (the usual case, without the ABC check below: every call passes two)
        return value
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


def _expected(name: str, wanted: str) -> EPArgumentError:
    return reject(name, f"expected {wanted}")


def check_int(name: str, value, minimum: int, maximum: Optional[int] = None) -> int:
    """An int (numpy ints too) in [minimum, maximum] (`smsplit._args.check_int`'s rule, below `MAX_COUNT` always) as
    a Python int, else `EPArgumentError` naming ``name``."""
    return args.check_int(name, value, minimum, maximum, error=_expected)


def sms_count(name: str, value, subject: str = "expected") -> int:
    """An SM count as an int in [1, MAX_NUM_SMS] (numpy ints too), else `EPArgumentError` naming ``name`` (its
    message: ``subject`` an int in ...)."""
    return args.check_int(name, value, 1, MAX_NUM_SMS, error=lambda _, wanted: reject(name, f"{subject} {wanted}"))


def check_topk_idx_form(topk_idx, num_tokens: Optional[int], device: torch.device) -> None:
    """``topk_idx``'s type, dtype, device and shape (``[num_tokens, k]``, k >= 1; None: any number of tokens)."""
    check_tensor("topk_idx", topk_idx, device, (topk_idx_t,), (num_tokens, None))
    if topk_idx.size(1) < 1:
        raise reject("topk_idx", f"expected at least one top-k column, got shape {tuple(topk_idx.shape)}")


def check_expert_range(low: int, high: int, num_experts: int) -> None:
    """The smallest and largest top-k ids must lie in [-1, num_experts)."""
    if low < -1 or high >= num_experts:
        raise reject("topk_idx", f"expert ids must lie in [-1, {num_experts}) (num_experts={num_experts}), "
                                  f"got values in [{low}, {high}]")


def handle_of(handle):
    """A call's ``handle`` argument as the `DispatchHandle` it stands for: DeepEP's handle is a plain tuple, which
    its callers may unpack and rebuild (`DispatchHandle.from_deepep_tuple`); anything else as it is, for the
    argument checks to accept or reject on every rank."""
    if isinstance(handle, (tuple, list)):
        return DispatchHandle.from_deepep_tuple(handle) or handle
    return handle


def bias_tuple(bias) -> tuple:
    """``bias`` as a tuple of what it holds (a tensor, or the items of a tuple or list); anything else gives ()
    here, for the argument checks to reject on every rank."""
    if isinstance(bias, torch.Tensor):
        return (bias,)
    return tuple(bias) if isinstance(bias, (tuple, list)) else ()


def check_dispatch(where: "Where", x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                   num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, previous_event,
                   fp8, dequantize, internal: bool, check_values: bool = True) -> DispatchSpec:
    """Raise EPArgumentError for the first invalid argument; return what the header and payload need.
    ``check_values``: also check the values of the layout tensors (host reads: not while capturing a CUDA graph)."""
    num_ranks = where.num_ranks
    if isinstance(x, tuple):
        if len(x) != 2:
            raise reject("x", f"an FP8 input is a tuple (x_fp8, scales), got a tuple of {len(x)}")
        values, scales = x
        check_tensor("x", values, where.device, (torch.float8_e4m3fn,), (None, None))
        num_tokens, hidden = values.shape
        if hidden % SCALE_BLOCK:
            raise reject("x", f"FP8 hidden size must be a multiple of {SCALE_BLOCK}, got {hidden}")
        check_tensor("x", scales, where.device, (torch.float32,), (num_tokens, hidden // SCALE_BLOCK))
        if fp8:
            raise reject("fp8", "x is already FP8; fp8=True quantizes a floating-point x")
    elif x is None and internal:
        values = scales = None
        num_tokens, hidden = handle.num_tokens, 0
    else:
        check_tensor("x", x, where.device, FLOAT_DTYPES, (None, None))
        values, scales = x, None
        num_tokens, hidden = x.shape
        if fp8 and hidden % SCALE_BLOCK:
            raise reject("x", f"fp8=True needs a hidden size that is a multiple of {SCALE_BLOCK}, got {hidden}")
    if values is not None and hidden < 1:
        raise reject("x", f"expected a hidden size >= 1, got shape {tuple(values.shape)}")
    if not isinstance(fp8, bool):
        raise reject("fp8", f"expected a bool, got {fp8!r}")
    if not isinstance(dequantize, bool):
        raise reject("dequantize", f"expected a bool, got {dequantize!r}")
    if dequantize and not (fp8 or scales is not None):
        raise reject("dequantize", "dequantize=True needs FP8 on the wire (fp8=True or an FP8 x)")
    check_int("expert_alignment", expert_alignment, 1)
    check_int("num_worst_tokens", num_worst_tokens, 0, MAX_ROWS)
    check_event(previous_event)
    if num_tokens_per_rdma_rank is not None:  # (DeepEP's internode argument: the transports count nodes themselves)
        if where.num_nodes == 1:
            raise reject("num_tokens_per_rdma_rank", "must be None: this buffer's node layout has one node (its "
                                                     "get_dispatch_layout returns None there, as DeepEP's)")
        check_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, where.device, (torch.int32, torch.int64),
                     (where.num_nodes,))

    num_experts = 0
    host_layout = None
    if handle is not None:
        check_handle(handle, where.buffer_id)
        if handle.num_tokens != num_tokens:
            raise reject("handle", f"the handle is for {handle.num_tokens} tokens, x has {num_tokens}")
        if topk_idx is not None or (topk_weights is not None and not internal):
            name = "topk_idx" if topk_idx is not None else "topk_weights"
            raise reject(name, "must be None with handle= (the cached mode moves only x)")
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, where.device, (torch.float32,), (num_tokens, None))
    else:
        check_tensor("num_tokens_per_expert", num_tokens_per_expert, where.device, (torch.int32, torch.int64),
                      (None,))
        num_experts = num_tokens_per_expert.numel()
        if num_experts == 0 or num_experts % num_ranks:
            raise reject("num_tokens_per_expert", f"{num_experts} experts do not divide evenly over "
                                                  f"{num_ranks} ranks")
        check_tensor("is_token_in_rank", is_token_in_rank, where.device, (torch.bool,), (num_tokens, num_ranks))
        check_tensor("num_tokens_per_rank", num_tokens_per_rank, where.device, (torch.int32, torch.int64),
                      (num_ranks,))
        if topk_idx is not None:
            check_topk_idx(topk_idx, num_tokens, num_experts, where.device, values=False)
            if topk_weights is not None:
                check_tensor("topk_weights", topk_weights, where.device, (torch.float32,),
                              (num_tokens, topk_idx.size(1)))
        elif topk_weights is not None:
            raise reject("topk_weights", "needs topk_idx")
        if check_values:
            host_layout = layout_on_host(num_ranks, num_tokens_per_rank, is_token_in_rank, topk_idx,
                                         num_tokens_per_expert, num_experts)

    num_topk = topk_idx.size(1) if topk_idx is not None else (
        topk_weights.size(1) if topk_weights is not None else 0)
    flags = (FLAG_SCALES * (fp8 or scales is not None) + FLAG_TOPK_IDX * (topk_idx is not None)
             + FLAG_TOPK_WEIGHTS * (topk_weights is not None) + FLAG_CACHED * (handle is not None))
    return DispatchSpec(values=values, scales=scales, num_tokens=num_tokens, hidden=hidden, num_experts=num_experts,
                        num_topk=num_topk, flags=flags, num_worst_tokens=num_worst_tokens, host_layout=host_layout)

def layout_on_host(num_ranks: int, num_tokens_per_rank, is_token_in_rank, topk_idx, num_tokens_per_expert,
                   num_experts: int) -> dict:
    """Check the values of an uncached dispatch's layout tensors; return the counts as Python lists. One copy
    to the host (one synchronization) for all of them."""
    with_topk = topk_idx is not None and topk_idx.numel() > 0
    # the layout must be topk_idx's (ids out of range, rejected below, are left out of it)
    summary = (check_dispatch_layout(topk_idx, num_experts, is_token_in_rank) if with_topk
               else is_token_in_rank.sum(0))
    values = torch.cat([num_tokens_per_rank, num_tokens_per_expert, summary]).tolist()  # (int64: promoted)
    per_rank, per_expert = values[:num_ranks], values[num_ranks:num_ranks + num_experts]
    in_rank = values[num_ranks + num_experts:2 * num_ranks + num_experts]
    if per_rank != in_rank:
        raise reject("num_tokens_per_rank", "does not match is_token_in_rank.sum(0)")
    num_tokens = is_token_in_rank.size(0)
    if topk_idx is not None and not with_topk and any(per_expert):
        raise reject("num_tokens_per_expert", "must be all 0: topk_idx chooses no expert (it is empty)")
    if any(not 0 <= count <= num_tokens for count in per_expert):
        raise reject("num_tokens_per_expert", f"expected counts in [0, {num_tokens}] (the tokens), got "
                                              f"{min(per_expert)} to {max(per_expert)}")
    if with_topk:
        implied_per_expert = values[2 * num_ranks + num_experts:2 * num_ranks + 2 * num_experts]
        outside, differ = values[-2:]
        if outside:  # (only now the exact range, for the message)
            check_expert_range(*torch.stack(torch.aminmax(topk_idx)).tolist(), num_experts)
        if differ:
            raise reject("is_token_in_rank", f"does not match topk_idx in {differ} entries (a token goes to "
                                             f"the ranks of its experts: get_dispatch_layout(topk_idx, ...))")
        if implied_per_expert != per_expert:
            raise reject("num_tokens_per_expert", "does not match topk_idx (the tokens that chose each expert: "
                                                  "get_dispatch_layout(topk_idx, ...))")
    return dict(num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert)

def check_combine(where: "Where", x, handle, topk_weights, bias, previous_event, internal: bool) \
        -> Tuple[torch.Tensor, ...]:
    """Raise `EPArgumentError` for the first invalid argument of a combine; return its bias tensors."""
    check_handle(handle, where.buffer_id)
    rows = handle.num_recv_rows
    if x is None and internal:
        hidden = None
    else:
        check_tensor("x", x, where.device, FLOAT_DTYPES, (rows, None))
        hidden = x.size(1)
        if hidden < 1:
            raise reject("x", f"expected a hidden size >= 1, got shape {tuple(x.shape)}")
        if where.num_nvl_bytes > 0:
            num_topk = topk_weights.size(1) if isinstance(topk_weights, torch.Tensor) else 0
            need = combine_bytes(handle.num_tokens, hidden, where.num_ranks, num_topk, x.dtype)
            if need > where.num_nvl_bytes:
                raise reject("num_nvl_bytes", f"combining {handle.num_tokens} tokens of hidden {hidden} needs "
                                              f"{need} bytes (get_buffer_size_hint) but the buffer has "
                                              f"{where.num_nvl_bytes}")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, where.device, (torch.float32,), (rows, None))
    if bias is not None and not isinstance(bias, (torch.Tensor, tuple, list)):
        raise reject("bias", f"expected None, a tensor, or a tuple of two tensors, got {type(bias).__name__}")
    biases = bias_tuple(bias)
    if len(biases) > 2 or (biases and x is None):
        raise reject("bias", "expected None, a tensor, or a tuple of two tensors")
    for b in biases:
        check_tensor("bias", b, where.device, (x.dtype,), (handle.num_tokens, hidden))
    check_event(previous_event)
    return biases


def constructor(num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_sms, backend, timeout_s,
                ranks_per_node=None) -> Tuple[int, int, Optional[int]]:
    """`Buffer`'s own arguments (before its first header exchange): ``(num_nvl_bytes, num_rdma_bytes, num_sms)`` as
    ints."""
    problem = timeout_problem(timeout_s)
    if problem:
        raise reject("timeout_s", problem)
    num_rdma_bytes = plain_int(num_rdma_bytes)
    if isinstance(num_rdma_bytes, bool) or not isinstance(num_rdma_bytes, int) or num_rdma_bytes < 0:
        raise reject("num_rdma_bytes", f"expected an int >= 0, got {num_rdma_bytes!r} (the third positional "
                                       f"argument, as in DeepEP; num_sms and smsplit's other arguments are "
                                       f"keyword-only)")
    if ranks_per_node is not None:
        check_int("ranks_per_node", plain_int(ranks_per_node), 1)
    if low_latency_mode:
        raise reject("low_latency_mode", "must be False: only DeepEP's normal (high-throughput) kernels exist here")
    check_backend(backend)
    num_nvl_bytes = plain_int(num_nvl_bytes)
    check_int("num_nvl_bytes", num_nvl_bytes, 0)
    return num_nvl_bytes, num_rdma_bytes, (sms_count("num_sms", num_sms) if num_sms is not None else None)


def layout_arguments(topk_idx, num_experts, previous_event, num_ranks: int, device: torch.device) -> int:
    """`get_dispatch_layout`'s arguments but the ids' values; returns ``num_experts`` as an int."""
    num_experts = plain_int(num_experts)
    check_int("num_experts", num_experts, 1)
    check_event(previous_event)
    if num_experts % num_ranks:
        raise reject("num_experts", f"{num_experts} experts do not divide evenly over {num_ranks} ranks")
    check_topk_idx_form(topk_idx, None, device)
    return num_experts


def size_hint_arguments(num_max_tokens_per_rank, hidden, num_ranks, num_topk, backend) -> None:
    """`Buffer.get_buffer_size_hint`'s arguments."""
    check_backend(backend)
    for name, value, minimum in (("num_max_tokens_per_rank", num_max_tokens_per_rank, 0), ("hidden", hidden, 1),
                                 ("num_ranks", num_ranks, 1), ("num_topk", num_topk, 0)):
        check_int(name, value, minimum)
