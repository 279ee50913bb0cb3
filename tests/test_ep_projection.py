"""`smsplit.ep_projection`: the model's arithmetic against hand calculations, its routing simulation against
closed-form expectations, and docs/internode.md's tables against the module's own output."""

import math
import re
from pathlib import Path

import pytest
import torch

from smsplit import ep_projection as P
from smsplit.nodes import NodeLayout, count_node_bytes

DOC = Path(__file__).resolve().parent.parent / "docs" / "internode.md"


def test_rate_at_interpolates_measured_counts_and_scales_below_the_smallest():
    table = {8: 216.15, 16: 240.55}
    assert P.rate_at(table, 12) == pytest.approx((216.15 + 240.55) / 2)
    assert P.rate_at(table, 4) == pytest.approx(216.15 / 2)
    assert P.rate_at(table, 16) == pytest.approx(240.55) and P.rate_at(table, 40) == pytest.approx(240.55)
    with pytest.raises(ValueError, match="sms must be > 0"):
        P.rate_at(table, 0)


def test_constants_hold_their_documented_values():
    assert P.NIC_LINE_RATE.value == 50.0
    assert P.IB_PAYLOAD_EFFICIENCY.value == pytest.approx(0.993692, abs=1e-6)  # 4096 / 4122
    assert P.PCIE_GEN5_X16_PAYLOAD.value == pytest.approx(63.0154 * 256 / 280, abs=1e-3)  # 64 GB/s x 128/130
    assert P.NIC_SUSTAINED.value == 47.0  # the middle of the NCCL maintainer's 46-48 GB/s
    assert P.network_rate() == 47.0  # below the line rate's 49.68 and PCIe's 57.6
    assert P.NVLINK_PER_DIRECTION["H800"].value == 200 and P.NVLINK_PER_DIRECTION["H200"].value == 450
    assert P.NVLINK_EFFICIENCY.value == pytest.approx(0.82087, abs=1e-5)
    assert P.SM_PUSH_LINK_FRACTION.value == pytest.approx(269.59 / 450)
    assert P.DEEPEP_V1_CHUNK_TOKENS.value == {"dispatch": {16: 20, 32: 32, 64: 28}, "combine": {16: 28, 32: 20, 64: 20}}
    for c in (P.NIC_LINE_RATE, P.IB_PAYLOAD_EFFICIENCY, P.PCIE_GEN5_X16_PAYLOAD, P.NIC_SUSTAINED, P.NVLINK_EFFICIENCY,
              P.SM_PUSH_OVER_NVLINK, P.SM_PUSH_LINK_FRACTION, P.SM_LOCAL_COPY, P.DEEPEP_V1_CHUNK_TOKENS,
              *P.NVLINK_PER_DIRECTION.values()):
        assert c.source and c.unit


def test_wire_rows_are_deepeps_buffer_rows():
    # values + scales, an 8-byte source record, top-8 ids and weights (dispatch) or weights (combine), to 16 bytes
    assert P.wire_row_bytes("dispatch", 7168, 8, fp8=True) == 7472  # 7168 + 224 + 8 + 32 + 32 = 7464 -> 7472
    assert P.wire_row_bytes("combine", 7168, 8, fp8=False) == 14384  # 14336 + 8 + 32 = 14376 -> 14384
    assert P.wire_row_bytes("dispatch", 256, 8, fp8=True) == 336  # 256 + 8 + 8 + 64, already a multiple of 16
    assert P.wire_row_bytes("dispatch", 7168, 1, fp8=False) == 14352  # 14336 + 8 + 4 + 4 = 14352
    with pytest.raises(ValueError, match="op must be"):
        P.wire_row_bytes("gather", 7168, 8, True)


def _traffic(**kw):
    base = dict(rule="hand", num_nodes=2, ranks_per_node=8, crossings=1.0, forwarded=2.0, received=3.0,
                node_pairs=2.0, flat_offnode=4.0, nodes_per_token=2.0, max_nodes=2)
    base.update(kw)
    return P.Traffic(**base)


