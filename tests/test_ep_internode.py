"""The hierarchical transport (`smsplit.ep.hierarchical`) on emulated nodes: gloo processes, each N consecutive ranks
one node, driven directly (handle and `Tokens` made here as `Buffer` makes them), against a single-process oracle.

Every rank builds the inputs of all ranks from one seed and checks its own results against oracles that walk over
the tokens of all ranks one by one (`expected_dispatch`, `expected_combine`: the per-node fp32 sums rounded to the
values' dtype, then their fp32 sum in node order), FP8 against `oracles.quantize_1x128` (no smsplit code), the
counted traffic against `smsplit.nodes.count_node_bytes`, and the message log against the rules of the path.
Many cases run per pool call (process starts and group set-up dominate on a 2-core machine).
"""

import time

import pytest
import torch
import torch.distributed as dist

import oracles
from ep_harness import gloo_pool, run_ranks_on_one_gpu
from smsplit.ep import EPArgumentError, EPError, EPTimeoutError, registry
from smsplit.ep.hierarchical import HierarchicalTransport
from smsplit.ep.hierarchical_plan import HierarchicalState
from smsplit.ep.layout import DispatchHandle, compute_dispatch_layout
from smsplit.ep.reference import ReferenceTransport
from smsplit.ep.transport import Tokens
from smsplit.nodes import NodeLayout, count_node_bytes

HIDDEN = 256


# -- inputs and oracles ---------------------------------------------------------------------------------------

def make_inputs(seed, R, P, num_tokens, num_experts, k, routing, drop=0.15):
    """Per-rank (x bf16, topk_idx, topk_weights). ``routing``: "unrestricted"; "limited" (each token's experts on at
    most 2 nodes, chosen per token); "empty_node" (no expert on the last node); "one_node" (every expert on node
    1, or on node 0 where it is the only one)."""
    g = torch.Generator().manual_seed(seed)
    N = R // P
    per_node = num_experts // N
    inputs = []
    for r in range(R):
        n = num_tokens[r]
        x = (torch.randn(n, HIDDEN, generator=g) * (r + 1)).to(torch.bfloat16)
        if routing == "unrestricted":
            choices = torch.rand(n, num_experts, generator=g).argsort(dim=1)[:, :k]
        else:
            if routing == "limited":
                nodes = torch.rand(n, N, generator=g).argsort(dim=1)[:, :min(2, N)]
            elif routing == "empty_node":
                nodes = torch.rand(n, N - 1, generator=g).argsort(dim=1)[:, :min(2, N - 1)]
            else:  # one_node
                nodes = torch.full((n, 1), min(1, N - 1), dtype=torch.int64)
            allowed = (nodes[:, :, None] * per_node + torch.arange(per_node)).flatten(1)  # [n, nodes * per_node]
            pick = torch.rand(allowed.shape, generator=g).argsort(dim=1)[:, :k]
            choices = allowed.gather(1, pick)
        topk = choices.to(torch.int64)
        topk[torch.rand(n, k, generator=g) < drop] = -1
        inputs.append((x, topk, torch.rand(n, k, generator=g)))
    return inputs


