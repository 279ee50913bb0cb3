"""Gradients through dispatch -> experts -> combine on 2 and 4 gloo ranks, against a dense single-process model.

The model: token t of rank r goes to its top-k experts; expert e multiplies it by a scalar c[e] and by the token's
weight for e; combine adds the expert outputs back (plus a bias), and also adds up 2 * the weights. Densely, with
no communication at all:
    combined[t] = x[t] * sum_k w[t, k] * c[topk[t, k]] + bias[t]        combined_w[t, k] = 2 * w[t, k] (k chosen)
"""

import math

import pytest
import torch
import torch.distributed as dist

from smsplit import fp8 as fp8_lib
from smsplit.ep import Buffer
from smsplit.ep.testing import gloo_pool


def make_problem(seed, world_size, num_tokens, hidden, num_experts, num_topk, dtype):
    g = torch.Generator().manual_seed(seed)
    coef = torch.randn(num_experts, generator=g)
    ranks = []
    for r in range(world_size):
        n = num_tokens[r]
        x = torch.randn(n, hidden, generator=g).to(dtype)
        topk = torch.rand(n, num_experts, generator=g).argsort(dim=1)[:, :num_topk]
        topk[torch.rand(n, num_topk, generator=g) < 0.25] = -1
        w = torch.rand(n, num_topk, generator=g)
        bias = torch.randn(n, hidden, generator=g).to(dtype)
        grad_out = torch.randn(n, hidden, generator=g)
        grad_out_w = torch.randn(n, num_topk, generator=g)
        ranks.append((x, topk, w, bias, grad_out, grad_out_w))
    return coef, ranks


def dense_grads(coef, x, topk, w, bias, grad_out, grad_out_w, x_forward=None):
    """Gradients of the dense model in fp32; `x_forward` replaces x's value in the forward (straight-through)."""
    x = x.float().clone().requires_grad_()
    w = w.clone().requires_grad_()
    bias = bias.float().clone().requires_grad_()
    chosen = topk >= 0
    scale = (w * torch.where(chosen, coef[topk.clamp(min=0)], 0.0)).sum(dim=1, keepdim=True)
    x_value = x if x_forward is None else x + (x_forward.float() - x).detach()
    combined = x_value * scale + bias
    combined_w = 2 * w * chosen
    ((combined * grad_out).sum() + (combined_w * grad_out_w).sum()).backward()
    return x.grad, w.grad, bias.grad


def case_gradients(rank, world_size, seed, num_tokens, hidden, num_experts, num_topk, dtype_name, grad_of, mode,
                   num_worst_tokens, sized_buffer=False):
    """`sized_buffer`: a buffer of exactly `get_buffer_size_hint` for this call (FP8 on the wire with `fp8=True`)."""
    dtype = getattr(torch, dtype_name)
    num_nvl_bytes = Buffer.get_buffer_size_hint(max(num_tokens), hidden, world_size, num_topk, dtype,
                                                fp8=mode.startswith("fp8"), combine_dtype=dtype) if sized_buffer else 0
    buffer = Buffer(dist.group.WORLD, num_nvl_bytes=num_nvl_bytes, timeout_s=10)
    coef, ranks = make_problem(seed, world_size, num_tokens, hidden, num_experts, num_topk, dtype)
    x, topk, w, bias, grad_out, grad_out_w = ranks[rank]
    x_leaf = x.clone().requires_grad_("x" in grad_of)
    w_leaf = w.clone().requires_grad_("w" in grad_of)
    bias_leaf = bias.clone().requires_grad_("bias" in grad_of)

    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
    recv_x, recv_topk_idx, recv_w, _, handle, _ = buffer.dispatch(
        fp8_lib.quantize_1x128(x) if mode == "fp8_input" else x_leaf,
        num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk, topk_weights=w_leaf,
        num_worst_tokens=num_worst_tokens, fp8=(mode == "fp8_dequantize"), dequantize=(mode == "fp8_dequantize"))
    if mode == "fp8_input":
        assert not recv_x[0].requires_grad
        recv_x = fp8_lib.dequantize_1x128(*recv_x, dtype)
    local = num_experts // world_size
    local_coef = coef[rank * local:(rank + 1) * local]
    scale = (recv_w * torch.where(recv_topk_idx >= 0, local_coef[recv_topk_idx.clamp(min=0)], 0.0)).sum(1, True)
    expert_out = (recv_x.float() * scale).to(dtype)
    combined, combined_w, _ = buffer.combine(expert_out, handle, topk_weights=recv_w * 2, bias=bias_leaf)
    loss = (combined.float() * grad_out).sum() + (combined_w * grad_out_w).sum()
    loss.backward()

    x_forward = fp8_lib.dequantize_1x128(*fp8_lib.quantize_1x128(x), dtype) if mode.startswith("fp8") else None
    ref_x, ref_w, ref_bias = dense_grads(coef, x, topk, w, bias, grad_out, grad_out_w, x_forward)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    if "x" in grad_of:
        assert x_leaf.grad is not None and x_leaf.grad.dtype == dtype
        torch.testing.assert_close(x_leaf.grad.float(), ref_x, **tol)
    if "w" in grad_of:
        torch.testing.assert_close(w_leaf.grad, ref_w, **tol)
    if "bias" in grad_of:
        torch.testing.assert_close(bias_leaf.grad.float(), ref_bias, **tol)
    return float(loss)


