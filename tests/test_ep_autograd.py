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

import oracles
from smsplit.ep import Buffer
from ep_harness import gloo_pool


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


def received_rows(topks, num_experts, world_size):
    """Plain torch, no library: for each rank q, the `(source rank, token)` of every row it receives, in the order of
    the reference transport (by source rank, then token), and which of each row's top-k entries q holds."""
    local = num_experts // world_size
    rows = [[] for _ in range(world_size)]
    held = [[] for _ in range(world_size)]
    for r, topk in enumerate(topks):
        owner = torch.where(topk >= 0, topk.div(local, rounding_mode="floor"), -1)
        for t in range(topk.size(0)):
            for q in range(world_size):
                if (owner[t] == q).any():
                    rows[q].append((r, t))
                    held[q].append(owner[t] == q)
    return rows, held


def summed_row_grads(rank, num_tokens, hidden, num_topk, rows, held, grads_x, grads_w):
    """The gradients of this rank's tokens and weights as the sums, over the ranks each token went to, of the
    gradients of its rows there (`grads_x[q]`, `grads_w[q]`: rank q's, padding rows included); a weight only from
    the rank holding its expert. Padding rows and entries of other ranks' experts are read by nobody."""
    grad_x = torch.zeros(num_tokens, hidden) if grads_x[0] is not None else None
    grad_w = torch.zeros(num_tokens, num_topk) if grads_w[0] is not None else None
    for q in range(len(rows)):
        for i, (r, t) in enumerate(rows[q]):
            if r != rank:
                continue
            if grad_x is not None:
                grad_x[t] += grads_x[q][i].float()
            if grad_w is not None:
                grad_w[t] += torch.where(held[q][i], grads_w[q][i], 0.0)
    return grad_x, grad_w


def case_gradients(rank, world_size, seed, num_tokens, hidden, num_experts, num_topk, dtype_name, grad_of, mode,
                   num_worst_tokens, sized_buffer=False):
    """`sized_buffer`: a buffer of exactly `get_buffer_size_hint` for this call (FP8 on the wire with `fp8=True`).

    Besides the dense model's loss, the padding rows (past the received tokens, with `num_worst_tokens`) get random
    upstream gradients, and so do the received weights this rank does not hold (experts of other ranks, -1
    entries, padding rows); the combine's padding rows are NaN. None of it may reach a gradient: `x` and
    `topk_weights` get the dense model's gradients, and also the sums of the gradients of their received rows,
    gathered from every rank and added up here without the library."""
    dtype = getattr(torch, dtype_name)
    num_nvl_bytes = Buffer.get_buffer_size_hint(max(num_tokens), hidden, world_size, num_topk, dtype,
                                                fp8=mode.startswith("fp8"), combine_dtype=dtype) if sized_buffer else 0
    buffer = Buffer(dist.group.WORLD, num_nvl_bytes=num_nvl_bytes, timeout_s=10)
    coef, ranks = make_problem(seed, world_size, num_tokens, hidden, num_experts, num_topk, dtype)
    x, topk, w, bias, grad_out, grad_out_w = ranks[rank]
    x_leaf = x.clone().requires_grad_("x" in grad_of)
    w_leaf = w.clone().requires_grad_("w" in grad_of)
    bias_leaf = bias.clone().requires_grad_("bias" in grad_of)
    rows, held = received_rows([r[1] for r in ranks], num_experts, world_size)
    num_recv = len(rows[rank])
    held_here = torch.zeros(max(num_worst_tokens, num_recv), num_topk, dtype=torch.bool)
    if num_recv:
        held_here[:num_recv] = torch.stack(held[rank])
    padding = torch.arange(held_here.size(0)) >= num_recv

    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
    recv_x, recv_topk_idx, recv_w, _, handle, _ = buffer.dispatch(
        oracles.quantize_1x128(x) if mode == "fp8_input" else x_leaf,
        num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk, topk_weights=w_leaf,
        num_worst_tokens=num_worst_tokens, fp8=(mode == "fp8_dequantize"), dequantize=(mode == "fp8_dequantize"))
    if mode == "fp8_input":
        assert not recv_x[0].requires_grad
        recv_x = oracles.dequantize_1x128(*recv_x, dtype)
    if mode.startswith("fp8") and num_recv:  # the received rows: each source's x through the FP8 oracle
        sent = torch.stack([ranks[r][0][t] for r, t in rows[rank]])
        assert torch.equal(recv_x[:num_recv].detach(), oracles.fake_quantize_1x128(sent, dtype))
    assert torch.equal(recv_topk_idx >= 0, held_here), "the layout of the test's reference is not the dispatch's"
    for t in (recv_x, recv_w):
        if t.requires_grad:
            t.retain_grad()
    local = num_experts // world_size
    local_coef = coef[rank * local:(rank + 1) * local]
    scale = (recv_w * torch.where(recv_topk_idx >= 0, local_coef[recv_topk_idx.clamp(min=0)], 0.0)).sum(1, True)
    # the rows combine ignores: poisoned
    expert_out = torch.where(padding[:, None], float("nan"), (recv_x.float() * scale).to(dtype))
    weights_out = torch.where(padding[:, None], float("nan"), recv_w * 2)
    for t in (expert_out, weights_out):
        if t.requires_grad:
            t.retain_grad()
    combined, combined_w, _ = buffer.combine(expert_out, handle, topk_weights=weights_out, bias=bias_leaf)
    loss = (combined.float() * grad_out).sum() + (combined_w * grad_out_w).sum()
    # upstream gradients no token may see: on the padding rows of recv_x, on the weights this rank does not hold
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    noise = loss.new_zeros(())
    if recv_x.requires_grad:
        noise = noise + (recv_x.float() * torch.randn(recv_x.shape, generator=g) * padding[:, None]).sum()
    if recv_w.requires_grad:
        noise = noise + (recv_w * torch.randn(recv_w.shape, generator=g) * ~held_here).sum()
    (loss + noise).backward()
    for t in (expert_out, weights_out):  # combine's backward: nothing for the padding rows
        if t.requires_grad:
            assert torch.equal(t.grad[padding], torch.zeros_like(t.grad[padding])), t.grad[padding]

    x_forward = oracles.fake_quantize_1x128(x, dtype) if mode.startswith("fp8") else None
    ref_x, ref_w, ref_bias = dense_grads(coef, x, topk, w, bias, grad_out, grad_out_w, x_forward)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (recv_x.grad if recv_x.requires_grad else None,
                                      recv_w.grad if recv_w.requires_grad else None))
    sum_x, sum_w = summed_row_grads(rank, num_tokens[rank], hidden, num_topk, rows, held,
                                    [gx for gx, _ in gathered], [gw for _, gw in gathered])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    if "x" in grad_of:
        assert x_leaf.grad is not None and x_leaf.grad.dtype == dtype
        torch.testing.assert_close(x_leaf.grad.float(), ref_x, **tol)
        torch.testing.assert_close(x_leaf.grad, sum_x.to(dtype), rtol=1e-5, atol=1e-5)
    else:
        assert x_leaf.grad is None
    if "w" in grad_of:
        # a weight's gradient adds up `hidden` products of the combine's gradient, rounded to x's dtype in backward:
        # against the dense model (fp32 throughout), a tolerance of the gradients' size; against the rows, exact-ish
        w_tol = tol if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2 * max(1.0, float(ref_w.abs().max())))
        torch.testing.assert_close(w_leaf.grad, ref_w, **w_tol)
        torch.testing.assert_close(w_leaf.grad, sum_w, rtol=1e-5, atol=1e-5)
        dropped = w_leaf.grad[topk < 0]
        assert torch.equal(dropped, torch.zeros_like(dropped)), dropped
    else:
        assert w_leaf.grad is None
    if "bias" in grad_of:
        torch.testing.assert_close(bias_leaf.grad.float(), ref_bias, **tol)
    return float(loss.detach())


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
    # padded: noise on the padding rows' gradients, NaN in the combine's padding rows
    (2, [5, 3], 2048, 8, 3, "float32", ("x", "w", "bias"), "plain", 12),
    (4, [4, 4, 4, 4], 2048, 16, 4, "bfloat16", ("x", "w", "bias"), "plain", 20),
    (2, [3, 5], 2048, 8, 2, "float32", ("x", "w"), "fp8_dequantize", 9),
    (2, [3, 4], 2048, 8, 3, "float32", ("w", "bias"), "fp8_input", 8),
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


