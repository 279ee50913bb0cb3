"""`smsplit.nodes`: node layouts (pure, and agreed by the ranks of gloo groups of 2 and 4) and the bytes a dispatch
moves across node boundaries, against hand-computed layouts and a brute-force count over tokens and ranks."""

import itertools
import os
import random
import socket
from contextlib import contextmanager

import pytest
import torch

from smsplit.nodes import (AGREED_LAUNCH_ENV, NodeLayout, check_launch_env, count_node_bytes, env_disagreements,
                           is_token_in_rank_from_topk, layout_from_node_keys, node_bytes_from_topk, node_layout,
                           token_bytes)


# --- the layout itself ---------------------------------------------------------------------------------------------

def test_a_2x4_layout_matches_the_hand_computed_one():
    lay = NodeLayout(ranks_per_node=4, num_nodes=2)
    assert lay.group_size == 8 and lay.spans_nodes
    assert [lay.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [lay.local_index(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert lay.ranks_of_node(0) == [0, 1, 2, 3] and lay.ranks_of_node(1) == [4, 5, 6, 7]
    assert lay.peers(1) == [5] and lay.peers(6) == [2]


def test_a_4x2_layout_matches_the_hand_computed_one():
    lay = NodeLayout(ranks_per_node=2, num_nodes=4)
    assert [lay.node_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert lay.peers(0) == [2, 4, 6] and lay.peers(5) == [1, 3, 7]
    assert lay.ranks_of_node(2) == [4, 5]
    # 32 experts over 8 ranks: 4 a rank, 8 a node
    assert [lay.node_of_expert(e, 32) for e in (0, 7, 8, 15, 16, 31)] == [0, 0, 1, 1, 2, 3]


def test_one_node_has_no_peers_and_does_not_span_nodes():
    lay = NodeLayout(ranks_per_node=3, num_nodes=1)
    assert not lay.spans_nodes and lay.peers(2) == [] and lay.ranks_of_node(0) == [0, 1, 2]


@pytest.mark.parametrize("bad", [dict(ranks_per_node=0, num_nodes=2), dict(ranks_per_node=2, num_nodes=-1),
                                 dict(ranks_per_node=2.0, num_nodes=2), dict(ranks_per_node=True, num_nodes=2)])
def test_a_layout_of_bad_sizes_is_refused(bad):
    with pytest.raises(ValueError, match="must be an int >= 1"):
        NodeLayout(**bad)


def test_ranks_and_nodes_out_of_range_are_refused():
    lay = NodeLayout(2, 2)
    for call in (lambda: lay.node_of(4), lambda: lay.local_index(-1), lambda: lay.peers(7)):
        with pytest.raises(ValueError, match=r"rank must be an int in \[0, 4\)"):
            call()
    with pytest.raises(ValueError, match=r"node must be an int in \[0, 2\)"):
        lay.ranks_of_node(2)
    with pytest.raises(ValueError, match="must divide evenly over the 4 ranks"):
        lay.node_of_expert(0, 6)


def test_layout_from_host_names_contiguous_equal_nodes():
    lay = layout_from_node_keys(["a", "a", "a", "b", "b", "b"], "hostname")
    assert (lay.ranks_per_node, lay.num_nodes, lay.source) == (3, 2, "hostname")


def test_layout_from_host_names_refuses_interleaved_nodes_and_says_what_is_supported():
    with pytest.raises(ValueError, match=r"node 'a' are not contiguous.*ranks 0\.\.0 and 2\.\.2.*supported layouts"):
        layout_from_node_keys(["a", "b", "a", "b"], "hostname")


def test_layout_from_host_names_refuses_nodes_of_different_sizes():
    with pytest.raises(ValueError, match=r"different numbers of ranks \('a': 3 \(ranks 0\.\.2\), 'b': 1"):
        layout_from_node_keys(["a", "a", "a", "b"], "hostname")


def test_without_a_process_group_the_layout_is_one_process():
    assert node_layout() == NodeLayout(1, 1, source="single process")
    with pytest.raises(ValueError, match="does not divide a single process"):
        node_layout(ranks_per_node=2)


# --- agreed by the ranks of a gloo group ---------------------------------------------------------------------------

@contextmanager
def _environment(values: dict, host: str | None = None):
    """Set (value) or unset (None) environment variables, and optionally the host name, for the body only."""
    old = {k: os.environ.get(k) for k in values}
    real_host = socket.gethostname
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        if host is not None:
            socket.gethostname = lambda: host
        yield
    finally:
        socket.gethostname = real_host
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_NO_LAUNCHER = {"LOCAL_WORLD_SIZE": None, "GROUP_RANK": None}


def _layout_case(rank, world, ranks_per_node, env, hosts):
    """``node_layout`` on every rank with per-rank ``env`` / ``hosts`` (lists by rank, or None); returns the layout's
    fields or ("ValueError", message)."""
    with _environment({**_NO_LAUNCHER, **(env[rank] if env else {})}, hosts[rank] if hosts else None):
        try:
            lay = node_layout(None, ranks_per_node[rank] if isinstance(ranks_per_node, list) else ranks_per_node)
        except ValueError as error:
            return ("ValueError", str(error))
    return (lay.ranks_per_node, lay.num_nodes, lay.source)


def _pool(world):
    from ep_harness import gloo_pool

    return gloo_pool(world)


def test_four_ranks_explicit_ranks_per_node_two_make_two_nodes():
    assert _pool(4).run(_layout_case, 2, None, None) == [(2, 2, "explicit")] * 4


def test_two_ranks_on_one_host_are_one_node():
    assert _pool(2).run(_layout_case, None, None, ["hostA", "hostA"]) == [(2, 1, "hostname")] * 2


def test_four_ranks_on_two_hosts_are_two_nodes_of_two():
    assert _pool(4).run(_layout_case, None, None, ["h0", "h0", "h1", "h1"]) == [(2, 2, "hostname")] * 4


def test_the_launchers_local_world_size_wins_over_host_names():
    # torchrun on two "nodes" of this machine: LOCAL_WORLD_SIZE=2, GROUP_RANK 0 / 1; the hosts all look the same
    env = [{"LOCAL_WORLD_SIZE": 2, "GROUP_RANK": r // 2} for r in range(4)]
    assert _pool(4).run(_layout_case, None, env, ["same"] * 4) == [(2, 2, "launcher")] * 4
    # without GROUP_RANK torchrun's default assignment (global rank // LOCAL_WORLD_SIZE) names the node
    env = [{"LOCAL_WORLD_SIZE": 1} for _ in range(4)]
    assert _pool(4).run(_layout_case, None, env, None) == [(1, 4, "launcher")] * 4


def _every_rank_raised(results, pattern):
    import re

    assert all(r[0] == "ValueError" for r in results), results
    assert len({r[1] for r in results}) == 1, results  # the same message on every rank
    assert re.search(pattern, results[0][1]), results[0][1]


def test_ranks_per_node_that_does_not_divide_the_group_raises_on_every_rank():
    _every_rank_raised(_pool(4).run(_layout_case, 3, None, None), r"ranks_per_node=3 does not divide the group's 4")


def test_ranks_passing_different_ranks_per_node_raise_on_every_rank():
    _every_rank_raised(_pool(4).run(_layout_case, [2, 2, 4, 2], None, None),
                       r"different ranks_per_node \(rank 0: 2, rank 1: 2, rank 2: 4, rank 3: 2\)")


def test_interleaved_hosts_raise_on_every_rank():
    _every_rank_raised(_pool(4).run(_layout_case, None, None, ["h0", "h1", "h0", "h1"]),
                       r"not contiguous.*supported layouts")


def test_local_world_sizes_that_differ_raise_on_every_rank():
    env = [{"LOCAL_WORLD_SIZE": 2}, {"LOCAL_WORLD_SIZE": 2}, {"LOCAL_WORLD_SIZE": 1}, {"LOCAL_WORLD_SIZE": 1}]
    _every_rank_raised(_pool(4).run(_layout_case, None, env, None), r"LOCAL_WORLD_SIZE differs across the ranks")


def test_env_disagreements_name_the_variable_and_the_ranks_on_each_side():
    values = [{"NCCL_NVLS_ENABLE": "0"}, {"NCCL_NVLS_ENABLE": "0"}, {}, {"NCCL_NVLS_ENABLE": "1"}]
    assert env_disagreements(values, ("NCCL_NVLS_ENABLE",)) == [
        "NCCL_NVLS_ENABLE: '0' on ranks 0, 1; unset on ranks 2; '1' on ranks 3"]
    assert env_disagreements([{"A": "x"}] * 3, ("A", "B")) == []
    many = [{"A": "1"}] * 10 + [{"A": "2"}]
    assert env_disagreements(many, ("A",)) == ["A: '1' on ranks 0, 1, 2, 3, 4, 5, 6, 7 and 2 more; '2' on ranks 10"]


def _env_case(rank, world, env):
    with _environment({name: None for name in AGREED_LAUNCH_ENV} | env[rank]):
        try:
            return check_launch_env()
        except ValueError as error:
            return ("ValueError", str(error))


def test_launch_env_that_agrees_passes_and_returns_each_ranks_values():
    env = [{"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}] * 4
    results = _pool(4).run(_env_case, env)
    assert all(r == {**{n: None for n in AGREED_LAUNCH_ENV}, **env[0]} for r in results), results


def test_a_node_launched_with_a_different_environment_raises_on_every_rank():
    # the second "node" (ranks 2, 3) was started without NCCL_NVLS_ENABLE=0 and with another NVSHMEM heap size
    env = [{"NCCL_NVLS_ENABLE": "0", "NVSHMEM_SYMMETRIC_SIZE": "2G"}] * 2 + [{"NVSHMEM_SYMMETRIC_SIZE": "1G"}] * 2
    _every_rank_raised(_pool(4).run(_env_case, env),
                       r"(?s)NCCL_NVLS_ENABLE: '0' on ranks 0, 1; unset on ranks 2, 3.*"
                       r"NVSHMEM_SYMMETRIC_SIZE: '2G' on ranks 0, 1; '1G' on ranks 2, 3")


def test_launch_env_without_a_process_group_is_this_process():
    with _environment({"NCCL_NVLS_ENABLE": "0"}):
        assert check_launch_env(names=("NCCL_NVLS_ENABLE",)) == {"NCCL_NVLS_ENABLE": "0"}
    with pytest.raises(ValueError, match="names must be environment variable names"):
        check_launch_env(names=("",))


# --- bytes across node boundaries ----------------------------------------------------------------------------------

def _brute_force(mask, rank, rpn, nodes, b):
    """Token by token, rank by rank: what each link carries on the hierarchical path and on a flat all-to-all."""
    src_node, src_local = rank // rpn, rank % rpn
    inter = intra = local = flat_inter = flat_intra = deepep = 0
    most = 0
    for t in range(len(mask)):
        dests = [r for r in range(rpn * nodes) if mask[t][r]]
        target_nodes = sorted({r // rpn for r in dests})
        crossed = [n for n in target_nodes if n != src_node]
        most = max(most, len(crossed))
        inter += len(crossed)
        deepep += len(target_nodes)
        for n in target_nodes:
            receiver = n * rpn + src_local  # the source itself on its own node
            intra += sum(1 for r in dests if r // rpn == n and r != receiver)
        local += int(mask[t][rank])
        flat_inter += sum(1 for r in dests if r // rpn != src_node)
        flat_intra += sum(1 for r in dests if r // rpn == src_node and r != rank)
    return dict(internode_bytes=inter * b, intranode_bytes=intra * b, local_bytes=local * b,
                flat_internode_bytes=flat_inter * b, flat_intranode_bytes=flat_intra * b,
                deepep_rdma_bytes=deepep * b, max_nodes_crossed=most)


@pytest.mark.parametrize("nodes,rpn", [(2, 2), (2, 4), (4, 2), (3, 2), (1, 4)])
def test_counted_bytes_equal_a_brute_force_count(nodes, rpn):
    rng = random.Random(nodes * 10 + rpn)
    lay = NodeLayout(rpn, nodes)
    size = lay.group_size
    mask = [[rng.random() < 0.3 for _ in range(size)] for _ in range(50)]
    mask.append([False] * size)  # a token that goes nowhere
    mask.append([True] * size)  # a token to every rank
    b = 7392
    for rank in range(size):
        got = count_node_bytes(torch.tensor(mask), rank, lay, b)
        want = _brute_force(mask, rank, rpn, nodes, b)
        assert {k: getattr(got, k) for k in want} == want, (rank, got)
        assert got.tokens == len(mask) and got.bytes_per_token == b


def test_a_hand_counted_token():
    # 2 nodes x 4 ranks, source rank 1 (node 0, local 1); the token goes to ranks 1, 2 (own node) and 4, 5, 7
    lay = NodeLayout(4, 2)
    mask = torch.zeros(1, 8, dtype=torch.bool)
    mask[0, [1, 2, 4, 5, 7]] = True
    got = count_node_bytes(mask, 1, lay, 10)
    # one crossing (to rank 5, node 1's local 1), which forwards to 4 and 7; on node 0 the source sends to 2
    assert (got.internode_bytes, got.intranode_bytes, got.local_bytes) == (10, 30, 10)
    # flat: three rows off the node (4, 5, 7), one inside it (2); DeepEP counts two (token, node) pairs
    assert (got.flat_internode_bytes, got.flat_intranode_bytes, got.deepep_rdma_bytes) == (30, 10, 20)
    assert got.max_nodes_crossed == 1


def test_a_token_reaching_m_nodes_crosses_at_most_m_boundaries_m_minus_1_with_its_own_node():
    lay = NodeLayout(2, 4)
    # source rank 0 (node 0): token a reaches nodes 1, 2, 3 (M = 3, own node not among them): 3 crossings;
    # token b reaches nodes 0, 1, 2 (M = 3, own node among them): 2 crossings
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, [2, 4, 7]] = True
    mask[1, [1, 3, 5]] = True
    per_token = [count_node_bytes(mask[i:i + 1], 0, lay, 1) for i in range(2)]
    assert [p.max_nodes_crossed for p in per_token] == [3, 2]
    assert [p.deepep_rdma_bytes for p in per_token] == [3, 3]


def test_counts_from_topk_match_counts_from_the_mask_and_sum_over_ranks():
    lay = NodeLayout(2, 3)
    g = torch.Generator().manual_seed(0)
    topk = torch.stack([torch.randperm(24, generator=g)[:4] for _ in range(40)])
    topk[0, 1] = -1  # a dropped slot
    mask = is_token_in_rank_from_topk(topk, 24, 6)
    want = [[any(int(e) >= 0 and int(e) // 4 == r for e in row) for r in range(6)] for row in topk]
    assert mask.tolist() == want
    total = None
    for rank in range(6):
        got = node_bytes_from_topk(topk, 24, rank, lay, 3)
        assert got == count_node_bytes(mask, rank, lay, 3)
        total = got if total is None else total + got
    assert total.tokens == 240 and total.internode_bytes == sum(
        count_node_bytes(mask, r, lay, 3).internode_bytes for r in range(6))


def test_hierarchical_crossings_never_exceed_the_flat_all_to_alls():
    lay = NodeLayout(4, 2)
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(200, 8, generator=g) < 0.5
    for rank in range(8):
        got = count_node_bytes(mask, rank, lay, 1)
        assert got.internode_bytes <= got.flat_internode_bytes
        assert got.internode_bytes + got.intranode_bytes + got.local_bytes >= got.flat_internode_bytes


def test_bad_byte_count_inputs_are_refused():
    lay = NodeLayout(2, 2)
    with pytest.raises(ValueError, match=r"must be a \[tokens, 4\] tensor"):
        count_node_bytes(torch.zeros(3, 5, dtype=torch.bool), 0, lay, 1)
    with pytest.raises(ValueError, match="bytes_per_token must be an int >= 1"):
        count_node_bytes(torch.zeros(3, 4, dtype=torch.bool), 0, lay, 0)
    with pytest.raises(ValueError, match=r"expert ids in \[0, 8\) or -1"):
        is_token_in_rank_from_topk(torch.tensor([[8]]), 8, 4)


def test_token_bytes_fp8_and_bf16():
    assert token_bytes(7168, fp8=True) == 7168 + 56 * 4 == 7392  # DeepEP's (1 + 4/128) / 2 of the BF16 row
    assert token_bytes(7168, fp8=False) == 14336
    assert token_bytes(7168, fp8=True) == 14336 * (1 + 4 / 128) / 2
    assert token_bytes(200, fp8=True) == 200 + 2 * 4  # a partial 128-block still has a scale


def test_combinations_of_small_layouts_all_agree_with_the_brute_force():
    # every mask of 2 x 2 ranks (16 patterns) from every source rank
    lay = NodeLayout(2, 2)
    masks = [list(bits) for bits in itertools.product([False, True], repeat=4)]
    for rank in range(4):
        got = count_node_bytes(torch.tensor(masks), rank, lay, 5)
        want = _brute_force(masks, rank, 2, 2, 5)
        assert {k: getattr(got, k) for k in want} == want