GRAD_CASES = [
    # world, tokens per rank, hidden, experts, topk, dtype, grads wanted, mode, num_worst_tokens
    (2, [5, 3], 2048, 8, 3, "float32", ("x", "w", "bias"), "plain", 0),
    (2, [4, 0], 2048, 8, 8, "float32", ("x", "w"), "plain", 0),
    (2, [3, 4], 4096, 8, 2, "float32", ("w",), "plain", 10),
    (2, [4, 4], 2048, 16, 4, "bfloat16", ("x", "w", "bias"), "plain", 0),
    (2, [3, 5], 2048, 8, 2, "float32", ("x", "w"), "fp8_dequantize", 0),
    (4, [3, 2, 4, 1], 2048, 36, 9, "float32", ("x", "w", "bias"), "plain", 0),
    (4, [2, 3, 0, 2], 7168, 16, 1, "float32", ("x",), "plain", 8),
    (4, [2, 2, 2, 2], 2048, 16, 4, "float32", ("x", "w"), "fp8_dequantize", 0),
    (2, [3, 4], 2048, 8, 3, "float32", ("w", "bias"), "fp8_input", 0),  # FP8 x: only the weights get grads
]


@pytest.mark.parametrize("case", GRAD_CASES,
                         ids=lambda c: f"ep{c[0]}-h{c[2]}-k{c[4]}-{c[5]}-{'+'.join(c[6])}-{c[7]}-w{c[8]}")
def test_gradients_match_dense_model(case):
    world_size, *params = case
    losses = gloo_pool(world_size).run(case_gradients, 500 + GRAD_CASES.index(case), *params)
    assert all(math.isfinite(loss) for loss in losses)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradients_of_an_fp8_dispatch_fit_a_buffer_sized_for_it(world_size):
    """DeepSeek-V3's layout: FP8 dispatch, BF16 combine with top-k weights, through a buffer sized by
    `get_buffer_size_hint(..., fp8=True)`. The combine and its backward (a dispatch of BF16 gradients and weights)
    move combine rows; they were checked as BF16 dispatch rows with top-k ids, which that buffer does not hold."""
    num_tokens = [5, 3, 4, 2][:world_size]
    losses = gloo_pool(world_size).run(case_gradients, 600 + world_size, num_tokens, 256, 4 * world_size, 8,
                                       "bfloat16", ("x", "w"), "fp8_dequantize", 0, True)
    assert all(math.isfinite(loss) for loss in losses)


def case_second_derivative(rank, world_size, through):
    """A gradient penalty through dispatch and combine. Their backward passes communicate outside autograd, so the
    first gradient is a constant to it: the penalty's term must raise, not silently add nothing."""
    buffer = Buffer(dist.group.WORLD, timeout_s=10)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 128, generator=g, requires_grad=True)
    topk = torch.rand(4, 4 * world_size, generator=g).argsort(dim=1)[:, :2]
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(
        topk, 4 * world_size)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=num_tokens_per_rank,
                                                 is_token_in_rank=is_token_in_rank,
                                                 num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk)
    if through == "dispatch":  # d/dx of combine(recv_x ** 2) = combine(2 * recv_x * dispatch(1)): x's again
        combined, _, _ = buffer.combine(recv_x ** 2, handle)
        inner = x
    else:  # d/dy of combine(y) ** 2 = dispatch(2 * combined): y's again
        y = recv_x.detach().requires_grad_()
        combined, _, _ = buffer.combine(y, handle)
        combined = combined ** 2
        inner = y
    (grad,) = torch.autograd.grad(combined.sum(), inner, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        ((grad ** 2).sum() + inner.sum()).backward()
    return True


@pytest.mark.parametrize("through", ["dispatch", "combine"])
def test_second_derivatives_raise(through):
    assert gloo_pool(2).run(case_second_derivative, through) == [True, True]


def case_topk_idx_rewritten_in_place(rank, world_size):
    """The weights' backward masks what the dispatch zeroed, whatever the caller does to `recv_topk_idx` after it
    (here: -1 entries rewritten to expert 0, as code that gathers with the ids might); it read the ids at backward,
    so each weight got the gradient of every rank it reached."""
    num_experts = 4 * world_size
    buffer = Buffer(dist.group.WORLD, timeout_s=10)
    g = torch.Generator().manual_seed(rank)
    topk = torch.rand(6, num_experts, generator=g).argsort(dim=1)[:, :3]
    topk[torch.rand(6, 3, generator=g) < 0.3] = -1
    w = torch.rand(6, 3, generator=g, requires_grad=True)
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
    _, recv_topk_idx, recv_w, _, _, _ = buffer.dispatch(
        torch.randn(6, 128, generator=g), num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk, topk_weights=w)
    recv_topk_idx.clamp_(min=0)
    (recv_w * 3).sum().backward()
    assert torch.equal(w.grad, torch.where(topk >= 0, 3.0, 0.0)), (w.grad, topk)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_weight_gradients_do_not_read_recv_topk_idx_at_backward(world_size):
    assert gloo_pool(world_size).run(case_topk_idx_rewritten_in_place) == [True] * world_size
