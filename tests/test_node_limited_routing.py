"""Node-limited routing (DeepSeek-V3 section 2.1.2): across nodes the router's groups are the nodes, so no token
reaches more than M nodes, and within the nodes it picks its top-k are the true top-k. Checked against a
token-by-token reference written with Python lists, on the router, the MoE layer, the model and the demo."""

import random

import pytest
import torch

from smsplit.moe import MoE, ModelConfig, build_stages, group_limited_topk, node_limited_groups
from smsplit.nodes import NodeLayout


def _reference_choice(biased_row, n_nodes, m, topk):
    """One token, Python lists only: the M nodes with the largest sum of their two best biased scores, then the
    top-k experts among those nodes' experts (a contiguous ``E / n_nodes`` each). Returns (nodes, experts)."""
    per = len(biased_row) // n_nodes
    node_score = []
    for n in range(n_nodes):
        best = sorted(biased_row[n * per:(n + 1) * per], reverse=True)[:2]
        node_score.append((sum(best), n))
    nodes = {n for _, n in sorted(node_score, reverse=True)[:m]}
    candidates = [(biased_row[e], e) for e in range(len(biased_row)) if e // per in nodes]
    return nodes, {e for _, e in sorted(candidates, reverse=True)[:topk]}


def _node_of_expert(expert, n_experts, layout):
    """Through the rank that holds the expert (contiguous experts per rank) and the layout's node of that rank."""
    return layout.node_of(expert // (n_experts // layout.group_size))


@pytest.mark.parametrize("nodes,rpn,n_experts,topk,m", [(2, 2, 16, 4, 1), (4, 2, 32, 8, 2), (8, 8, 256, 8, 4),
                                                        (3, 2, 24, 9, 3), (4, 1, 16, 1, 4), (8, 8, 256, 8, None)])
def test_no_token_reaches_more_than_m_nodes_and_its_experts_are_the_true_top_k_there(nodes, rpn, n_experts, topk, m):
    layout = NodeLayout(rpn, nodes)
    n_groups, topk_groups = node_limited_groups(n_experts, topk, 1, 1, layout, m)
    want_m = min(4, nodes) if m is None else m
    assert (n_groups, topk_groups) == (nodes, want_m)
    g = torch.Generator().manual_seed(nodes * 100 + topk)
    scores = torch.sigmoid(torch.randn(300, n_experts, generator=g))
    bias = torch.randn(n_experts, generator=g) * 0.1
    idx = group_limited_topk(scores, bias, topk, n_groups, topk_groups)
    biased = (scores + bias).tolist()
    for t, row in enumerate(idx.tolist()):
        reached = {_node_of_expert(e, n_experts, layout) for e in row}
        assert len(reached) <= want_m, (t, row, reached)
        ref_nodes, ref_experts = _reference_choice(biased[t], nodes, want_m, topk)
        assert reached <= ref_nodes
        assert set(row) == ref_experts, (t, sorted(row), sorted(ref_experts))


def test_with_m_equal_to_the_nodes_the_choice_is_the_unrestricted_top_k():
    layout = NodeLayout(2, 4)
    n_groups, topk_groups = node_limited_groups(64, 8, 1, 1, layout, 4)
    scores = torch.rand(100, 64, generator=torch.Generator().manual_seed(3))
    idx = group_limited_topk(scores, torch.zeros(64), 8, n_groups, topk_groups)
    for row, s in zip(idx.tolist(), scores.tolist()):
        assert set(row) == {e for _, e in sorted(((v, e) for e, v in enumerate(s)), reverse=True)[:8]}


def test_one_node_or_no_layout_keeps_the_configured_groups():
    assert node_limited_groups(8, 2, 4, 2, None) == (4, 2)
    assert node_limited_groups(8, 2, 4, 2, NodeLayout(8, 1)) == (4, 2)
    assert node_limited_groups(8, 2, 4, 2, NodeLayout(8, 1), max_nodes_per_token=3) == (4, 2)


def test_layouts_and_m_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="max_nodes_per_token=3 is more than the 2 nodes"):
        node_limited_groups(8, 2, 1, 1, NodeLayout(2, 2), 3)
    with pytest.raises(ValueError, match="max_nodes_per_token must be an int >= 1"):
        node_limited_groups(8, 2, 1, 1, NodeLayout(2, 2), 0)
    with pytest.raises(ValueError, match="topk=5 experts do not fit in max_nodes_per_token=1 nodes of 4"):
        node_limited_groups(8, 5, 1, 1, NodeLayout(1, 2), 1)
    with pytest.raises(ValueError, match="must divide evenly over the 3 nodes"):
        node_limited_groups(8, 2, 1, 1, NodeLayout(1, 3), 2)


def test_the_moe_layer_routes_within_m_nodes_of_its_layout():
    layout = NodeLayout(2, 4)  # 8 EP ranks, 4 nodes, 4 experts a rank
    moe = MoE(32, 16, 32, 4, n_groups=8, topk_groups=8, ep_rank=3, ep_size=8, fp8_dispatch=False, nodes=layout,
              max_nodes_per_token=2)
    assert (moe.router.n_groups, moe.router.topk_groups) == (4, 2)
    with torch.no_grad():
        moe.router.bias.copy_(torch.randn(32, generator=torch.Generator().manual_seed(5)) * 0.05)
    x = torch.randn(200, 32, generator=torch.Generator().manual_seed(6))
    _, idx = moe.route(x)
    scores = torch.sigmoid(x @ moe.router.weight.t()) + moe.router.bias
    for row, s in zip(idx.tolist(), scores.tolist()):
        assert len({_node_of_expert(e, 32, layout) for e in row}) <= 2
        assert set(row) == _reference_choice(s, 4, 2, 4)[1]


def test_the_moe_layer_refuses_a_layout_of_another_group_size():
    with pytest.raises(ValueError, match="a layout of 4 ranks .* for an EP group of ep_size=8"):
        MoE(32, 16, 32, 4, ep_size=8, fp8_dispatch=False, nodes=NodeLayout(2, 2))


def test_the_model_derives_its_routers_groups_from_the_nodes():
    cfg = ModelConfig(n_experts=8, topk=2, n_groups=4, topk_groups=2, n_layers=2, fp8_dispatch=False,
                      max_nodes_per_token=1)
    m0, m1 = build_stages(cfg, 0, 1, ep_rank=1, ep_size=4, nodes=NodeLayout(2, 2))
    routers = [b.moe.router for m in (m0, m1) for b in m.blocks]
    assert routers and all((r.n_groups, r.topk_groups) == (2, 1) for r in routers)
    # one node: the configured groups, as before
    m0, m1 = build_stages(cfg, 0, 1, ep_rank=1, ep_size=4, nodes=NodeLayout(4, 1))
    assert all((b.moe.router.n_groups, b.moe.router.topk_groups) == (4, 2) for m in (m0, m1) for b in m.blocks)
    m0, m1 = build_stages(cfg, 0, 1, ep_rank=1, ep_size=4)
    assert all((b.moe.router.n_groups, b.moe.router.topk_groups) == (4, 2) for m in (m0, m1) for b in m.blocks)


def test_a_bad_max_nodes_per_token_is_refused_by_the_config():
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="max_nodes_per_token must be None or an int >= 1"):
            ModelConfig(max_nodes_per_token=bad)


