"""The steps of a `Buffer` call past its checks and its header exchange: what a dispatch or a combine asks of a
transport (a `Move`), the agreement on a new layout once every rank's counts are known, the handle a dispatch makes,
the transport's run of a dispatch (FP8 on either side of it), a dispatch captured into a CUDA graph, a combine's bias,
and the timeouts the device kernels recorded.

`Buffer`'s methods read as: check (`smsplit.ep.checks`) -> agree (`smsplit.ep.header`) -> handle -> transport (chosen
by `smsplit.ep.registry`); the machinery of those steps is here. Functions that need a buffer's state take the buffer
(``buf``); this module does not import `smsplit.ep.buffer`.
"""

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import fp8 as fp8_lib
from . import checks, registry
from .header import H_NUM_TOKENS, H_NUM_WORST, HEADER_WORDS
from .layout import DispatchHandle
from ..nodes import (NODE_ROW_WORDS, NodeLayout, check_launch_env_words, launch_env_words, layout_from_rows,
                     node_row)
from .rows import align_up
from .transport import EPArgumentError, EPTimeoutError, Move, Tokens, check_num_worst_tokens, on_every_rank, reject

if TYPE_CHECKING:  # (annotations only: the buffer imports this module)
    from .buffer import Buffer


def dispatch_move(spec: checks.DispatchSpec, handle: Optional[DispatchHandle], quantize: bool, sms: int,
                  argument: str, captured: bool, internal: bool, max_tokens: Optional[int] = None) -> Move:
    """What a dispatch asks of a transport (`registry.choose`); ``max_tokens``: the most tokens any rank sends
    (after the header exchange), else this rank's."""
    return Move("dispatch", spec.values.dtype if spec.values is not None else None, quantize, spec.hidden,
                spec.num_topk, spec.num_tokens if max_tokens is None else max_tokens, sms, argument,
                handle.transport if handle is not None else None, handle.hidden if handle is not None else 0,
                captured, handle.num_worst_tokens if handle is not None else spec.num_worst_tokens,
                combine_rows=internal and handle is not None)


def combine_move(x, handle: DispatchHandle, topk_weights, sms: int, argument: str, captured: bool) -> Move:
    """What a combine asks of a transport (after `checks.check_combine`: ``x`` None only in a backward pass)."""
    return Move("combine", x.dtype if x is not None else None, False, x.size(1) if x is not None else 0,
                topk_weights.size(1) if topk_weights is not None else 0, 0, sms, argument, handle.transport,
                handle.hidden, captured, handle.num_worst_tokens)


def agree_layout(buf: "Buffer", spec: checks.DispatchSpec, move: Move, headers: List[List[int]], internal: bool) \
        -> Tuple[Move, str, List[int]]:
    """A new layout's agreement, from every rank's header (row q from rank q): its `Move` for the most tokens any
    rank sends, the transport chosen for that move, and the tokens this rank receives for each of its experts (one
    more exchange). Every rank reads the same rows, so an error here is raised on every rank."""
    try:
        move = move._replace(max_tokens=max(row[H_NUM_TOKENS] for row in headers))
        check_num_worst_tokens([sum(row[HEADER_WORDS + q] for row in headers) for q in range(buf.group_size)],
                               [row[H_NUM_WORST] for row in headers])
        name = registry.choose(buf.backend, move, buf._env, internal)
    except EPArgumentError as e:
        raise on_every_rank(e)
    per_expert = torch.tensor(spec.host_layout["num_tokens_per_expert"]).view(buf.group_size, -1)
    return move, name, buf.transport.exchange_headers("dispatch", "expert counts", per_expert).sum(0).tolist()


def new_handle(buf: "Buffer", name: str, spec: checks.DispatchSpec, move: Move, is_token_in_rank,
               counts: Optional[List[List[int]]]) -> DispatchHandle:
    """The handle of a new layout that transport ``name`` is about to place (it fills ``transport_state``, the
    prefix matrix and the source indices); ``counts``: the header's tokens from each rank to each (None in a
    capture: the tokens received are then known on the device only)."""
    return DispatchHandle(
        buffer_id=id(buf), rank=buf.rank, num_ranks=buf.group_size, is_token_in_rank=is_token_in_rank,
        rank_prefix_matrix=torch.empty(0, dtype=torch.int32, device=buf.device),
        recv_src_idx=torch.empty(0, dtype=torch.int32, device=buf.device),
        num_recv_tokens=sum(row[buf.rank] for row in counts) if counts is not None else -1,
        num_worst_tokens=move.worst, num_local_experts=spec.num_experts // buf.group_size, round=buf._round,
        hidden=spec.hidden, transport=name)