def test_a_dispatch_projection_by_hand():
    # 1000 tokens, FP8 rows of 7392 counted bytes, 7472 on the wire; DeepEP's design on an H800, chunks of 20
    p = P.project("dispatch", _traffic(), "H800", P.DEEPEP_V1, tokens=1000, hidden=7168, chunk_tokens=20)
    legs = {leg.name: leg for leg in p.legs}
    net_rate = 47.0
    nvl_rate = min(200 * 369.39 / 450, (216.15 + 240.55) / 2, 269.59 / 450 * 200)  # SM stores' ceiling: 119.8
    local_rate = (493.98 / 2 + 927.49 / 2) / 2  # 12 SMs, halfway between 8 and 16
    assert legs["network"].bytes == 1000 * 1 * 7472 and legs["network"].rate_gbps == pytest.approx(net_rate)
    assert legs["nvlink"].bytes == 1000 * 2 * 7472 and legs["nvlink"].rate_gbps == pytest.approx(nvl_rate)
    assert legs["local copies"].bytes == 1000 * (2 + 3) * 7472
    assert legs["local copies"].rate_gbps == pytest.approx(local_rate)
    times = {"network": 7.472e6 / net_rate / 1e3, "nvlink": 14.944e6 / nvl_rate / 1e3,
             "local copies": 37.36e6 / local_rate / 1e3}
    slowest = max(times, key=times.get)
    waves = 1000 * 2 / (12 * 20)  # tokens x node pairs / (12 channels x 20-token chunks)
    fill = sum(t for name, t in times.items() if name != slowest) / waves
    assert p.bottleneck == slowest == "network"
    assert p.fill_us == pytest.approx(fill) and p.time_us == pytest.approx(times[slowest] + fill)
    assert p.deepep_gbps == pytest.approx(2 * 7.392e6 / (p.time_us * 1e3))
    assert p.network_gbps == pytest.approx(7.392e6 / (p.time_us * 1e3))


def test_each_leg_carries_the_busiest_ranks_rows():
    even = P.project("dispatch", _traffic(), "H800", P.DEEPEP_V1, tokens=1000, chunk_tokens=20)
    skewed = P.project("dispatch", _traffic(network_max=1.5, nvlink_max=2.5, local_max=6.0), "H800", P.DEEPEP_V1,
                       tokens=1000, chunk_tokens=20)
    ratio = {a.name: b.bytes / a.bytes for a, b in zip(even.legs, skewed.legs)}
    assert ratio == pytest.approx({"network": 1.5, "nvlink": 1.25, "local copies": 6.0 / 5.0})
    # the conventions count the mean rank's bytes: only the time changes
    assert skewed.deepep_bytes == even.deepep_bytes and skewed.network_bytes == even.network_bytes


def test_a_combine_is_bf16_and_always_reads_every_received_row():
    design = P.Design("direct", 6, 6, "sm", copy_out=False)
    d = P.project("dispatch", _traffic(), "H200", design, tokens=10, hidden=256)
    c = P.project("combine", _traffic(), "H200", design, tokens=10, hidden=256)
    # wire rows: FP8 256 + 8 + 8 + 32 + 32 = 336; BF16 512 + 8 + 32 = 552 -> 560
    assert {leg.name: leg.bytes for leg in d.legs} == {"network": 10 * 336, "nvlink": 20 * 336,
                                                       "local copies": 20 * 336}  # pack only, no copy-out
    assert {leg.name: leg.bytes for leg in c.legs} == {"network": 10 * 560, "nvlink": 20 * 560,
                                                       "local copies": 50 * 560}  # sums read every row


def test_measured_leg_rates_replace_the_models():
    p = P.project("dispatch", _traffic(), "H800", P.DEEPEP_V1, tokens=1000, hidden=7168,
                  rates={"network": 40.0, "nvlink": 100.0})
    legs = {leg.name: leg for leg in p.legs}
    assert legs["network"].rate_gbps == 40.0 and legs["nvlink"].rate_gbps == 100.0
    assert legs["local copies"].rate_gbps == pytest.approx((493.98 / 2 + 927.49 / 2) / 2)
    times = sorted([7.472e6 / 40.0, 14.944e6 / 100.0, 37.36e6 / 355.3675])
    assert p.time_us == pytest.approx((times[2] + (times[0] + times[1]) / (2000 / 240)) / 1e3)  # EP16: chunks of 20
    with pytest.raises(ValueError, match="unknown legs"):
        P.project("dispatch", _traffic(), "H800", P.DEEPEP_V1, rates={"pcie": 10.0})
    with pytest.raises(ValueError, match="rates must be numbers > 0"):
        P.project("dispatch", _traffic(), "H800", P.DEEPEP_V1, rates={"network": 0})


