"""`smsplit.ep_projection`: the model's arithmetic against hand calculations, its routing simulation against
closed-form expectations, and docs/internode.md's tables against the module's own output."""

import math
import re
from pathlib import Path

import pytest

from smsplit import ep_projection as P

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
    assert P.NVLINK_PER_DIRECTION["H800"].value == 200 and P.NVLINK_PER_DIRECTION["H200"].value == 450
    assert P.NVLINK_EFFICIENCY.value == pytest.approx(0.82087, abs=1e-5)
    for c in (P.NIC_LINE_RATE, P.IB_PAYLOAD_EFFICIENCY, P.NVLINK_EFFICIENCY, P.SM_PUSH_OVER_NVLINK, P.SM_LOCAL_COPY,
              *P.NVLINK_PER_DIRECTION.values()):
        assert c.source and c.unit


def _traffic(**kw):
    base = dict(rule="hand", num_nodes=2, ranks_per_node=8, crossings=1.0, forwarded=2.0, received=3.0,
                node_pairs=2.0, flat_offnode=4.0, nodes_per_token=2.0, max_nodes=2)
    base.update(kw)
    return P.Traffic(**base)


def test_a_dispatch_projection_by_hand():
    # 1000 tokens, FP8 rows of 7168 + 56 * 4 = 7392 bytes; DeepEP's design on an H800
    p = P.project("dispatch", _traffic(), "H800", P.DEEPEP_V1, tokens=1000, hidden=7168)
    legs = {leg.name: leg for leg in p.legs}
    net_rate = 50 * 4096 / 4122
    nvl_rate = min(200 * 369.39 / 450, (216.15 + 240.55) / 2)  # the link binds: 164.17 < 228.35
    local_rate = (493.98 / 2 + 927.49 / 2) / 2  # 12 SMs, halfway between 8 and 16
    assert legs["network"].bytes == 1000 * 1 * 7392 and legs["network"].rate_gbps == pytest.approx(net_rate)
    assert legs["nvlink"].bytes == 1000 * 2 * 7392 and legs["nvlink"].rate_gbps == pytest.approx(nvl_rate)
    assert legs["local copies"].bytes == 1000 * (2 + 3) * 7392
    assert legs["local copies"].rate_gbps == pytest.approx(local_rate)
    times = {"network": 7.392e6 / net_rate / 1e3, "nvlink": 14.784e6 / nvl_rate / 1e3,
             "local copies": 36.96e6 / local_rate / 1e3}
    assert p.time_us == pytest.approx(max(times.values())) and p.bottleneck == max(times, key=times.get)
    assert p.deepep_gbps == pytest.approx(2 * 7.392e6 / (p.time_us * 1e3))
    assert p.network_gbps == pytest.approx(7.392e6 / (p.time_us * 1e3))


def test_a_combine_is_bf16_and_always_reads_every_received_row():
    design = P.Design("direct", 6, 6, "sm", copy_out=False)
    d = P.project("dispatch", _traffic(), "H200", design, tokens=10, hidden=256)
    c = P.project("combine", _traffic(), "H200", design, tokens=10, hidden=256)
    assert {leg.name: leg.bytes for leg in d.legs} == {"network": 10 * 264, "nvlink": 20 * 264,
                                                       "local copies": 20 * 264}  # pack only, no copy-out
    assert {leg.name: leg.bytes for leg in c.legs} == {"network": 10 * 512, "nvlink": 20 * 512,
                                                       "local copies": 50 * 512}  # sums read every row


def test_measured_leg_rates_replace_the_models():
    p = P.project("dispatch", _traffic(), "H800", P.DEEPEP_V1, tokens=1000, hidden=7168,
                  rates={"network": 40.0, "nvlink": 100.0})
    legs = {leg.name: leg for leg in p.legs}
    assert legs["network"].rate_gbps == 40.0 and legs["nvlink"].rate_gbps == 100.0
    assert legs["local copies"].rate_gbps == pytest.approx((493.98 / 2 + 927.49 / 2) / 2)
    assert p.time_us == pytest.approx(max(7.392e6 / 40.0, 14.784e6 / 100.0, 36.96e6 / 355.3675) / 1e3)
    with pytest.raises(ValueError, match="unknown legs"):
        P.project("dispatch", _traffic(), "H800", P.DEEPEP_V1, rates={"pcie": 10.0})
    with pytest.raises(ValueError, match="rates must be numbers > 0"):
        P.project("dispatch", _traffic(), "H800", P.DEEPEP_V1, rates={"network": 0})


def test_the_copy_engine_forward_uses_the_link_rate_and_no_sm():
    rates = P.leg_rates("H200", P.Design("ce", 0, 12, "copy_engine"))
    assert rates["nvlink"] == pytest.approx(369.39)
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


def test_the_deepep_comparison_when_the_network_binds_is_the_ratio_of_its_counts():
    # where the NIC is the bottleneck, DeepEP's GB/s is the NIC's payload rate times (node pairs / crossings)
    for row in P.compare_with_deepep("dispatch"):
        t = P.simulate_routing(row["ep"] // 8, 8, 256, 8, "deepep_test")
        if row["bottleneck"] == "network":
            assert row["predicted_gbps"] == pytest.approx(50 * 4096 / 4122 * t.node_pairs / t.crossings)
        assert row["within_15pct"] == (abs(row["predicted_gbps"] / row["published_gbps"] - 1) <= 0.15)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="op must be"):
        P.project("gather", _traffic(), "H800", P.DEEPEP_V1)
    with pytest.raises(ValueError, match="rule must be one of"):
        P.simulate_routing(2, rule="zipf")
    with pytest.raises(ValueError, match="forward_engine must be"):
        P.leg_rates("H800", P.Design("x", 1, 1, "dma"))


def test_the_docs_tables_are_the_modules_output():
    text = DOC.read_text()
    match = re.search(r"<!-- ep_projection tables start -->\n(.*?)\n<!-- ep_projection tables end -->", text, re.S)
    assert match, "docs/internode.md lost its generated tables"
    assert match.group(1).strip() == P._markdown().strip(), \
        "docs/internode.md is out of date: paste `python -m smsplit.ep_projection` between the markers"