def case_outputs_require_grad_only_from_their_inputs(rank, world_size, grad_of):
    """An output of a recorded dispatch or combine requires grad only where the input it comes from does:
    `recv_x` / `combined_x` from `x` (and `bias`), `recv_topk_weights` / `combined_topk_weights` from
    `topk_weights`. The other output is no node of the graph, and the backward still gives the inputs that do
    require grad their gradients."""
    num_experts = 4 * world_size
    buffer = Buffer(dist.group.WORLD, timeout_s=10)
    g = torch.Generator().manual_seed(700 + rank)
    topk = torch.rand(5, num_experts, generator=g).argsort(dim=1)[:, :3]
    x = torch.randn(5, 128, generator=g).requires_grad_("x" in grad_of)
    w = torch.rand(5, 3, generator=g).requires_grad_("w" in grad_of)
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk, topk_weights=w)
    assert recv_x.requires_grad == ("x" in grad_of), ("recv_x", recv_x.requires_grad)
    assert recv_w.requires_grad == ("w" in grad_of), ("recv_topk_weights", recv_w.requires_grad)
    # the combine on its own: inputs that are leaves, so only what the test asks for requires grad there
    y = recv_x.detach().requires_grad_("x" in grad_of)
    v = recv_w.detach().requires_grad_("w" in grad_of)
    combined_x, combined_w, _ = buffer.combine(y, handle, topk_weights=v)
    assert combined_x.requires_grad == ("x" in grad_of), ("combined_x", combined_x.requires_grad)
    assert combined_w.requires_grad == ("w" in grad_of), ("combined_topk_weights", combined_w.requires_grad)
    # a bias that requires grad makes combined_x require grad whatever x does
    bias = torch.zeros(5, 128, requires_grad=True)
    combined_b, combined_bw, _ = buffer.combine(y, handle, topk_weights=v, bias=bias)
    assert combined_b.requires_grad and combined_bw.requires_grad == ("w" in grad_of)
    # backward through both, in the same order on every rank
    loss = sum(t.float().sum() for t in (recv_x, recv_w, combined_x, combined_w, combined_b) if t.requires_grad)
    loss.backward()
    assert (x.grad is not None) == ("x" in grad_of) and (w.grad is not None) == ("w" in grad_of)
    assert (y.grad is not None) == ("x" in grad_of) and (v.grad is not None) == ("w" in grad_of)
    assert bias.grad is not None
    return True


@pytest.mark.parametrize("grad_of", [("x",), ("w",), ("x", "w")], ids="+".join)
@pytest.mark.parametrize("world_size", [2, 4])
def test_outputs_require_grad_only_from_their_inputs(world_size, grad_of):
    assert gloo_pool(world_size).run(case_outputs_require_grad_only_from_their_inputs, grad_of) == [True] * world_size