def test_sm_forwarding_is_capped_by_the_link_fraction_sm_stores_reach():
    twelve = P.Design("sm", 12, 12)
    # on the H200 the measured rate at 12 SMs (228 GB/s) is below the ceiling (269.6): it stands
    assert P.leg_rates("H200", twelve)["nvlink"] == pytest.approx((216.15 + 240.55) / 2)
    # on the H800 (200 GB/s a direction) SM stores reach the same 0.599 of the link, below the copy engine's 0.821
    assert P.leg_rates("H800", twelve)["nvlink"] == pytest.approx(200 * 269.59 / 450)
    # too few SMs to reach the ceiling: the SMs bind (4 SMs: half of the 8-SM rate)
    assert P.leg_rates("H800", P.Design("sm", 4, 4))["nvlink"] == pytest.approx(216.15 / 2)


def test_the_copy_engine_forward_uses_the_link_rate_and_no_sm():
    rates = P.leg_rates("H200", P.Design("ce", 0, 12, "copy_engine"))
    assert rates["nvlink"] == pytest.approx(369.39)
    assert P.leg_rates("H800", P.Design("ce", 0, 12, "copy_engine"))["nvlink"] == pytest.approx(200 * 369.39 / 450)
    with pytest.raises(ValueError, match="gpu must be one of"):
        P.leg_rates("B200", P.DEEPEP_V1)


def test_best_design_is_no_slower_than_any_split():
    t = P.simulate_routing(2, rule="deepseek_v3")
    design, best = P.best_design("dispatch", t, "H200", 12)
    for fwd in range(1, 12):
        other = P.project("dispatch", t, "H200", P.Design("x", fwd, 12 - fwd, "sm", False))
        assert best.time_us <= other.time_us + 1e-9
    assert design.sms == 12


def _miss(n_items, per_group, k):
    """P(a group of ``per_group`` of ``n_items`` experts holds none of ``k`` drawn without replacement)."""
    return math.comb(n_items - per_group, k) / math.comb(n_items, k)


