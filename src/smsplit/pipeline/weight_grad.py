"""Deferred weight gradients (the B/W split of zero-bubble pipelines)."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F


class WeightGradStore:
    """Process-wide queue of deferred weight-gradient computations.

    While `enabled` is True, layers that support it (such as `Linear`) compute only input
    gradients in backward and `put` a closure that computes and accumulates their weight
    gradients. The pipeline schedule calls `flush` after such a backward, which makes the closures
    of that backward one queue entry, and `pop` in a later "W" op, which runs the oldest entry
    under torch.no_grad() (closures called some other way should do the same).

    As in DeepSeek's DualPipe, `funcs_queue` is a `queue.Queue` of those entries (code written for it calls
    `.empty()`, `.get()` and `.put()` on it), `cache` the list of the current backward's closures.
    """

    enabled: ClassVar[bool] = False
    cache: ClassVar[list[Callable[[], None]]] = []
    funcs_queue: ClassVar[queue.Queue] = queue.Queue()

    @classmethod
    def put(cls, fn: Callable[[], None]) -> None:
        """Add a closure that computes and accumulates weight gradients to the current backward's entry."""
        cls.cache.append(fn)

    @classmethod
    def flush(cls) -> None:
        """End the current backward's entry: its closures become one queue entry, for a later `pop`."""
        cls.funcs_queue.put(cls.cache)
        cls.cache = []

    @classmethod
    def pop(cls) -> None:
        """Run the oldest entry's closures, without building autograd graphs."""
        if cls.funcs_queue.empty():
            raise RuntimeError("WeightGradStore.pop: no deferred weight gradients are queued")
        funcs = cls.funcs_queue.get_nowait()
        with torch.no_grad():
            for fn in funcs:
                fn()

    @classmethod
    def clear(cls) -> None:
        """Drop every queued and cached closure and disable the store (each pipeline step starts and ends
        with this: closures left from outside a step would be dropped)."""
        cls.enabled = False
        cls.cache = []
        cls.funcs_queue = queue.Queue()


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):  # compute as nn.Linear does under autocast, in its dtype
            dtype = torch.get_autocast_dtype(device_type)
            x, weight_c = x.to(dtype), weight.to(dtype)
            bias_c = bias.to(dtype) if bias is not None else None
        else:
            weight_c, bias_c = weight, bias
        ctx.save_for_backward(x, weight_c)
        ctx.params = (weight, bias)
        with torch.autocast(device_type, enabled=False):
            return F.linear(x, weight_c, bias_c)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors  # (in the autocast dtype when the forward ran under autocast)
        param_w, param_b = ctx.params
        grad_out = grad_out.to(weight.dtype)
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        need_w, need_b = ctx.needs_input_grad[1], param_b is not None and ctx.needs_input_grad[2]

        def weight_grads():
            g = grad_out.reshape(-1, grad_out.shape[-1])
            gw = (g.t() @ x.reshape(-1, x.shape[-1])).to(param_w.dtype) if need_w else None
            gb = g.sum(0).to(param_b.dtype) if need_b else None
            return gw, gb

        if WeightGradStore.enabled and (need_w or need_b):
            def deferred():
                with torch.no_grad():  # W runs outside autograd's backward: build no graph
                    gw, gb = weight_grads()
                if gw is not None:
                    _accumulate(param_w, gw)
                if gb is not None:
                    _accumulate(param_b, gb)

            WeightGradStore.put(deferred)
            return grad_x, None, None
        gw, gb = weight_grads()
        return grad_x, gw, gb


class Linear(torch.nn.Linear):
    """`torch.nn.Linear` whose weight gradient can be deferred to a pipeline "W" op.

    Outside a split backward (or outside a pipeline) it behaves like `torch.nn.Linear`, and its
    gradients equal `torch.nn.Linear`'s, under autocast too (computed in the autocast dtype, the weight
    gradient accumulated in the parameter's dtype). Inside a backward that the schedule runs with
    `WeightGradStore.enabled`, backward returns only dX and queues dW (and db) for later.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFunction.apply(x, self.weight, self.bias)
