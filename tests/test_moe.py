"""MoE router, grouped GEMM, MoE layer (single process and EP over 2 gloo ranks) and overlapped F&B."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ep_harness import spawn  # (torch.multiprocessing.spawn from a fork server: ep_harness.py)
from smsplit.launch import free_port
from smsplit.moe import ModelConfig, MoE, Router, build_stages, grouped_mm, group_limited_topk
from smsplit.moe.layer import init_moe_
from smsplit.moe.overlap import PieceRunner, overlapped_forward_backward, serial_forward_backward
from smsplit.pipeline.weight_grad import WeightGradStore

# --- router -------------------------------------------------------------------------------------------


def _reference_topk(scores, bias, topk, n_groups, topk_groups):
    """Per-token loops: groups ranked by the sum of their two best biased scores, experts from those."""
    out = []
    per = scores.size(1) // n_groups
    for s in (scores + bias).tolist():
        groups = sorted(range(n_groups), key=lambda g: -sum(sorted(s[g * per:(g + 1) * per])[-2:]))[:topk_groups]
        allowed = [e for g in groups for e in range(g * per, (g + 1) * per)]
        out.append(sorted(sorted(allowed, key=lambda e: -s[e])[:topk]))
    return out


def test_group_limited_routing_matches_reference_and_respects_group_limit():
    torch.manual_seed(0)
    scores = torch.rand(64, 16, dtype=torch.float64)
    bias = torch.randn(16, dtype=torch.float64) * 0.1
    idx = group_limited_topk(scores, bias, topk=4, n_groups=4, topk_groups=2)
    assert [sorted(r) for r in idx.tolist()] == _reference_topk(scores, bias, 4, 4, 2)
    groups_used = (idx // 4).tolist()
    assert max(len(set(g)) for g in groups_used) <= 2
    # without the limit, some tokens would use more than two groups: the limit is doing something
    free = group_limited_topk(scores, bias, topk=4, n_groups=1, topk_groups=1)
    assert max(len(set(g)) for g in (free // 4).tolist()) > 2


def test_bias_changes_selection_not_weights():
    torch.manual_seed(1)
    router = Router(dim=32, n_experts=8, topk=2, n_groups=2, topk_groups=1)
    x = torch.randn(40, 32)
    w0, idx0 = router(x)
    router.bias[5] = 10.0  # expert 5 now wins every selection it is allowed in
    w1, idx1 = router(x)
    assert not torch.equal(idx0, idx1)
    assert (idx1 == 5).any(dim=1).all()
    scores = torch.sigmoid(x @ router.weight.t())
    for w, idx in ((w0, idx0), (w1, idx1)):
        chosen = scores.gather(1, idx)
        torch.testing.assert_close(w, chosen / chosen.sum(1, keepdim=True))  # unbiased scores, normalised
    assert torch.allclose(w1.sum(1), torch.ones(40))


def test_update_bias_moves_against_load():
    router = Router(dim=8, n_experts=4, topk=1, bias_update_speed=0.01)
    router.load.copy_(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    router.update_bias()
    assert router.bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])
    assert router.load.sum() == 0


def test_router_balancing_state_stays_fp32_when_the_model_is_cast():
    """``model.to(torch.bfloat16)`` used to cast the bias and the load count too: the count stopped at 256 per
    expert and bias steps of 1e-3 rounded away, so balancing silently stopped."""
    torch.manual_seed(8)
    moe = MoE(dim=128, inter_dim=32, n_experts=8, topk=2, fp8_dispatch=False).to(torch.bfloat16)
    router = moe.router
    assert router.bias.dtype == router.load.dtype == torch.float32
    _, idx = moe.route(torch.randn(4096, 128, dtype=torch.bfloat16))
    counts = torch.bincount(idx.flatten(), minlength=8)
    assert counts.max() > 256
    assert router.load.tolist() == counts.tolist()
    router.bias.fill_(1.0)
    load = router.update_bias()
    assert router.bias.tolist() == pytest.approx((1.0 + 1e-3 * torch.sign(load.mean() - load)).tolist())
    assert router.double().bias.dtype == torch.float32


def test_router_takes_bias_update_speed_zero():
    """DeepSeek-V3 sets the bias update speed to 0 for its last 500B tokens: a valid setting, no error."""
    router = Router(dim=8, n_experts=4, topk=1, bias_update_speed=0.0)
    router.load.copy_(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    router.update_bias()
    assert router.bias.tolist() == [0.0] * 4


def test_router_counts_load_in_training_only():
    router = Router(dim=8, n_experts=4, topk=2)
    x = torch.randn(10, 8)
    router.eval()
    router(x)
    assert router.load.sum() == 0
    router.train()
    _, idx = router(x)
    assert router.load.tolist() == torch.bincount(idx.flatten(), minlength=4).float().tolist()


# --- grouped GEMM -------------------------------------------------------------------------------------


@pytest.mark.parametrize("defer", [False, True])
def test_grouped_mm_matches_per_expert_matmuls(defer):
    torch.manual_seed(2)
    counts = [3, 0, 5, 2]
    x = torch.randn(sum(counts), 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 8, 16, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    grad = torch.randn(sum(counts), 8, dtype=torch.float64)

    ref = torch.cat([x[s:s + n] @ w[e].t() for e, (s, n) in enumerate(zip([0, 3, 3, 8], counts))])
    gx_ref, gw_ref = torch.autograd.grad(ref, (x, w), grad)

    WeightGradStore.clear()
    WeightGradStore.enabled = defer
    try:
        out = grouped_mm(x, w, offs)
        out.backward(grad)
    finally:
        WeightGradStore.enabled = False
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, gx_ref)
    if defer:
        assert w.grad is None
        WeightGradStore.flush()
        WeightGradStore.pop()
    torch.testing.assert_close(w.grad, gw_ref)
    assert w.grad[1].abs().sum() == 0  # the empty group gets no gradient
    WeightGradStore.clear()


def _per_expert_mm(x, w, counts):
    starts = [sum(counts[:e]) for e in range(len(counts))]
    return torch.cat([x[s:s + n] @ w[e].t() for e, (s, n) in enumerate(zip(starts, counts))])


@pytest.mark.parametrize("layout", ["expanded gradient", "strided x"])
def test_grouped_mm_takes_operands_of_any_strides(layout, monkeypatch):
    """torch._grouped_mm refuses operands that are neither row- nor column-major; once it has run for a key, such
    an x or gradient (``out.sum().backward()``, a strided view) used to raise instead of computing."""
    from smsplit.moe import layer

    monkeypatch.setattr(layer, "GROUPED_MM_PATH", {})
    counts = [2, 0, 3, 1]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    w = torch.randn(4, 8, 16, requires_grad=True)
    grouped_mm(torch.randn(6, 16), w, offs).backward(torch.randn(6, 8))
    w.grad, paths = None, dict(layer.GROUPED_MM_PATH)
    x = (torch.randn(6, 32)[:, ::2] if layout == "strided x" else torch.randn(6, 16)).requires_grad_()
    out = grouped_mm(x, w, offs)
    out.sum().backward()  # (the gradient of a sum is an expanded tensor: strides 0)
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    ref = _per_expert_mm(xr, wr, counts)
    ref.sum().backward()
    assert layer.GROUPED_MM_PATH == paths  # (and no switch to the loop)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


def test_grouped_mm_defers_the_gradient_of_a_parameter_only():
    """With the store enabled, a weight computed from a parameter (a cast, as in mixed precision) used to get its
    deferred gradient on the cast tensor, so the parameter got none; now it gets it at once."""
    counts = [2, 0, 3]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x, g = torch.randn(5, 16, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    p = torch.nn.Parameter(torch.randn(3, 8, 16))
    _per_expert_mm(x, p.double(), counts).backward(g)
    ref, p.grad = p.grad, None
    WeightGradStore.clear()
    WeightGradStore.enabled = True
    try:
        grouped_mm(x, p.double(), offs).backward(g)
    finally:
        WeightGradStore.enabled = False
    WeightGradStore.flush()
    WeightGradStore.pop()
    WeightGradStore.clear()
    assert p.grad is not None
    torch.testing.assert_close(p.grad, ref)


def test_grouped_mm_with_no_token_leaves_torch_grouped_mm_alone(monkeypatch):
    """A rank whose local experts got no token: the weight gradient's contraction has length 0, which CUDA's
    torch._grouped_mm refuses (pytorch/pytorch#192497; mimicked here), so after a busy step the backward raised.
    Now such calls give zeros without it and leave the recorded path as it was."""
    from smsplit.moe import layer

    real = torch._grouped_mm

    def cuda_like(a, b, offs=None):
        if a.numel() == 0 or b.numel() == 0:
            raise RuntimeError("strides should be multiple of 16 bytes")
        return real(a, b, offs=offs)

    monkeypatch.setattr(torch, "_grouped_mm", cuda_like)
    monkeypatch.setattr(layer, "GROUPED_MM_PATH", {})
    w = torch.randn(4, 8, 16, requires_grad=True)
    for n in (6, 0):  # a busy step, then one with no token
        x = torch.randn(n, 16, requires_grad=True)
        counts = [n // 2, 0, n - n // 2, 0]
        out = grouped_mm(x, w, torch.tensor(counts).cumsum(0).to(torch.int32))
        w.grad = None
        out.backward(torch.randn(n, 8))
    assert out.shape == (0, 8) and x.grad.shape == (0, 16)
    assert torch.equal(w.grad, torch.zeros_like(w))
    assert set(layer.GROUPED_MM_PATH.values()) == {"torch._grouped_mm"}


# --- MoE layer ----------------------------------------------------------------------------------------

CFG = dict(dim=128, inter_dim=32, n_experts=8, topk=3, n_groups=4, topk_groups=2, n_shared=1, route_scale=2.0)


def dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: shared expert plus the weighted selected experts, from the layer's own weights
    (all experts must be local)."""
    weights, idx = moe.router(x)
    out = []
    for t in range(x.size(0)):
        y = moe.shared(x[t:t + 1])[0]
        for k in range(idx.size(1)):
            e = int(idx[t, k])
            h = moe.experts.w13[e] @ x[t]
            gate, up = h.chunk(2)
            y = y + weights[t, k] * (moe.experts.w2[e] @ (F.silu(gate) * up))
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("alignment", [1, 8])
def test_moe_layer_matches_dense_reference(alignment):
    torch.manual_seed(3)
    moe = MoE(**CFG, fp8_dispatch=False, expert_alignment=alignment).double()
    init_moe_(moe, seed=3)
    moe.double()
    x = torch.randn(2, 10, 128, dtype=torch.float64, requires_grad=True)
    y = moe(x)
    ref = dense_reference(moe, x.detach().view(-1, 128).requires_grad_())
    torch.testing.assert_close(y.view(-1, 128), ref)
    # gradients: of the layer's input and of every parameter, against autograd through the reference
    g = torch.randn_like(y)
    y.backward(g)
    got = {n: p.grad.clone() for n, p in moe.named_parameters()}
    moe.zero_grad()
    xr = x.detach().view(-1, 128).requires_grad_()
    dense_reference(moe, xr).backward(g.view(-1, 128))
    torch.testing.assert_close(x.grad.view(-1, 128), xr.grad)
    for n, p in moe.named_parameters():
        torch.testing.assert_close(got[n], p.grad, msg=n)


# --- EP over two gloo ranks ---------------------------------------------------------------------------


def _ep_worker(rank, world, port, out_dir):
    from smsplit.ep import Buffer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        buffer = Buffer(dist.group.WORLD, timeout_s=60)
        results = {}
        for fp8 in (False, True):
            # exact: FP32 on the wire both ways; else FP8 dispatch and BF16 combine, as in DeepSeek-V3
            moe = MoE(**CFG, fp8_dispatch=fp8, ep_rank=rank, ep_size=world,
                      combine_dtype=torch.bfloat16 if fp8 else None, buffer=buffer)
            init_moe_(moe, seed=4)
            full = MoE(**CFG, fp8_dispatch=fp8)  # all experts, same global weights
            init_moe_(full, seed=4)
            xs = [torch.randn(12, 128, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
            gs = [torch.randn(12, 128, generator=torch.Generator().manual_seed(20 + r)) for r in range(world)]
            x = xs[rank].clone().requires_grad_()
            y = moe(x)
            y.backward(gs[rank])
            xf = torch.cat(xs).requires_grad_()
            yf = full(xf)
            yf.backward(torch.cat(gs))
            lo = rank * moe.n_local_experts
            results[fp8] = dict(
                y=y.detach(), y_ref=yf.detach()[rank * 12:(rank + 1) * 12],
                gx=x.grad, gx_ref=xf.grad[rank * 12:(rank + 1) * 12],
                gw13=moe.experts.w13.grad, gw13_ref=full.experts.w13.grad[lo:lo + moe.n_local_experts],
                gw2=moe.experts.w2.grad, gw2_ref=full.experts.w2.grad[lo:lo + moe.n_local_experts])
            router_grad = moe.router.weight.grad.clone()
            dist.all_reduce(router_grad)  # the router is replicated: sum its gradient over ranks
            results[fp8].update(grouter=router_grad, grouter_ref=full.router.weight.grad)

        # overlapped F&B with EP: same gradients as the serial path
        cfg = ModelConfig(dim=128, n_layers=2, n_experts=4, topk=2, n_groups=2, topk_groups=1, seq_len=8)
        ids = torch.randint(0, cfg.vocab_size, (2, 2, 9), generator=torch.Generator().manual_seed(30 + rank))
        grads = []
        for fb in (serial_forward_backward, overlapped_forward_backward):
            grads.append(_fb_grads(cfg, ids, fb, rank=rank, world=world, buffer=buffer))
        results["fb"] = grads
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_moe_expert_parallel_two_ranks_matches_single_process(tmp_path):
    world = 2
    spawn(_ep_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        exact = r[False]
        for name in ("y", "gx", "gw13", "gw2", "grouter"):
            torch.testing.assert_close(exact[name], exact[name + "_ref"], rtol=1e-4, atol=1e-5, msg=name)
        # FP8 dispatch, BF16 combine: the forward sees e4m3 tokens (about 2^-4 relative error per value)
        fp8 = r[True]
        err = (fp8["y"] - fp8["y_ref"]).norm() / fp8["y_ref"].norm()
        assert 0 < err < 0.05, err
        serial, overlapped = r["fb"]
        assert serial.keys() == overlapped.keys() and len(serial) > 10
        for name in serial:
            torch.testing.assert_close(overlapped[name], serial[name], rtol=1e-5, atol=1e-6, msg=name)


# --- overlapped forward/backward ------------------------------------------------------------------------


def _fb_grads(cfg, ids, fb, rank=0, world=1, buffer=None, runner=None, device="cpu"):
    """Chunk 0 through both stages; then F(chunk 1, module 0) with B(chunk 0, module 1) through ``fb``;
    then the rest serially. Returns every parameter gradient."""
    torch.manual_seed(0)
    m0, m1 = build_stages(cfg, ep_rank=rank, ep_size=world, seed=5, runner=runner, buffer=buffer)
    ids = ids.to(device)
    for m in (m0, m1):
        m.to(device)

    def criterion(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    out0 = m0(ids[:, 0, :-1])
    in1 = out0.detach().requires_grad_()
    loss = criterion(m1(in1), ids[:, 0, 1:])
    (out0b,), _ = fb(m0, [ids[:, 1, :-1]], None, [], m1, loss, [], [], runner=runner)
    torch.autograd.backward(out0, in1.grad)  # B(chunk 0, module 0)
    in1b = out0b.detach().requires_grad_()
    criterion(m1(in1b), ids[:, 1, 1:]).backward()
    torch.autograd.backward(out0b, in1b.grad)
    return {f"{i}.{n}": p.grad.clone() for i, m in enumerate((m0, m1)) for n, p in m.named_parameters()
            if p.grad is not None}


def _plain_grads(cfg, ids):
    """The gradients of `_fb_grads`'s two chunks by plain autograd: each stage's pieces called as functions,
    no tape (independent of `smsplit.moe.overlap`)."""
    m0, m1 = build_stages(cfg, seed=5)

    def forward(stage, x):
        state = (x,)
        for _, _, fn in stage.pieces():
            state = fn(*state)
            state = state if isinstance(state, tuple) else (state,)
        return state[0]

    for chunk in range(ids.size(1)):
        logits = forward(m1, forward(m0, ids[:, chunk, :-1]))
        F.cross_entropy(logits.flatten(0, 1), ids[:, chunk, 1:].flatten()).backward()
    return {f"{i}.{n}": p.grad.clone() for i, m in enumerate((m0, m1)) for n, p in m.named_parameters()
            if p.grad is not None}


def test_overlapped_forward_backward_gradients_equal_serial():
    cfg = ModelConfig(fp8_dispatch=False)
    ids = torch.randint(0, cfg.vocab_size, (3, 2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(6))
    serial = _fb_grads(cfg, ids, serial_forward_backward)
    runner = PieceRunner(record=True)
    overlapped = _fb_grads(cfg, ids, overlapped_forward_backward, runner=runner)
    plain = _plain_grads(cfg, ids)
    assert serial.keys() == overlapped.keys() == plain.keys()
    assert len(serial) == sum(1 for m in build_stages(cfg) for p in m.parameters())  # every parameter got one
    for name in serial:
        torch.testing.assert_close(overlapped[name], serial[name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(overlapped[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
    # and the pieces really were interleaved in DeepSeek-V3's order: forward compute next to backward comm
    names = [iv.name for iv in runner.intervals]
    i = names.index("combine.3 (backward)")
    assert names[i - 1:i + 5] == ["attn.0", "combine.3 (backward)", "mlp.3 (backward)", "dispatch.0", "mlp.0", "W"]


def test_overlapped_forward_backward_defers_weight_grads_when_pipeline_asks():
    cfg = ModelConfig(fp8_dispatch=False, n_layers=2)
    ids = torch.randint(0, cfg.vocab_size, (2, 2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(7))

    def grads(defer: bool) -> dict:
        m0, m1 = build_stages(cfg, seed=5)
        out0 = m0(ids[:, 0, :-1])
        loss = F.cross_entropy(m1(out0.detach().requires_grad_()).flatten(0, 1), ids[:, 0, 1:].flatten())
        WeightGradStore.clear()
        WeightGradStore.enabled = defer  # the caller defers W to its own "W" op
        try:
            overlapped_forward_backward(m0, [ids[:, 1, :-1]], None, [], m1, loss, [], [])
        finally:
            WeightGradStore.enabled = False
        if defer:
            expert_w = m1.blocks[0].moe.experts.w13
            assert expert_w.grad is None and len(WeightGradStore.cache) > 0
            WeightGradStore.flush()
            WeightGradStore.pop()
        WeightGradStore.clear()
        return {f"{i}.{n}": p.grad.clone() for i, m in enumerate((m0, m1)) for n, p in m.named_parameters()
                if p.grad is not None}

    immediate, deferred = grads(False), grads(True)
    # every gradient, deferred or not, as without the store: none lost, none applied twice
    assert deferred.keys() == immediate.keys() and "1.blocks.0.moe.experts.w13" in deferred
    for name in immediate:
        torch.testing.assert_close(deferred[name], immediate[name], rtol=1e-5, atol=1e-6, msg=name)


def test_overlapped_backward_from_outputs_follows_what_the_module_did_to_its_taped_output():
    """DualPipe hands the hook a stage's outputs and their gradients (every stage but the last). The hook used to
    put that gradient on the tape's own output, so a module that post-processes it (here: halves it) got the
    gradient of the unprocessed output: twice the serial path's."""
    from smsplit.moe import Stage

    class HalvedStage(Stage):
        def forward(self, x):
            return super().forward(x) * 0.5

    cfg = ModelConfig(fp8_dispatch=False, n_layers=2)
    ids = torch.randint(0, cfg.vocab_size, (2, 2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(11))

    def criterion(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def grads(fb):
        m0, m1 = build_stages(cfg, seed=5)
        m0.__class__ = HalvedStage
        outs = [m0(ids[:, c, :-1]) for c in range(2)]
        ins = [o.detach().requires_grad_() for o in outs]
        criterion(m1(ins[0]), ids[:, 0, 1:]).backward()
        # F(chunk 1, module 1) with B(chunk 0, module 0) from module 0's output and its gradient
        (_,), loss = fb(m1, [ins[1]], criterion, [ids[:, 1, 1:]], m0, None, [outs[0]], [ins[0].grad])
        loss.backward()
        torch.autograd.backward(outs[1], ins[1].grad)
        return {f"{i}.{n}": p.grad.clone() for i, m in enumerate((m0, m1)) for n, p in m.named_parameters()}

    serial, overlapped = grads(serial_forward_backward), grads(overlapped_forward_backward)
    for name in serial:
        torch.testing.assert_close(overlapped[name], serial[name], rtol=1e-5, atol=1e-6, msg=name)


def test_stage_without_seed_keeps_the_default_initialisation_of_its_embedding():
    """``seed=None`` is documented to keep PyTorch's default initialisation; the embedding was still drawn from
    seed 0, the same whatever the global RNG."""
    from smsplit.moe import Stage

    cfg = ModelConfig(fp8_dispatch=False)
    made = []
    for rng in (1, 2, 1):
        torch.manual_seed(rng)
        made.append(Stage(cfg, [0], first=True, seed=None).embedding.weight.detach())
    assert torch.equal(made[0], made[2]) and not torch.equal(made[0], made[1])
    seeded = [Stage(cfg, [0], first=True, seed=3).embedding.weight.detach() for _ in range(2)]
    assert torch.equal(*seeded)


@pytest.mark.gpu
def test_overlap_on_sm_budget_streams_matches_serial_on_gpu():
    from smsplit.budget import SmBudget

    cfg = ModelConfig(fp8_dispatch=False)
    ids = torch.randint(0, cfg.vocab_size, (3, 2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(6))
    serial = _fb_grads(cfg, ids, serial_forward_backward, device="cuda")
    with SmBudget(16, mode="grid") as budget:
        runner = PieceRunner(budget.comm_stream, budget.compute_stream, record=True)
        overlapped = _fb_grads(cfg, ids, overlapped_forward_backward, runner=runner, device="cuda")
        shares = runner.exposed_comm()
    for name in serial:
        torch.testing.assert_close(overlapped[name], serial[name], rtol=1e-4, atol=1e-5, msg=name)
    assert shares["step_s"] > 0 and 0 <= shares["exposed_fraction"] <= 1
    assert shares["comm_s"] > 0 and shares["compute_s"] > 0


# --- argument checks (no work starts on bad input) ---------------------------------------------------


def test_router_weights_are_normalised_scores_times_route_scale():
    torch.manual_seed(5)
    router = Router(dim=16, n_experts=8, topk=3, n_groups=4, topk_groups=2, route_scale=2.5)
    x = torch.randn(30, 16)
    w, idx = router(x)
    scores = torch.sigmoid(x @ router.weight.t())
    assert [sorted(r) for r in idx.tolist()] == _reference_topk(scores, router.bias, 3, 4, 2)
    chosen = scores.gather(1, idx)
    torch.testing.assert_close(w, chosen / chosen.sum(1, keepdim=True) * 2.5)
    router.weight.data.fill_(-10.0)
    w, _ = router(torch.full((2, 16), 5.0))  # every score underflows to 0: weights 0, not NaN
    assert torch.isfinite(w).all()


@pytest.mark.parametrize("kwargs, words", [
    (dict(topk=0), "topk must be an int >= 1"), (dict(topk=2.0), "topk must be an int"),
    (dict(dim=0), "dim must be an int >= 1"), (dict(n_groups=0), "n_groups must be an int >= 1"),
    (dict(route_scale=0.0), "route_scale must be a finite number > 0"),
    (dict(route_scale=float("nan")), "route_scale must be"),
    (dict(bias_update_speed=-1e-3), "bias_update_speed must be a finite number >= 0"),
    (dict(n_groups=3), "must divide into n_groups=3"), (dict(topk_groups=5), "topk_groups must lie in"),
    (dict(topk=5, n_groups=4, topk_groups=2), "do not fit")])
def test_router_refuses_bad_arguments(kwargs, words):
    args = dict(dim=16, n_experts=8, topk=2, n_groups=4, topk_groups=2) | kwargs
    with pytest.raises(ValueError, match=words):
        Router(**args)


def test_group_limited_topk_keeps_its_limit_or_refuses():
    scores, bias = torch.rand(4, 8), torch.zeros(8)
    with pytest.raises(ValueError, match="do not fit"):
        group_limited_topk(scores, bias, topk=5, n_groups=4, topk_groups=2)  # 4 experts allowed
    with pytest.raises(ValueError, match="bias"):
        group_limited_topk(scores, torch.zeros(6), topk=2, n_groups=4, topk_groups=2)


@pytest.mark.parametrize("kwargs, words", [
    (dict(expert_alignment=-4), "expert_alignment must be an int >= 1"),
    (dict(expert_alignment=0), "expert_alignment must be"), (dict(ep_rank=2, ep_size=2), "ep_rank must be"),
    (dict(ep_size=2, dim=64), "multiple of 128"), (dict(n_shared=-1), "n_shared must be")])
def test_moe_layer_refuses_bad_arguments(kwargs, words):
    args = dict(dim=128, inter_dim=32, n_experts=8, topk=2, n_groups=2, topk_groups=1) | kwargs
    with pytest.raises(ValueError, match=words):
        MoE(**args)


@pytest.mark.parametrize("kwargs, words", [
    (dict(dim=64), "multiple of 128"), (dict(n_heads=5), "n_heads=5 heads"), (dict(n_experts=6), "n_groups=4"),
    (dict(topk=0), "topk must be"), (dict(n_layers=0), "n_layers must be"),
    # (these used to be accepted: the first two then failed inside every spawned worker, rope_theta trained on NaN)
    (dict(route_scale=0.0), "route_scale must be a finite number > 0"), (dict(n_shared=-1), "n_shared must be"),
    (dict(rope_theta=0.0), "rope_theta must be a finite number > 0"), (dict(rope_theta=float("nan")), "rope_theta"),
    (dict(fp8_dispatch="no"), "fp8_dispatch must be a bool")])
def test_model_config_refuses_a_model_that_cannot_be_built(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ModelConfig(**kwargs)


@pytest.mark.parametrize("kwargs, words", [
    (dict(pp_rank=1, pp_size=1), "pp_rank must lie in"), (dict(pp_rank=-1, pp_size=2), "pp_rank must be an int >= 0"),
    (dict(pp_size=0), "pp_size must be an int >= 1")])
def test_build_stages_refuses_a_pipeline_rank_it_does_not_have(kwargs, words):
    """``build_stages(cfg, pp_rank=pp_size)`` used to return stages without embedding or head (or of no layers)."""
    with pytest.raises(ValueError, match=words):
        build_stages(ModelConfig(), **kwargs)


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=3), "n_experts=8 must divide evenly over the 3 EP ranks"),
    (dict(world_size=3, pp=3, chunks=6, batch=6), "n_layers=4 must divide into 2 \\* pp = 6 stages")])
def test_run_demo_refuses_a_layout_its_model_cannot_take_before_spawning(kwargs, words, tmp_path):
    from smsplit.apps.demo import DemoConfig, run

    with pytest.raises(ValueError, match=words):
        run(DemoConfig(str(tmp_path), steps=1, device="cpu", progress=False, **kwargs))


def _update_biases_case(rank, world):
    from smsplit.moe.router import update_biases

    routers = [Router(dim=8, n_experts=4, topk=1) for _ in range(2)]
    for r in routers:
        r.load[:] = torch.tensor([3.0, 0.0, 1.0, 0.0]) * (rank + 1)
    loads = update_biases(routers, dist.group.WORLD)
    assert torch.equal(loads[0], torch.tensor([9.0, 0.0, 3.0, 0.0]))  # summed over the ranks
    assert torch.equal(routers[0].bias, torch.tensor([-1e-3, 1e-3, 0.0, 1e-3]))  # against the mean load (3)
    try:
        update_biases(routers[: 1 + rank], dist.group.WORLD)  # rank 1 passes one router more
    except ValueError as e:
        return str(e)
    return None


def test_update_biases_sums_the_loads_and_ranks_that_disagree_all_raise():
    from ep_harness import gloo_pool

    messages = gloo_pool(2).run(_update_biases_case)
    assert all(m is not None and "the ranks pass different routers" in m for m in messages), messages