@pytest.mark.parametrize("nodes", [2, 4, 8])
def test_unrestricted_routing_matches_closed_form_expectations(nodes):
    E, k, rpn = 256, 8, 8
    R = nodes * rpn
    t = P.simulate_routing(nodes, rpn, E, k, "unrestricted")
    p_rank = 1 - _miss(E, E // R, k)
    p_node = 1 - _miss(E, E // nodes, k)
    assert t.received == pytest.approx(R * p_rank, rel=0.02)
    assert t.nodes_per_token == pytest.approx(nodes * p_node, rel=0.02)
    assert t.crossings == pytest.approx((nodes - 1) * p_node, rel=0.02)
    # every destination rank but the receiving GPU of each node (the source's local index) is a forward
    assert t.forwarded == pytest.approx((R - nodes) * p_rank, rel=0.02)
    assert t.flat_offnode == pytest.approx((R - rpn) * p_rank, rel=0.02)
    assert t.node_pairs == pytest.approx(t.nodes_per_token)


@pytest.mark.parametrize("rule", ["deepseek_v3", "deepep_test"])
def test_node_limited_routing_reaches_at_most_four_of_eight_nodes(rule):
    t = P.simulate_routing(8, rule=rule)
    assert t.max_nodes <= 4 and t.crossings <= 4
    assert 3.5 < t.nodes_per_token <= 4


def _brute_force_loads(masks, nodes, rpn):
    """Per-rank rows of every leg by walking tokens and ranks one by one (the hierarchical path's rules)."""
    R = nodes * rpn
    keys = ("net_out", "net_in", "nvl_out", "nvl_in", "pack", "recv", "flat_out", "flat_in")
    loads = {k: [0] * R for k in keys}
    for s, mask in enumerate(masks):
        s_node, s_local = divmod(s, rpn)
        for row in mask.tolist():
            for n in range(nodes):
                dests = [n * rpn + j for j in range(rpn) if row[n * rpn + j]]
                if not dests:
                    continue
                loads["pack"][s] += 1
                if n != s_node:  # one row over the network to the same local index on node n
                    loads["net_out"][s] += 1
                    loads["net_in"][n * rpn + s_local] += 1
                for d in dests:
                    loads["recv"][d] += 1
                    if d != n * rpn + s_local:  # forwarded by the receiving GPU over NVLink
                        loads["nvl_out"][n * rpn + s_local] += 1
                        loads["nvl_in"][d] += 1
                    if n != s_node:
                        loads["flat_out"][s] += 1
                        loads["flat_in"][d] += 1
    return loads


@pytest.mark.parametrize("nodes,rpn", [(2, 2), (3, 2), (2, 4), (4, 2)])
def test_rank_loads_match_a_token_by_token_count_and_count_node_bytes(nodes, rpn):
    R = nodes * rpn
    gen = torch.Generator().manual_seed(nodes * 10 + rpn)
    masks = [torch.rand(37, R, generator=gen) < 0.3 for _ in range(R)]
    masks[1][:] = False  # a rank that sends nothing
    masks[0][:, :rpn] = False  # a rank whose tokens all leave its node
    layout = NodeLayout(rpn, nodes)
    loads = P.rank_loads(masks, layout)
    expect = _brute_force_loads(masks, nodes, rpn)
    for key, values in expect.items():
        assert loads[key].tolist() == [float(v) for v in values], key
    # the sending side is count_node_bytes' (independently written) per-source count
    for s, mask in enumerate(masks):
        c = count_node_bytes(mask, s, layout, 1)
        assert (loads["net_out"][s], loads["pack"][s], loads["flat_out"][s]) == \
            (c.internode_bytes, c.deepep_rdma_bytes, c.flat_internode_bytes)
    assert float(loads["nvl_out"].sum()) == sum(count_node_bytes(m, s, layout, 1).intranode_bytes
                                                for s, m in enumerate(masks))
    with pytest.raises(ValueError, match="one mask per rank"):
        P.rank_loads(masks[:-1], layout)


@pytest.mark.parametrize("nodes", [2, 4])
def test_the_busiest_rank_carries_at_least_the_mean(nodes):
    t = P.simulate_routing(nodes, rule="deepep_test")
    assert t.busiest("network") >= t.crossings and t.busiest("nvlink") >= t.forwarded
    assert t.busiest("local") >= t.node_pairs + t.received and t.busiest("flat") >= t.flat_offnode
    # random uniform routing of 4096 tokens a rank: the busiest rank is a few percent above the mean, not more
    assert t.busiest("network") < 1.05 * t.crossings and t.busiest("nvlink") < 1.05 * t.forwarded


def test_the_deepep_comparison_when_the_network_binds_is_the_nic_rate_times_its_counts():
    # where the NIC binds, DeepEP's GB/s is the NIC's rate x (node pairs / the busiest NIC's rows) x (counted / wire
    # row bytes), less the pipeline's fill and drain (a few percent)
    for op, row_bytes in (("dispatch", (7392, 7472)), ("combine", (14336, 14384))):
        for row in P.compare_with_deepep(op):
            t = P.simulate_routing(row["ep"] // 8, 8, 256, 8, "deepep_test")
            if row["bottleneck"] == "network":
                bound = 47.0 * t.node_pairs / t.busiest("network") * row_bytes[0] / row_bytes[1]
                assert 0.9 * bound < row["predicted_gbps"] < bound
            assert row["within_15pct"] == (abs(row["predicted_gbps"] / row["published_gbps"] - 1) <= 0.15)


def test_fed_deepeps_settings_the_model_lands_within_15_percent_of_its_published_figures():
    # the bar for trusting the model's projections; the inputs are sourced or measured, none fitted
    for op in ("dispatch", "combine"):
        for row in P.compare_with_deepep(op):
            assert row["within_15pct"], (op, row)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="op must be"):
        P.project("gather", _traffic(), "H800", P.DEEPEP_V1)
    with pytest.raises(ValueError, match="rule must be one of"):
        P.simulate_routing(2, rule="zipf")
    with pytest.raises(ValueError, match="forward_engine must be"):
        P.leg_rates("H800", P.Design("x", 1, 1, "dma"))
    with pytest.raises(ValueError, match="no DeepEP V1 chunk size for EP24"):
        P.project("dispatch", _traffic(num_nodes=3), "H800", P.DEEPEP_V1)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        P.project("dispatch", _traffic(), "H800", P.DEEPEP_V1, chunk_tokens=0)


def test_the_docs_tables_are_the_modules_output():
    text = DOC.read_text()
    match = re.search(r"<!-- ep_projection tables start -->\n(.*?)\n<!-- ep_projection tables end -->", text, re.S)
    assert match, "docs/internode.md lost its generated tables"
    assert match.group(1).strip() == P._markdown().strip(), \
        "docs/internode.md is out of date: paste `python -m smsplit.ep_projection` between the markers"