def test_the_demo_refuses_emulated_nodes_that_cannot_work_before_spawning(tmp_path):
    from smsplit.apps.demo import DemoConfig

    with pytest.raises(ValueError, match="ranks_per_node=3 does not divide the EP group's 4 ranks"):
        DemoConfig(str(tmp_path), world_size=4, device="cpu", ranks_per_node=3)
    with pytest.raises(ValueError, match="max_nodes_per_token=3 is more than the 2 nodes"):
        DemoConfig(str(tmp_path), world_size=2, device="cpu", ranks_per_node=1, model=dict(max_nodes_per_token=3))
    with pytest.raises(ValueError, match="ranks_per_node must be None or an int >= 1"):
        DemoConfig(str(tmp_path), world_size=2, device="cpu", ranks_per_node=0)


def test_the_demo_on_two_emulated_nodes_routes_each_token_to_one_node(tmp_path,
                                                                    demo_processes_from_the_fork_server):
    from smsplit.apps.demo import DemoConfig, run

    summary = run(DemoConfig(str(tmp_path), steps=1, device="cpu", batch=4, chunks=2, progress=False, timeout_s=60,
                             ranks_per_node=1, model=dict(max_nodes_per_token=1)))
    assert summary["routing"] == dict(nodes=2, ranks_per_node=1, layout_source="explicit", n_groups=2,
                                      topk_groups=1)
    assert summary["final_loss"] == summary["final_loss"]  # a number, not NaN
    assert summary["ep_backend"] == "hierarchical"  # (tokens cross the emulated nodes as they would real ones)


def test_random_layouts_never_exceed_m_nodes():
    rng = random.Random(7)
    for _ in range(20):
        nodes, rpn = rng.choice([2, 3, 4, 8]), rng.choice([1, 2, 4])
        per_rank = rng.choice([1, 2, 4])
        n_experts = nodes * rpn * per_rank
        m = rng.randint(1, nodes)
        topk = rng.randint(1, min(9, m * n_experts // nodes))
        layout = NodeLayout(rpn, nodes)
        n_groups, topk_groups = node_limited_groups(n_experts, topk, 1, 1, layout, m)
        scores = torch.rand(64, n_experts, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        idx = group_limited_topk(scores, torch.zeros(n_experts), topk, n_groups, topk_groups)
        for row in idx.tolist():
            assert len({_node_of_expert(e, n_experts, layout) for e in row}) <= m