def targets(topk_row, q, local):
    return [int(e) >= 0 and int(e) // local == q for e in topk_row]


def expected_dispatch(inputs, rank, R, num_experts):
    """The rows this rank receives (source rank, then token order): x, local top-k ids, raw weights, (source,
    token)."""
    local = num_experts // R
    rows, idx, weights, src = [], [], [], []
    for s, (x, topk, w) in enumerate(inputs):
        for t in range(x.size(0)):
            mine = targets(topk[t], rank, local)
            if any(mine):
                rows.append(x[t])
                idx.append([int(e) - rank * local if m else -1 for e, m in zip(topk[t], mine)])
                weights.append(w[t])
                src.append((s, t))
    k = inputs[0][1].size(1)
    recv_x = torch.stack(rows) if rows else torch.empty(0, HIDDEN, dtype=torch.bfloat16)
    recv_w = torch.stack(weights) if weights else torch.empty(0, k)
    return recv_x, torch.tensor(idx, dtype=torch.int64).view(-1, k), recv_w, src


def expected_combine(inputs, rank, R, P, num_experts, output_of):
    """The two-level sum of rank ``rank``'s tokens: per node, the fp32 sum in local-index order of what each of its
    ranks returns (``output_of(q, token's x)`` and the weights of q's experts), x rounded to its dtype; then the
    fp32 sum of the nodes' rows in node order."""
    local = num_experts // R
    x, topk, w = inputs[rank]
    out = torch.zeros(x.shape, dtype=torch.float32)
    out_w = torch.zeros(w.shape, dtype=torch.float32)
    for t in range(x.size(0)):
        for m in range(R // P):
            node_x = torch.zeros(x.size(1), dtype=torch.float32)
            node_w = torch.zeros(w.size(1), dtype=torch.float32)
            hit = False
            for j in range(P):
                q = m * P + j
                mine = targets(topk[t], q, local)
                if any(mine):
                    hit = True
                    node_x += output_of(q, x[t]).float()
                    node_w += torch.where(torch.tensor(mine), w[t], torch.zeros(()))
            if hit:
                out[t] += node_x.to(x.dtype).float()
                out_w[t] += node_w
    return out, out_w


def flat_combine(inputs, rank, R, num_experts, output_of):
    """The reference transport's sum: the fp32 sum over receiving ranks in rank order."""
    local = num_experts // R
    x, topk, w = inputs[rank]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.size(0)):
        for q in range(R):
            if any(targets(topk[t], q, local)):
                out[t] += output_of(q, x[t]).float()
    return out


def node_counts_of(inputs, R, P, num_experts):
    """[s][m]: tokens of rank s with an expert on node m (an independent count)."""
    per_node = num_experts // (R // P)
    return [[sum(any(int(e) >= 0 and int(e) // per_node == m for e in row) for row in topk.tolist())
             for m in range(R // P)] for _, topk, _ in inputs]


def make_handle(rank, R, inputs, num_experts, num_worst_tokens, device):
    """A handle as `Buffer` makes it for an uncached dispatch, and the header's counts."""
    counts = [oracles.dispatch_layout(topk, num_experts, R)[0] for _, topk, _ in inputs]
    topk = inputs[rank][1]
    in_rank = compute_dispatch_layout(topk, num_experts, R)[2].to(device)
    handle = DispatchHandle(buffer_id=0, rank=rank, num_ranks=R, is_token_in_rank=in_rank,
                            rank_prefix_matrix=torch.empty(0, dtype=torch.int32, device=device),
                            recv_src_idx=torch.empty(0, dtype=torch.int32, device=device),
                            num_recv_tokens=sum(row[rank] for row in counts), num_worst_tokens=num_worst_tokens,
                            num_local_experts=num_experts // R, hidden=HIDDEN, transport="hierarchical")
    return handle, counts


def transports(group, device, P, chunk_tokens, timeout_s=20.0):
    reference = ReferenceTransport(group, device, timeout_s)
    return reference, HierarchicalTransport(reference, NodeLayout(P, group.size() // P), chunk_tokens)


def expected_row_bytes(mode, k, cached=False):
    values = HIDDEN + HIDDEN // 128 * 4 if mode in ("fp8", "e4m3") else HIDDEN * 2
    return values + k * 8 + k * 4 + (0 if cached else 4)


def poison(tensors):
    for t in tensors:
        if t is not None:
            t.fill_(float("nan") if t.is_floating_point() else -7)


# -- one case on every rank ---------------------------------------------------------------------------------------

class Joined:
    """One work for a whole batch, as NCCL's coalesced `batch_isend_irecv` returns it."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for work in self.works:
            work.wait(timeout) if timeout is not None else work.wait()
        return True

    def is_completed(self):
        return all(work.is_completed() for work in self.works)


def check_case(rank, R, group, device, P, seed, num_tokens, num_experts, k, routing, mode, num_worst_tokens,
               chunk_tokens, with_node_counts, log=False, against_reference=False, staged=False, coalesced=False):
    """`check_case_on` with ``coalesced``: `batch_isend_irecv` returning one work per batch of several messages,
    as on NCCL (the transports' waits for such a work), with gloo's messages."""
    if not coalesced:
        return check_case_on(rank, R, group, device, P, seed, num_tokens, num_experts, k, routing, mode,
                             num_worst_tokens, chunk_tokens, with_node_counts, log, against_reference, staged)
    original = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: [Joined(original(ops))] if len(ops) > 1 else original(ops)
    try:
        return check_case_on(rank, R, group, device, P, seed, num_tokens, num_experts, k, routing, mode,
                             num_worst_tokens, chunk_tokens, with_node_counts, log, against_reference, staged)
    finally:
        dist.batch_isend_irecv = original


def check_case_on(rank, R, group, device, P, seed, num_tokens, num_experts, k, routing, mode, num_worst_tokens,
                  chunk_tokens, with_node_counts, log=False, against_reference=False, staged=False):
    """Dispatch (uncached, then cached with new values), combine, on a fresh transport pair; returns this rank's
    traffic: (dispatch internode rows, intranode rows, combine internode rows, intranode rows) and, with ``log``, the
    message log."""
    reference, hier = transports(group, device, P, chunk_tokens)
    if staged:  # the path of CUDA tensors on a gloo group (received into host buffers, then copied), on the host
        hier._staged = True
    layout = hier.nodes
    if log:
        hier.message_log = []
    inputs = make_inputs(seed, R, P, num_tokens, num_experts, k, routing)
    x, topk, w = inputs[rank]
    handle, counts = make_handle(rank, R, inputs, num_experts, num_worst_tokens, device)
    ref_x, ref_idx, ref_w, ref_src = expected_dispatch(inputs, rank, R, num_experts)
    n_recv = ref_x.size(0)
    rows = num_worst_tokens or n_recv
    N = R // P
    if routing == "empty_node" and rank // P == N - 1 or routing == "one_node" and rank // P != min(1, N - 1):
        assert n_recv == 0  # (the case is what it says: this node receives nothing)
    if mode == "e4m3":
        values, scales = (t.to(device) for t in oracles.quantize_1x128(x))
    else:
        values, scales = x.to(device), None
    node_counts = node_counts_of(inputs, R, P, num_experts) if with_node_counts else None
    assert hier.tokens_per_node(handle.is_token_in_rank) == node_counts_of(inputs, R, P, num_experts)[rank]
    tokens = Tokens(values, scales, topk.to(device), w.to(device), quantize=(mode == "fp8"),
                    num_local_experts=num_experts // R, counts=counts, node_counts=node_counts)
    got = hier.dispatch(handle, tokens, num_sms=1)

    # received rows and the handle against the oracle
    if mode in ("fp8", "e4m3"):
        ref_fp8, ref_scales = oracles.quantize_1x128(ref_x)
        assert got.values.dtype == torch.float8_e4m3fn and got.values.shape == (rows, HIDDEN)
        assert torch.equal(got.values[:n_recv].cpu().view(torch.uint8), ref_fp8.view(torch.uint8))
        assert torch.equal(got.scales[:n_recv].cpu(), ref_scales)
        assert not got.values[n_recv:].cpu().view(torch.uint8).any() and not got.scales[n_recv:].any()
        received = oracles.dequantize_1x128(got.values.cpu(), got.scales.cpu(), torch.bfloat16)
    else:
        assert got.scales is None and got.values.dtype == torch.bfloat16 and got.values.shape == (rows, HIDDEN)
        assert torch.equal(got.values[:n_recv].cpu(), ref_x) and not got.values[n_recv:].any()
        received = got.values.cpu()
    assert torch.equal(got.topk_idx[:n_recv].cpu(), ref_idx) and bool((got.topk_idx[n_recv:] == -1).all())
    assert torch.equal(got.topk_weights[:n_recv].cpu(), ref_w) and not got.topk_weights[n_recv:].any()
    assert handle.recv_src_idx.tolist() == [t for _, t in ref_src] + [-1] * (rows - n_recv)
    assert handle.rank_prefix_matrix.cpu().tolist() == torch.tensor(counts).cumsum(0).tolist()
    assert isinstance(handle.transport_state, HierarchicalState)

    # counted traffic: per source rank, the oracle's count (rows x the row size of this call)
    row_bytes = expected_row_bytes(mode, k)
    traffic = hier.last_traffic
    want = count_node_bytes(handle.is_token_in_rank.cpu(), rank, layout, row_bytes)
    assert (traffic.op, traffic.row_bytes) == ("dispatch", row_bytes)
    assert traffic.internode_bytes == want.internode_bytes == traffic.internode_rows * row_bytes
    assert traffic.local_rows * row_bytes == want.local_bytes
    assert traffic.intranode_bytes == traffic.intranode_rows * row_bytes
    assert traffic.max_nodes_crossed == want.max_nodes_crossed
    if routing != "unrestricted":
        assert traffic.max_nodes_crossed <= 2
    dispatch_counts = (traffic.internode_rows, traffic.intranode_rows, want.intranode_bytes // row_bytes)

    # the flat reference transport on the same inputs, with a handle of its own: the same everything (on the host:
    # it sends its tensors through the group as they are)
    if against_reference and device.type == "cpu":
        flat_handle, _ = make_handle(rank, R, inputs, num_experts, num_worst_tokens, device)
        flat_values, flat_scales = values, scales
        if mode == "fp8":
            flat_values, flat_scales = (t.to(device) for t in oracles.quantize_1x128(x))
        flat = reference.dispatch(flat_handle, Tokens(flat_values, flat_scales, topk.to(device), w.to(device),
                                                      num_local_experts=num_experts // R, counts=counts), num_sms=1)
        for mine, theirs in zip((got.values, got.scales, got.topk_idx, got.topk_weights),
                                (flat.values, flat.scales, flat.topk_idx, flat.topk_weights)):
            assert (mine is None) == (theirs is None)
            if mine is not None:
                assert torch.equal(mine.view(torch.uint8) if mine.dtype == torch.float8_e4m3fn else mine,
                                   theirs.view(torch.uint8) if theirs.dtype == torch.float8_e4m3fn else theirs)
        assert torch.equal(handle.recv_src_idx, flat_handle.recv_src_idx)
        assert torch.equal(handle.rank_prefix_matrix, flat_handle.rank_prefix_matrix)

    # combine: rank q returns its rows times (q + 1), its weights where its experts are
    def output_of(q, row):
        return row * (q + 1)

    if mode in ("fp8", "e4m3"):
        own_inputs = [(oracles.fake_quantize_1x128(xi), ti, wi) for xi, ti, wi in inputs]
    else:
        own_inputs = inputs
    x_back = (received * (rank + 1)).to(device)
    w_back = got.topk_weights.masked_fill(got.topk_idx < 0, 0.0)
    combined, combined_w = hier.combine(handle, x_back, w_back, num_sms=1)
    want_x, want_w = expected_combine(own_inputs, rank, R, P, num_experts, output_of)
    assert combined.dtype == torch.float32 and torch.equal(combined.cpu(), want_x)
    assert torch.equal(combined_w.cpu(), want_w)
    traffic = hier.last_traffic
    combine_row = HIDDEN * 2 + k * 4
    assert (traffic.op, traffic.row_bytes) == ("combine", combine_row)
    assert traffic.internode_bytes == traffic.internode_rows * combine_row
    assert traffic.intranode_bytes == traffic.intranode_rows * combine_row
    assert traffic.local_rows == want.local_bytes // row_bytes  # (own tokens' rows: the dispatch's)
    assert traffic.max_nodes_crossed == want.max_nodes_crossed
    combine_counts = (traffic.internode_rows, traffic.intranode_rows)
    # weights only
    none_x, only_w = hier.combine(handle, None, w_back, num_sms=1)
    assert none_x is None and torch.equal(only_w.cpu(), want_w)

    # the reference transport reads this layout: its combine (a flat fp32 sum) and a cached dispatch (it sends
    # CPU tensors on gloo: not with CUDA tensors on a gloo group, which this transport stages through the host)
    on_host = device.type == "cpu"
    if on_host:
        flat_x, _ = reference.combine(handle, x_back, w_back, num_sms=1)
        assert torch.equal(flat_x.cpu(), flat_combine(own_inputs, rank, R, num_experts, output_of))

    # cached dispatch with new values on the same layout, outputs of the first round poisoned
    poison([got.values, got.scales, got.topk_idx, got.topk_weights, combined, combined_w, x_back, w_back])
    new_inputs = [((torch.randn(xi.shape, generator=torch.Generator().manual_seed(seed + 1000 + r)) * 3)
                   .to(torch.bfloat16), ti, wi) for r, (xi, ti, wi) in enumerate(inputs)]
    x_new = new_inputs[rank][0]
    cached = hier.dispatch(handle, Tokens(x_new.to(device), None, None, None, quantize=(mode == "fp8")), num_sms=1)
    assert cached.topk_idx is None and cached.topk_weights is None
    assert hier.last_traffic.row_bytes == expected_row_bytes("fp8" if mode == "fp8" else "bf16", 0, cached=True)
    new_ref = expected_dispatch(new_inputs, rank, R, num_experts)[0]
    if mode == "fp8":
        new_fp8, new_scales = oracles.quantize_1x128(new_ref)
        assert torch.equal(cached.values[:n_recv].cpu().view(torch.uint8), new_fp8.view(torch.uint8))
        assert torch.equal(cached.scales[:n_recv].cpu(), new_scales)
    else:
        assert torch.equal(cached.values[:n_recv].cpu(), new_ref)
    if on_host:
        flat_cached = reference.dispatch(handle, Tokens(*((t.to(device) for t in oracles.quantize_1x128(x_new))
                                                          if mode == "fp8" else (x_new.to(device), None))),
                                         num_sms=1)
        if mode == "fp8":
            assert torch.equal(cached.values.view(torch.uint8), flat_cached.values.view(torch.uint8))
            assert torch.equal(cached.scales, flat_cached.scales)
        else:
            assert torch.equal(cached.values, flat_cached.values)
    assert not cached.values[n_recv:].cpu().view(torch.uint8).any()
    # weights only (the backward of a combine carries them back along the layout)
    weights_only = hier.dispatch(handle, Tokens(None, None, None, w.to(device)), num_sms=1)
    assert weights_only.values is None and torch.equal(weights_only.topk_weights[:n_recv].cpu(), ref_w)
    assert not weights_only.topk_weights[n_recv:].any()
    return dispatch_counts + combine_counts + ((hier.message_log,) if log else ())


def case_many(rank, R, specs):
    """`check_case` for each spec, on the pool's world group (CPU tensors); the results by spec."""
    return [check_case(rank, R, dist.group.WORLD, torch.device("cpu"), **spec) for spec in specs]


def check_totals(specs, results, R):
    """Summed over the ranks: the forwarded rows and the returned rows are the oracle's intranode rows, and the
    combine's network rows (one per token and node) are the dispatch's. Some rows crossed the network and some were
    forwarded where the layout has both legs (so that the checks checked something)."""
    moved = [0, 0]
    for i, spec in enumerate(specs):
        per_rank = [results[r][i] for r in range(R)]
        d_inter, d_intra, want_intra, c_inter, c_intra = (sum(v[j] for v in per_rank) for j in range(5))
        assert d_intra == want_intra == c_intra, spec
        assert c_inter == d_inter, spec
        moved[0] += d_inter
        moved[1] += d_intra
    P = specs[0]["P"]
    assert (moved[0] > 0) == (P < R) and (moved[1] > 0) == (P > 1), moved


def specs_for(P, R, seed):
    """Cases for one pool: routings, dtypes, top-k 1 and 9, num_worst_tokens, chunk sizes."""
    num_experts = R * max(3, -(-9 // P))  # (top-9 fits on one node's experts)
    out = []
    for i, (routing, mode, k, worst, chunk, node_counts) in enumerate([
            ("unrestricted", "bf16", 3, 0, 4, False),
            ("limited", "fp8", 9, 0, 3, True),
            ("empty_node", "e4m3", 1, 0, 5, False),
            ("one_node", "bf16", 9, 80, 2, True),
            ("limited", "bf16", 1, 64, 128, False),
            ("unrestricted", "fp8", 4, 90, 7, False)]):
        g = torch.Generator().manual_seed(seed + i)
        num_tokens = torch.randint(0, 14, (R,), generator=g).tolist()
        num_tokens[i % R] = 0  # a rank that sends nothing
        out.append(dict(P=P, seed=seed + i, num_tokens=num_tokens, num_experts=num_experts, k=min(k, num_experts),
                        routing=routing, mode=mode, num_worst_tokens=worst, chunk_tokens=chunk,
                        with_node_counts=node_counts, against_reference=(i == 0), staged=(i == 2),
                        coalesced=(i == 1)))
    return out


# -- tests ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("R,P", [(4, 2), (8, 4), (8, 2), (6, 2)], ids=["2x2", "2x4", "4x2", "3x2"])
def test_dispatch_and_combine_match_the_oracle(R, P):
    specs = specs_for(P, R, seed=10 * R + P)
    results = gloo_pool(R).run(case_many, specs)
    check_totals(specs, results, R)


@pytest.mark.parametrize("P", [1, 4], ids=["4x1", "1x4"])
def test_every_rank_a_node_and_one_node(P):
    """Each rank its own node (every copy crosses the network, none is forwarded: the issue's measurement layout on
    a machine of one GPU per emulated node), and one node of four (no network leg)."""
    R = 4
    specs = [spec for spec in specs_for(P, R, seed=90 + P) if spec["routing"] != "empty_node" or P < R][:4]
    results = gloo_pool(R).run(case_many, specs)
    check_totals(specs, results, R)
    for per_rank in results:
        for d_inter, d_intra, _, c_inter, c_intra in per_rank:
            if P == 1:
                assert d_intra == c_intra == 0
            else:
                assert d_inter == c_inter == 0


def test_the_message_log_follows_the_path():
    """2x2 and 3x2 with chunks of 3 tokens: network messages only between same-local-index ranks of different
    nodes, node messages only inside a node, each token at most once per target node, every chunk of a source
    forwarded before its next chunk has landed."""
    for R, P in [(4, 2), (6, 2)]:
        specs = [dict(P=P, seed=5 + R, num_tokens=[17] * R, num_experts=R * 3, k=4, routing="unrestricted",
                      mode="fp8", num_worst_tokens=0, chunk_tokens=3, with_node_counts=False, log=True)]
        results = gloo_pool(R).run(case_many, specs)
        inputs = make_inputs(5 + R, R, P, [17] * R, R * 3, 4, "unrestricted")
        per_node_experts = R * 3 // (R // P)
        saw_pipelining = False
        for rank in range(R):
            full_log = results[rank][0][-1]
            node, local = divmod(rank, P)
            assert [m.order for m in full_log] == list(range(len(full_log)))
            assert {m.op for m in full_log} == {"dispatch", "combine"}
            for m in full_log:
                if m.phase in ("network", "sums", "masks"):
                    assert m.peer % P == local and m.peer // P != node, m
                elif m.phase in ("forward", "return", "chunk counts"):
                    assert m.peer // P == node and m.peer != rank, m
            log = full_log[:next(i for i, m in enumerate(full_log) if m.op == "combine")]  # the uncached dispatch
            # each token at most once per target node: the network chunks to node m are the chunks of one list
            topk = inputs[rank][1]
            for m_node in range(R // P):
                if m_node == node:
                    continue
                want = sum(any(int(e) >= 0 and int(e) // per_node_experts == m_node for e in row)
                           for row in topk.tolist())
                sent = [m for m in log if m.op == "dispatch" and m.phase == "network" and m.kind == "send"
                        and m.event == "posted" and m.peer // P == m_node]
                assert sum(m.rows for m in sent) == want
                assert sorted(m.chunk for m in sent) == list(range(-(-want // 3)))
                assert all(m.rows == min(3, want - 3 * m.chunk) for m in sent)
            # forwarded before the next chunk of the same source has landed
            landed = {(m.source, m.chunk): m.order for m in log if m.op == "dispatch" and m.phase == "network"
                      and m.kind == "recv" and m.event == "completed"}
            for (source, chunk), order in landed.items():
                forwards = [m.order for m in log if m.op == "dispatch" and m.phase == "forward" and m.kind == "send"
                            and m.event == "posted" and m.source == source and m.chunk == chunk]
                assert all(f > order for f in forwards)
                if forwards and (source, chunk + 1) in landed:
                    assert max(forwards) < landed[(source, chunk + 1)]
                    saw_pipelining = True
        assert saw_pipelining
        # between any pair, the receiver posts its receives in the order the sender posts the sends (NCCL matches
        # point-to-point messages in order; gloo's tags would hide a swap of two messages of one phase and stage)
        logs = [results[rank][0][-1] for rank in range(R)]
        for a in range(R):
            for b in range(R):
                sent = [(m.op, m.phase, m.chunk, m.source, m.bytes) for m in logs[a]
                        if m.kind == "send" and m.event == "posted" and m.peer == b]
                received = [(m.op, m.phase, m.chunk, m.source, m.bytes) for m in logs[b]
                            if m.kind == "recv" and m.event == "posted" and m.peer == a]
                assert sent == received, (a, b)


class Hung(Exception):
    pass


def case_lost_peer(rank, R, P, lost, timeout_s):
    """Rank `lost` makes the notify rounds, then never sends its second network chunk (it sleeps past the others'
    timeout_s); the others' outcome: (exception type, message, peer, seconds)."""
    group = dist.new_group(list(range(R)), backend="gloo")  # (its connections break; the world's stay usable)
    reference, hier = transports(group, torch.device("cpu"), P, chunk_tokens=2, timeout_s=timeout_s)
    num_experts = R * 2
    inputs = make_inputs(3, R, P, [12] * R, num_experts, num_experts, "unrestricted", drop=0.0)  # every rank
    handle, counts = make_handle(rank, R, inputs, num_experts, 0, torch.device("cpu"))
    x, topk, w = inputs[rank]
    if rank == lost:
        stage = hier._stage

        def hang(op, index, ops):
            if any(o.phase == "network" for o in ops) and index == 1:
                time.sleep(timeout_s + 1.5)
                raise Hung
            return stage(op, index, ops)

        hier._stage = hang
    start = time.monotonic()
    try:
        hier.dispatch(handle, Tokens(x, None, topk, w, num_local_experts=2, counts=counts), num_sms=1)
    except Hung:
        return None
    except (EPTimeoutError, EPError) as error:
        elapsed = time.monotonic() - start
        with pytest.raises(EPError, match="unusable after an earlier failure"):
            hier.dispatch(handle, Tokens(x, None, topk, w, num_local_experts=2, counts=counts), num_sms=1)
        return type(error).__name__, str(error), getattr(error, "peer", None), elapsed
    assert rank == lost, "the dispatch did not notice the lost peer"
    return None


def test_a_missing_peer_is_named_with_its_node_and_phase_at_timeout_s():
    timeout_s, R, P, lost = 2.0, 4, 2, 1
    results = gloo_pool(R).run(case_lost_peer, P, lost, timeout_s, timeout_s=timeout_s + 30)
    for rank in range(R):
        if rank == lost:
            continue
        kind, message, peer, elapsed = results[rank]
        # the ranks that wait for the lost one time out; rank 2 waits for rank 0, which may give up first and close
        # its connection (gloo does): then rank 2's wait fails at once, an EPError naming the same peer and phase
        assert kind == "EPTimeoutError" or (rank == 2 and kind == "EPError"), (rank, message)
        assert f"rank {peer} (node {peer // P})" in message and message.startswith("dispatch: "), message
        # (an EPError comes when rank 0 gives up: timeout_s after rank 0 started, which may be before this rank did)
        assert timeout_s - (1.0 if kind == "EPError" else 0.0) <= elapsed <= timeout_s + 4.0, (rank, elapsed)
    # rank 3 (node 1, local 1) waits for the lost rank's second chunk over the network
    assert results[3][1].startswith("dispatch: network: waiting for chunk 1 of its tokens from rank 1 (node 0) "
                                    "(no answer within timeout_s=2)"), results[3][1]
    # rank 0 (the lost rank's node) waits for the rows of the lost rank's own chunk 1 it forwards
    assert results[0][2] == lost and "forward: waiting for chunk 1 of its tokens from rank 1 (node 0)" in \
        results[0][1], results[0][1]


def case_aborting_peer(rank, R, P, lost, timeout_s):
    """Rank `lost` fails on its own (`ReferenceTransport.abort`, as `Buffer` does for an error only it raised)
    instead of dispatching; the others, waiting in the hierarchical dispatch, raise `EPAbortError` at once through
    the reference transport's shared memory. Returns (exception type, message, peer, seconds) or None for `lost`."""
    from smsplit.ep import EPAbortError

    group = dist.new_group(list(range(R)), backend="gloo")
    reference, hier = transports(group, torch.device("cpu"), P, chunk_tokens=4, timeout_s=timeout_s)
    reference.exchange_headers("dispatch", "counts", torch.zeros(R, 2, dtype=torch.int64))  # (sets up the file)
    assert reference.one_node
    if rank == lost:
        time.sleep(0.5)
        reference.abort(lost, "boom: an error of this rank alone", inside_call=True)
        return None
    num_experts = R * 2
    inputs = make_inputs(4, R, P, [6] * R, num_experts, num_experts, "unrestricted", drop=0.0)
    handle, counts = make_handle(rank, R, inputs, num_experts, 0, torch.device("cpu"))
    x, topk, w = inputs[rank]
    start = time.monotonic()
    with pytest.raises(EPAbortError) as error:
        hier.dispatch(handle, Tokens(x, None, topk, w, num_local_experts=2, counts=counts), num_sms=1)
    return type(error.value).__name__, str(error.value), error.value.peer, time.monotonic() - start


def test_an_aborting_peer_is_named_at_once():
    R, P, lost, timeout_s = 4, 2, 2, 30.0
    results = gloo_pool(R).run(case_aborting_peer, P, lost, timeout_s, timeout_s=timeout_s + 30)
    for rank in range(R):
        if rank == lost:
            assert results[rank] is None
            continue
        kind, message, peer, elapsed = results[rank]
        assert peer == lost and "rank 2 failed: boom: an error of this rank alone" in message, message
        assert message.startswith("dispatch: "), message
        assert elapsed < 5.0, (rank, elapsed)


def case_bad_layouts(rank, R):
    reference = ReferenceTransport(dist.group.WORLD, torch.device("cpu"), 5.0)
    out = []
    for nodes in (3, NodeLayout(2, 3), 0, "2"):
        with pytest.raises(ValueError) as error:
            HierarchicalTransport(reference, nodes)
        out.append(str(error.value))
    with pytest.raises(ValueError, match="chunk_tokens"):
        HierarchicalTransport(reference, 2, chunk_tokens=0)
    with pytest.raises(EPArgumentError, match="node layout"):
        registry.make("hierarchical", dist.group.WORLD, torch.device("cpu"), 5.0, 0)
    made = registry.make("hierarchical", dist.group.WORLD, torch.device("cpu"), 5.0, 0, nodes=2,
                         reference=reference, chunk_tokens=16)
    assert isinstance(made, HierarchicalTransport) and made.nodes == NodeLayout(2, 2) and made.chunk_tokens == 16
    assert reference.failure is None  # nothing moved, nothing failed
    return out


def test_layouts_that_cannot_work_raise_value_error_before_anything_moves():
    messages = gloo_pool(4).run(case_bad_layouts)[0]
    assert "ranks_per_node=3 does not divide the group's 4 ranks" in messages[0]
    assert "3 nodes x 2 ranks does not fit the group's 4 ranks" in messages[1]
    assert "ranks_per_node=0" in messages[2] and "NodeLayout" in messages[3]


def test_the_registry_names_the_hierarchical_transport_and_auto_takes_it_only_across_nodes():
    from smsplit.ep.transport import Environment, Move

    assert registry.BACKENDS[-1] == "hierarchical"  # (a name's index is its code in the constructor's header)
    assert registry.ORDER[-2:] == ("hierarchical", "reference")
    caps = registry.capabilities("hierarchical")
    assert torch.float8_e4m3fn in caps.moves and torch.bfloat16 in caps.quantizes and not caps.needs_cuda
    assert caps.capture == "never" and caps.weights_only and not caps.one_node and not caps.needs_buffer
    assert caps.hierarchical
    cpu = Environment(cuda=False, one_node=True, num_ranks=4, num_nvl_bytes=0, device_sms=0)
    gpu = Environment(cuda=True, one_node=True, num_ranks=4, num_nvl_bytes=1 << 30, device_sms=132)
    move = Move("dispatch", torch.bfloat16, hidden=256, num_topk=2, max_tokens=8)
    assert registry.choose("auto", move, cpu) == "reference"
    assert registry.choose("auto", move, cpu._replace(num_nodes=2)) == "hierarchical"
    assert registry.choose("auto", move, gpu) == "nvlink_copy_engine"
    assert registry.choose("auto", move, gpu._replace(num_nodes=2)) == "hierarchical"  # (emulated nodes too)
    refused = registry.environment_problem("nvlink", gpu._replace(num_nodes=2))
    assert refused.argument == "backend" and "use backend='hierarchical'" in str(refused)


# -- one GPU: ranks sharing it, the exchange staged through the host -------------------------------------------------

def gpu_ranks(rank, R, group, P):
    device = torch.device("cuda", 0)
    out = [check_case(rank, R, group, device, **spec) for spec in specs_for(P, R, seed=77)[:4]]
    hier = transports(group, device, P, chunk_tokens=4)[1]
    assert hier._staged  # (CUDA tensors on a gloo group: every message copied through the host)
    return out


@pytest.mark.gpu
def test_on_one_gpu_with_ranks_sharing_it_staged_through_the_host():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    R, P = 4, 2
    specs = specs_for(P, R, seed=77)[:4]
    results = run_ranks_on_one_gpu(R, gpu_ranks, P, timeout_s=300)
    check_totals(specs, results, R)


def test_nccl_options_refuse_counts_nccl_cannot_take():
    from smsplit.ep.hierarchical import nccl_options

    if not torch.distributed.is_nccl_available():
        with pytest.raises(RuntimeError, match="no NCCL"):
            nccl_options(12)
        return
    for bad in (0, 65, True, 2.0):
        with pytest.raises(ValueError, match="max_ctas"):
            nccl_options(bad)
    with pytest.raises(ValueError, match="exceeds"):
        nccl_options(4, 8)


@pytest.mark.gpu
def test_an_nccl_group_made_with_capped_ctas_runs():
    """`nccl_options` builds options torch's NCCL process group accepts (a one-rank group, its config read back)."""
    import subprocess
    import sys

    code = (
        "import torch, torch.distributed as dist\n"
        "from smsplit.ep.hierarchical import nccl_options\n"
        "opts = nccl_options(4, 2)\n"
        "assert (opts.config.max_ctas, opts.config.min_ctas) == (4, 2)\n"
        "torch.cuda.set_device(0)\n"
        "dist.init_process_group('nccl', rank=0, world_size=1, store=dist.HashStore(), pg_options=opts, "
        "device_id=torch.device('cuda', 0))\n"
        "t = torch.ones(4, device='cuda')\n"
        "dist.all_reduce(t)\n"
        "assert t.tolist() == [1.0] * 4\n"
        "dist.destroy_process_group()\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
