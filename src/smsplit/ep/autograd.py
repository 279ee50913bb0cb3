"""Autograd for dispatch and combine: each one's backward is the other one applied to the gradients.

Dispatch copies a token to every rank that holds one of its experts, so the gradient of the token is the sum of
the gradients of its copies: a combine. Combine sums the copies, so each copy's gradient is the gradient of the
sum: a cached dispatch. The same holds for the top-k weights; a received weight is zeroed where the expert is on
another rank, so its gradient is zeroed there before the combine. With FP8 on the wire and `dequantize=True`, the
quantization is treated as the identity in backward (straight-through).

Backward passes communicate, so every rank must run them, in the same order as the other ranks.

This module knows nothing of `Buffer` (which imports it): a buffer hands it an `Untracked`, its calls without
autograd.
"""

from typing import Callable, NamedTuple, Optional

import torch
from torch.autograd.function import once_differentiable


class Untracked(NamedTuple):
    """
    What autograd needs of a buffer: its collective calls without autograd (the internal contract between `Buffer`,
    which builds one per call, and this module). Every rank must make these calls in the same order.

    Attributes:
        device: the device of the buffer's tensors (gradients of absent outputs are zeros there).
        dispatch: ``dispatch(x, handle=, num_tokens_per_rank=, num_tokens_per_rdma_rank=, is_token_in_rank=,
            num_tokens_per_expert=, topk_idx=, topk_weights=, expert_alignment=, num_worst_tokens=, previous_event=,
            async_finish=, fp8=, dequantize=, internal=False, config=None)``: `Buffer.dispatch`'s six results;
            ``internal=True`` lets a cached dispatch carry `topk_weights` and `x` be None (a backward's).
        combine: ``combine(x, handle, topk_weights, bias, previous_event, async_finish, internal=False,
            config=None)``: `Buffer.combine`'s three results; ``internal=True`` lets `x` be None.
        finish_event: ``finish_event(async_finish)``: the `EventOverlap` a call returns.
    """

    device: torch.device
    dispatch: Callable[..., tuple]
    combine: Callable[..., tuple]
    finish_event: Callable[[bool], object]


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops: Untracked, fields: dict, box: dict, x: torch.Tensor, topk_weights: Optional[torch.Tensor]):
        result = ops.dispatch(x, topk_weights=topk_weights, **fields)
        box["result"] = result
        recv_x, recv_topk_idx, recv_topk_weights, _, handle, _ = result
        ctx.ops, ctx.handle = ops, handle
        # the mask, not recv_topk_idx itself: the caller may rewrite those ids in place before backward
        ctx.dropped = recv_topk_idx < 0 if recv_topk_idx is not None and topk_weights is not None else None
        values = x[0] if isinstance(x, tuple) else x
        ctx.x_dtype, ctx.hidden = values.dtype, values.size(1)
        out_x = recv_x[0] if isinstance(recv_x, tuple) else recv_x
        ctx.x_differentiable = out_x.dtype != torch.float8_e4m3fn
        # An output requires grad only where its own input does (autograd would mark both outputs, from either):
        # recv_x from x (never FP8 output), the weights from topk_weights.
        if not (ctx.x_differentiable and ctx.needs_input_grad[3]):
            ctx.mark_non_differentiable(out_x)
        if recv_topk_weights is None:
            return out_x, None
        if not ctx.needs_input_grad[4]:
            ctx.mark_non_differentiable(recv_topk_weights)
        return out_x, recv_topk_weights

    @staticmethod
    @once_differentiable  # the communication in backward is not recorded: a second derivative raises, not zero
    def backward(ctx, grad_recv_x, grad_recv_topk_weights):
        ops, handle = ctx.ops, ctx.handle
        need_x = ctx.needs_input_grad[3] and ctx.x_differentiable
        need_w = ctx.needs_input_grad[4]
        grad_x_in = grad_w_in = None
        if need_x:
            grad_x_in = grad_recv_x if grad_recv_x is not None else torch.zeros(
                handle.num_recv_rows, ctx.hidden, dtype=ctx.x_dtype, device=ops.device)
        if need_w:
            grad_w_in = grad_recv_topk_weights if grad_recv_topk_weights is not None else torch.zeros(
                ctx.dropped.shape, dtype=torch.float32, device=ops.device)
            grad_w_in = grad_w_in.float().masked_fill(ctx.dropped, 0.0)
        grad_x, grad_w, _ = ops.combine(grad_x_in.contiguous() if grad_x_in is not None else None, handle,
                                        grad_w_in, None, None, False, internal=True)
        if grad_x is not None:
            grad_x = grad_x.to(ctx.x_dtype)
        return None, None, None, grad_x, grad_w


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops: Untracked, handle, previous_event, config, x, topk_weights, bias_0, bias_1):
        bias = tuple(b for b in (bias_0, bias_1) if b is not None) or None
        combined_x, combined_topk_weights, event = ops.combine(x, handle, topk_weights, bias, previous_event, False,
                                                               config=config)
        ctx.ops, ctx.handle = ops, handle
        ctx.x_dtype, ctx.hidden = x.dtype, x.size(1)
        ctx.num_topk = topk_weights.size(1) if topk_weights is not None else 0
        ctx.event = event
        # as in _Dispatch: combined_x from x and the biases, the weights from topk_weights only
        if not any(ctx.needs_input_grad[i] for i in (4, 6, 7)):
            ctx.mark_non_differentiable(combined_x)
        if combined_topk_weights is not None and not ctx.needs_input_grad[5]:
            ctx.mark_non_differentiable(combined_topk_weights)
        return combined_x, combined_topk_weights

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_combined_x, grad_combined_topk_weights):
        ops, handle = ctx.ops, ctx.handle
        need_x, need_w = ctx.needs_input_grad[4], ctx.needs_input_grad[5]
        if grad_combined_x is None:
            grad_combined_x = torch.zeros(handle.num_tokens, ctx.hidden, dtype=ctx.x_dtype, device=ops.device)
        grad_x_in = grad_combined_x.to(ctx.x_dtype).contiguous() if need_x else None
        grad_w_in = None
        if need_w:
            grad_w_in = grad_combined_topk_weights if grad_combined_topk_weights is not None else torch.zeros(
                handle.num_tokens, ctx.num_topk, dtype=torch.float32, device=ops.device)
            grad_w_in = grad_w_in.float().contiguous()
        grad_x = grad_w = None
        if need_x or need_w:
            grad_x, _, grad_w, _, _, _ = ops.dispatch(
                grad_x_in, handle=handle, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=grad_w_in,
                expert_alignment=1, num_worst_tokens=0, previous_event=None, async_finish=False, fp8=False,
                dequantize=False, internal=True)
        grad_bias_0 = grad_combined_x if ctx.needs_input_grad[6] else None
        grad_bias_1 = grad_combined_x if ctx.needs_input_grad[7] else None
        return None, None, None, None, grad_x, grad_w, grad_bias_0, grad_bias_1