def run_dispatch(transport, spec: checks.DispatchSpec, handle: DispatchHandle, move: Move, topk_idx, topk_weights,
                 fp8: bool, dequantize: bool, sms: int, counts: Optional[List[List[int]]]):
    """The data phase of a dispatch on ``transport``: ``(recv_x, recv_topk_idx, recv_topk_weights)``, FP8 quantized
    before it where the transport's kernels do not quantize, and dequantized after it with ``dequantize``."""
    values, scales = spec.values, spec.scales
    in_kernel = move.quantize and values.dtype in registry.capabilities(transport.name).quantizes
    if move.quantize and not in_kernel:
        values, scales = fp8_lib.quantize_activations(values)
    received = transport.dispatch(
        handle, Tokens(values, scales, topk_idx, topk_weights, in_kernel, handle.num_local_experts, counts),
        num_sms=sms)
    recv_x, recv_topk_weights = received.values, received.topk_weights
    if received.topk_idx is not None and recv_topk_weights is not None:
        recv_topk_weights = recv_topk_weights.masked_fill(received.topk_idx < 0, 0.0)
    if fp8 or spec.scales is not None:
        out_dtype = spec.values.dtype if spec.scales is None else torch.bfloat16
        recv_x = (fp8_lib.dequantize_1x128(recv_x, received.scales, out_dtype) if dequantize
                  else (recv_x, received.scales))
    return recv_x, received.topk_idx, recv_topk_weights


def per_expert_list(cached: bool, recv_per_expert: Optional[List[int]], expert_alignment: int,
                    num_worst_tokens: int) -> Optional[List[int]]:
    """A dispatch's ``num_recv_tokens_per_expert_list``: None in the cached mode, [] with ``num_worst_tokens``,
    else the tokens received per local expert rounded up to ``expert_alignment``."""
    if cached:
        return None
    if num_worst_tokens > 0:
        return []
    return recv_per_expert if expert_alignment == 1 else [align_up(c, expert_alignment) for c in recv_per_expert]


def dispatch_captured(buf: "Buffer", args: tuple, async_finish: bool, config):
    """`Buffer._dispatch` while the current stream is captured into a CUDA graph: no host exchange and no host read,
    so a capturable transport only, after an eager dispatch of the same hidden size (it allocates the transport's
    buffer). Shapes, dtypes and the agreement of ranks are the eager calls' to check; the values of the layout tensors
    are not checked. ``args``: `checks.check_dispatch`'s."""
    _, handle, *_, previous_event, fp8, dequantize, internal = args
    sms, argument = checks.call_sms(config, buf.num_sms, buf.budget is not None)
    spec = checks.check_dispatch(buf._where, *args, check_values=False)
    move = dispatch_move(spec, handle, fp8 and spec.scales is None, sms, argument, True, internal)
    name = registry.choose(buf.backend, move, buf._env, internal)
    checks.captured_sms(sms, buf._eager_sms)
    transport = buf._transport(name)
    if not transport.prepared(spec.hidden):
        raise reject("x", f"make one dispatch of hidden size {spec.hidden} before capturing (it allocates the "
                          f"{name} transport's buffer, which a capture cannot)")
    buf._wait_previous(previous_event)
    new = handle is None
    if new:
        handle = new_handle(buf, name, spec, move, args[4], None)
    out = run_dispatch(transport, spec, handle, move, args[6], args[7], fp8, dequantize, sms, None)
    return (*out, [] if new else None, handle, buf._finish_event(async_finish))


def with_bias(summed_x: Optional[torch.Tensor], biases: tuple, x) -> Optional[torch.Tensor]:
    """A combine's result: the transport's sum plus ``biases``, in ``x``'s dtype (None for a weights-only one)."""
    if summed_x is None:
        return None
    if biases:
        summed_x = summed_x.float()  # (a device transport's sum is rounded already: one rounding more)
        for b in biases:
            summed_x += b.float()
    return summed_x if summed_x.dtype == x.dtype else summed_x.to(x.dtype)  # (`to` costs the host time)


def kernel_failure(transports: Dict[str, object], device: torch.device, whole_stream: bool = False) -> Optional[str]:
    """The timeout a device kernel of this rank has recorded so far in any of ``transports`` (a buffer's, by name),
    if any (its status word in pinned host memory, written when the wait gives up; read without waiting for the
    kernels, see `Buffer`). With ``whole_stream``, first wait for the current stream (`Buffer.check_kernels`)."""
    if len(transports) == 1:  # the reference transport alone: no kernels
        return None
    if whole_stream:
        torch.cuda.current_stream(device).synchronize()
    for transport in transports.values():
        try:
            transport.raise_if_failed()
        except (EPTimeoutError, ValueError) as error:
            return str(error)
    return None


def agree_nodes(buf: "Buffer", ranks_per_node: Optional[int]) -> NodeLayout:
    """The node layout (`smsplit.nodes`), from every rank's facts gathered by a header exchange (bounded by
    `timeout_s`, as every wait): the same on every rank, or the same `EPArgumentError` on every rank, naming
    `ranks_per_node` for a layout that cannot work, `group` for ranks started with different values of the
    variables of `smsplit.nodes.AGREED_LAUNCH_ENV`."""
    row = torch.tensor([node_row(ranks_per_node, dist.get_global_rank(buf.group, buf.rank))
                        + launch_env_words()], dtype=torch.int64)
    rows = buf.transport.exchange_headers("init", "the node layout", row.expand(buf.group_size, -1)).tolist()
    try:
        nodes = layout_from_rows([r[:NODE_ROW_WORDS] for r in rows])
    except ValueError as e:
        raise on_every_rank(reject("ranks_per_node", f"{e}")) from None
    try:  # (variables that steer NCCL and NVSHMEM: a node started with other values would hang, not fail)
        check_launch_env_words([r[NODE_ROW_WORDS:] for r in rows])
    except ValueError as e:
        raise on_every_rank(reject("group", f"{e}")) from None
    return nodes
