"""`Buffer`'s node layout: agreed at construction through the bounded header exchange (`ranks_per_node`, else the
launcher's, else host names), the same on every rank or the same error on every rank; `get_dispatch_layout`'s tokens
per node; the launch environment compared across ranks."""

import os

import pytest
import torch
import torch.distributed as dist

from ep_harness import gloo_pool
from smsplit.ep import Buffer, EPArgumentError


def case_layout(rank, world_size, ranks_per_node):
    try:
        buffer = Buffer(dist.group.WORLD, ranks_per_node=ranks_per_node, timeout_s=10)
    except EPArgumentError as error:
        return "error", error.argument, str(error)
    topk = torch.tensor([[0, 1], [0, world_size * 2 - 1], [-1, -1], [2, 3]])
    per_rank, per_node, _, in_rank, _ = buffer.get_dispatch_layout(topk, world_size * 2)
    node_counts = None if per_node is None else per_node.tolist()
    return buffer.nodes.num_nodes, buffer.nodes.ranks_per_node, node_counts, buffer.num_rdma_bytes


@pytest.mark.parametrize("world_size,ranks_per_node,expected", [
    (4, None, (1, 4, None, 0)),  # every rank on this host: one node, DeepEP's None
    (4, 2, (2, 2, [3, 1], 0)),   # experts 0-3 on node 0, 4-7 on node 1: tokens 0, 1, 3 reach node 0, token 1 node 1
    (4, 1, (4, 1, [2, 1, 0, 1], 0)),
    (2, 1, (2, 1, [2, 2], 0)),
])
def test_the_node_layout_is_agreed_at_construction_and_counts_tokens_per_node(world_size, ranks_per_node, expected):
    results = gloo_pool(world_size).run(case_layout, ranks_per_node)
    assert results == [expected] * world_size


def test_a_layout_that_cannot_work_is_the_same_error_on_every_rank():
    results = gloo_pool(4).run(case_layout, 3)
    assert all(r[:2] == ("error", "ranks_per_node") and "does not divide the group's 4 ranks" in r[2]
               for r in results), results


def case_different_ranks_per_node(rank, world_size):
    try:
        Buffer(dist.group.WORLD, ranks_per_node=1 if rank == 0 else 2, timeout_s=10)
    except EPArgumentError as error:
        return error.argument, "different ranks_per_node" in str(error)


def test_ranks_passing_different_ranks_per_node_fail_alike():
    assert gloo_pool(2).run(case_different_ranks_per_node) == [("ranks_per_node", True)] * 2


def case_launch_env(rank, world_size):
    previous = os.environ.get("NCCL_PROTO")
    if rank == 1:
        os.environ["NCCL_PROTO"] = "Simple"
    try:
        Buffer(dist.group.WORLD, timeout_s=10)
        return None
    except EPArgumentError as error:
        return error.argument, str(error)
    finally:
        if previous is None:
            os.environ.pop("NCCL_PROTO", None)
        else:
            os.environ["NCCL_PROTO"] = previous


def test_ranks_started_with_different_nccl_settings_fail_at_construction_naming_the_variable():
    results = gloo_pool(2).run(case_launch_env)
    assert results[0] == results[1] and results[0][0] == "group", results
    assert "NCCL_PROTO: unset on ranks 0;" in results[0][1] and "on ranks 1" in results[0][1]


def case_rdma_argument(rank, world_size):
    buffer = Buffer(dist.group.WORLD, 0, 1 << 20, ranks_per_node=1, timeout_s=10)
    topk = torch.tensor([[0], [1]])
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, 2)
    x = torch.ones(2, 8)
    try:
        buffer.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node[:1],
                        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk,
                        topk_weights=torch.ones(2, 1))
    except EPArgumentError as error:
        return buffer.num_rdma_bytes, error.argument


def test_num_rdma_bytes_is_kept_and_tokens_per_node_are_checked_for_their_shape():
    assert gloo_pool(2).run(case_rdma_argument) == [(1 << 20, "num_tokens_per_rdma_rank")] * 2


def case_auto_across_nodes(rank, world_size, ranks_per_node):
    """DeepEP's internode calls on a buffer of emulated nodes ("auto": the hierarchical transport) against the same
    calls on a flat reference buffer: equal rows, handles, sums and gradients; fewer rows across nodes."""
    from smsplit.nodes import count_node_bytes

    hier = Buffer(dist.group.WORLD, 0, 1 << 20, ranks_per_node=ranks_per_node, timeout_s=20)
    flat = Buffer(dist.group.WORLD, backend="reference", ranks_per_node=ranks_per_node, timeout_s=20)
    g = torch.Generator().manual_seed(100 + rank)
    num_experts, tokens, hidden = 4 * world_size, 10, 256
    topk = torch.rand(tokens, num_experts, generator=g).topk(3, dim=1).indices
    topk[0] = -1  # a token that goes nowhere
    weights = torch.rand(tokens, 3, generator=g)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    out = {}
    for name, buffer in (("hier", hier), ("flat", flat)):
        per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
        layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                      num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights)
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(x, **layout)
        dispatch_traffic = buffer.last_traffic
        (recv_q, recv_s), *_ = buffer.dispatch(x, handle=handle, fp8=True)
        combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
        # autograd: the gradient of a dispatch is the combine of the received rows' gradients
        leaf = x.float().requires_grad_()
        rows, *_ = buffer.dispatch(leaf, **layout)
        (rows * 2).sum().backward()
        # and the gradient of a combine is the cached dispatch of the summed rows' gradients
        expert_out = recv_x.float().requires_grad_()
        summed, *_ = buffer.combine(expert_out, handle)
        (summed * torch.arange(1, hidden + 1)).sum().backward()
        out[name] = (handle.transport, recv_x, recv_idx, recv_w, counts, handle.rank_prefix_matrix,
                     handle.recv_src_idx, recv_q.view(torch.uint8), recv_s, combined, combined_w, leaf.grad,
                     dispatch_traffic, in_rank, expert_out.grad)
    h, f = out["hier"], out["flat"]
    assert (h[0], f[0]) == ("hierarchical", "reference")
    for a, b in zip(h[1:9], f[1:9]):
        assert (a is None and b is None) or (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
    torch.testing.assert_close(h[9].float(), f[9].float(), rtol=2e-2, atol=2e-2)  # (node sums rounded to bf16)
    torch.testing.assert_close(h[10], f[10])
    torch.testing.assert_close(h[11], f[11])
    assert torch.equal(h[14], f[14])  # (fp32 gradients move as they are)
    hier_traffic, flat_traffic, in_rank = h[12], f[12], h[13]
    rows = count_node_bytes(in_rank, rank, hier.nodes, 1)
    assert hier_traffic.internode_rows == rows.internode_bytes and flat_traffic.internode_rows == rows.flat_internode_bytes
    return hier_traffic.internode_rows, flat_traffic.internode_rows


@pytest.mark.parametrize("world_size,ranks_per_node", [(4, 2), (4, 1)])
def test_deepep_internode_calls_on_emulated_nodes_match_the_flat_reference(world_size, ranks_per_node):
    results = gloo_pool(world_size).run(case_auto_across_nodes, ranks_per_node)
    assert sum(h for h, _ in results) < sum(f for _, f in results) or ranks_per_node == 1, results