def dispatch_is_tracked(x, topk_weights, fp8: bool, dequantize: bool) -> bool:
    """Whether autograd records a dispatch (`dispatch_with_grad`): grad mode is on and a floating-point `x` (whose
    output is not FP8: ``fp8`` without ``dequantize``) or `topk_weights` requires grad."""
    float_x = isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float8_e4m3fn
    grad_x = float_x and x.requires_grad and not (fp8 and not dequantize)
    grad_w = isinstance(topk_weights, torch.Tensor) and topk_weights.requires_grad
    return torch.is_grad_enabled() and (grad_x or grad_w)


def combine_is_tracked(x, topk_weights, bias, biases: tuple) -> bool:
    """Whether autograd records a combine (`combine_with_grad`): grad mode is on and `x`, `topk_weights` or one of
    ``biases`` (what `bias` holds) requires grad. A `bias` the argument checks reject (on every rank) is left
    untracked, to be rejected there."""
    needs_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in (x, topk_weights, *biases))
    trackable = len(biases) <= 2 and (bias is None or isinstance(bias, (torch.Tensor, tuple, list)))
    return torch.is_grad_enabled() and needs_grad and trackable


def dispatch_with_grad(ops: Untracked, x, topk_weights, fields: dict):
    """`Buffer.dispatch` recorded by autograd (called by `Buffer.dispatch` when `x` or `topk_weights` needs grad;
    ``fields``: the dispatch's other keyword arguments)."""
    box = {}
    out_x, out_w = _Dispatch.apply(ops, fields, box, x, topk_weights)
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = box["result"]
    recv_x = (out_x, recv_x[1]) if isinstance(recv_x, tuple) else out_x
    return recv_x, recv_topk_idx, out_w, counts, handle, event


def combine_with_grad(ops: Untracked, x, handle, topk_weights, biases: tuple, previous_event, async_finish,
                      config=None):
    """`Buffer.combine` recorded by autograd (called by `Buffer.combine` when an input needs grad); ``biases``: the
    bias tensors, at most two."""
    bias_0, bias_1 = (tuple(biases) + (None, None))[:2]
    combined_x, combined_topk_weights = _Combine.apply(ops, handle, previous_event, config, x, topk_weights,
                                                       bias_0, bias_1)
    return combined_x, combined_topk_weights, ops.finish_event(async_finish)
