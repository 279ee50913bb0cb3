"""A paper model of expert-parallel dispatch and combine across nodes: per-leg bytes from simulated routing, per-leg
rates from sourced constants and rates measured on an H200, time = the slowest leg.

Why a model: the machines lent to this project hold one or two GPUs, so EP16 / EP32 / EP64 cannot be measured.
The model is checked first against DeepEP V1's published internode figures (same settings as its README); see
``docs/internode.md`` for the derivation, every constant's source and the comparison.

The hierarchical path of one GPU (``T`` tokens, ``B`` bytes a row) runs three legs side by side, pipelined in chunks,
each on its own resource, so a call takes as long as its slowest leg (chunk fill and launch latency are left out:
a few microseconds against a millisecond):

- network: ``T * crossings * B`` bytes leave the GPU's node through its own NIC (one row per target node other
  than the token's own; received bytes are the same on average, and the NIC is full duplex), at the NIC's line
  rate times the InfiniBand payload efficiency;
- NVLink: ``T * forwarded * B`` bytes from the GPU that received a row (same local index as the source) to the
  other GPUs of its node that hold the token's experts, at the smaller of the link's per-direction rate times the
  efficiency measured on an H200 and the rate the forwarding SMs can push (measured on an H200);
- local copies: ``T * (node_pairs + received) * B`` bytes copied by the send / receive SMs (each row into the
  network send buffer, each received row out of the NVLink receive buffer), at the SM copy rate measured on an
  H200 for that many SMs.

A combine moves the same rows backwards (summed inside the node before the network leg), in BF16.

Per-token counts come from `simulate_routing` (random scores, fixed seed) through `smsplit.nodes.count_node_bytes`.
``python -m smsplit.ep_projection`` prints the tables of ``docs/internode.md``.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field

import torch

from smsplit.nodes import NodeLayout, count_node_bytes, is_token_in_rank_from_topk, token_bytes


@dataclass(frozen=True)
class Constant:
    """A model input: its value, unit and where it comes from."""

    value: float
    unit: str
    source: str


# --- sourced constants ---------------------------------------------------------------------------------------------

NIC_LINE_RATE = Constant(
    400 / 8, "GB/s per direction",
    "400 Gb/s InfiniBand NDR (ConnectX-7), one NIC per GPU: DeepEP V1's test machine (DeepEP docs/legacy.md: "
    "'CX7 InfiniBand 400 Gb/s RDMA network card (~50 GB/s maximum bandwidth)'); 400 Gb/s is NDR's data rate")
IB_PAYLOAD_EFFICIENCY = Constant(
    4096 / (4096 + 8 + 12 + 4 + 2), "payload / wire bytes",
    "RDMA write packets of a 4096-byte MTU carry 26 bytes of headers each (LRH 8, BTH 12, ICRC 4, VCRC 2; "
    "InfiniBand Architecture Specification vol. 1); RETH once per message and link-level flow control are left out")
NVLINK_PER_DIRECTION = {
    "H800": Constant(400 / 2, "GB/s per direction",
                     "NVIDIA H800 SXM5: NVLink 400 GB/s bidirectional (8 NVLink 4 links), DeepSeek-V3's and DeepEP "
                     "V1's machine"),
    "H200": Constant(900 / 2, "GB/s per direction",
                     "NVIDIA H200 SXM: NVLink 900 GB/s bidirectional (18 NVLink 4 links)"),
}
NVLINK_EFFICIENCY = Constant(
    369.39 / 450, "achieved / per-direction line rate",
    "measured on an H200 pair (NV18): copy-engine peer copy of 58.4 MB at 369.4 GB/s (bench/results/ep.json "
    "copy_engine_gbps, `python3 bench/ep.py --comm-sms 8 16 20 24 32 ...`, 2026-12-01; BENCHMARKS.md 'copy-engine "
    "peer copy (ceiling)'; an earlier run on the same machine: 353-358 GB/s), over the H200's 450 GB/s a direction")
SM_PUSH_OVER_NVLINK = Constant(
    {8: 216.15, 16: 240.55, 20: 262.73, 24: 262.65, 32: 269.59}, "GB/s by SM count",
    "measured on an H200 pair: `smsplit.copy.sm_copy` writing 58.4 MB into the peer's memory, one persistent "
    "program per SM (bench/results/ep.json sm_copy_over_nvlink write_gbps, 2026-12-01)")
SM_LOCAL_COPY = Constant(
    {8: 493.98 / 2, 16: 927.49 / 2, 24: 1374.0 / 2, 32: 1878.4 / 2}, "GB/s copied by SM count",
    "measured on an H200: `smsplit.copy.sm_copy` (TMA) of 512 MiB inside HBM on a green context of that many SMs, "
    "bytes copied = half the reported read+written (bench/results/sm_split.json copy_alone_gbps, 2026-11-29)")

# DeepEP V1's published internode figures (docs/legacy.md of deepseek-ai/DeepEP: H800, CX7 400 Gb/s, 4096 tokens,
# hidden 7168, top-4 groups, top-8 experts, FP8 dispatch, BF16 combine; 24 SMs in tests/test_internode.py), in its
# own convention (`deepep_rdma_bytes` / time)
DEEPEP_V1_PUBLISHED = {"dispatch": {16: 43.0, 32: 58.0, 64: 51.0}, "combine": {16: 43.0, 32: 57.0, 64: 50.0}}
DEEPEP_V1_SETTINGS = dict(tokens=4096, hidden=7168, num_experts=256, topk=8, ranks_per_node=8, num_sms=24)


def rate_at(table: dict, sms: float) -> float:
    """A measured rate-by-SM-count table read at ``sms``: linear between measured counts, proportional to the SM
    count below the smallest (the SMs are the bound there), the largest count's rate above it."""
    if sms <= 0:
        raise ValueError(f"sms must be > 0, got {sms!r}")
    counts = sorted(table)
    if sms <= counts[0]:
        return table[counts[0]] * sms / counts[0]
    if sms >= counts[-1]:
        return table[counts[-1]]
    i = bisect.bisect_left(counts, sms)
    lo, hi = counts[i - 1], counts[i]
    return table[lo] + (table[hi] - table[lo]) * (sms - lo) / (hi - lo)


# --- routing -------------------------------------------------------------------------------------------------------

ROUTING_RULES = ("deepep_test", "deepseek_v3", "unrestricted")


@dataclass(frozen=True)
class Traffic:
    """Rows a token moves, on average over the simulated tokens of one source rank (all ranks alike by symmetry):
    ``crossings`` (rows leaving the node, hierarchical), ``forwarded`` (rows between GPUs inside nodes),
    ``received`` (destination ranks: rows a GPU receives per token of each source), ``node_pairs`` (target nodes,
    own included: DeepEP's count), ``flat_offnode`` (rows a flat all-to-all sends off the node), and
    ``nodes_per_token`` / ``max_nodes``: distinct target nodes, mean and maximum."""

    rule: str
    num_nodes: int
    ranks_per_node: int
    crossings: float
    forwarded: float
    received: float
    node_pairs: float
    flat_offnode: float
    nodes_per_token: float
    max_nodes: int
    tokens: int = field(default=0)


def _route(rule: str, num_nodes: int, num_experts: int, topk: int, max_nodes: int, tokens: int,
           gen: torch.Generator) -> torch.Tensor:
    if rule == "deepep_test":
        # DeepEP's tests/test_internode.py: |N(0,1)| + 1 scores, a node's score is its best expert's, the
        # min(nodes, 4) best nodes, then the top-k among their experts
        scores = torch.randn(tokens, num_experts, generator=gen).abs() + 1
        m = min(num_nodes, 4)
        node_best = scores.view(tokens, num_nodes, -1).amax(-1)
        keep = torch.zeros_like(node_best, dtype=torch.bool).scatter_(1, node_best.topk(m, dim=-1).indices, True)
        masked = scores.view(tokens, num_nodes, -1).masked_fill(~keep.unsqueeze(-1), 0.0).view(tokens, -1)
        return masked.topk(topk, dim=-1).indices
    from smsplit.moe.router import group_limited_topk

    # DeepSeek-V3's gate on random logits: sigmoid scores, a node's score is the sum of its two best, M nodes
    scores = torch.sigmoid(torch.randn(tokens, num_experts, generator=gen))
    m = min(max_nodes, num_nodes) if rule == "deepseek_v3" else num_nodes
    return group_limited_topk(scores, torch.zeros(num_experts), topk, num_nodes, m)


@functools.lru_cache(maxsize=None)
def simulate_routing(num_nodes: int, ranks_per_node: int = 8, num_experts: int = 256, topk: int = 8,
                     rule: str = "deepseek_v3", max_nodes: int = 4, tokens: int = 16384, seed: int = 0) -> Traffic:
    """`Traffic` of ``tokens`` random tokens of source rank 0 routed by ``rule``: "deepep_test" (DeepEP's internode
    test), "deepseek_v3" (`smsplit.moe.router.group_limited_topk` with groups = nodes, ``max_nodes`` of them) or
    "unrestricted" (plain top-k). Random uniform routing: every expert equally likely, no skew."""
    if rule not in ROUTING_RULES:
        raise ValueError(f"rule must be one of {ROUTING_RULES}, got {rule!r}")
    layout = NodeLayout(ranks_per_node, num_nodes)
    gen = torch.Generator().manual_seed(seed)
    topk_idx = _route(rule, num_nodes, num_experts, topk, max_nodes, tokens, gen)
    mask = is_token_in_rank_from_topk(topk_idx, num_experts, layout.group_size)
    counts = count_node_bytes(mask, 0, layout, 1)
    nodes_hit = mask.view(tokens, num_nodes, ranks_per_node).any(-1).sum(-1)
    return Traffic(rule=rule, num_nodes=num_nodes, ranks_per_node=ranks_per_node,
                   crossings=counts.internode_bytes / tokens, forwarded=counts.intranode_bytes / tokens,
                   received=float(mask.sum()) / tokens, node_pairs=counts.deepep_rdma_bytes / tokens,
                   flat_offnode=counts.flat_internode_bytes / tokens, nodes_per_token=float(nodes_hit.float().mean()),
                   max_nodes=int(nodes_hit.max()), tokens=tokens)


# --- the model -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Design:
    """How an implementation spends its SMs: ``sms_forward`` push rows over NVLink (forward_engine "sm"), or the copy
    engines do (forward_engine "copy_engine": no SM, the copy engine's measured rate); ``sms_local`` copy rows into the
    network send buffer and, with ``copy_out``, out of the NVLink receive buffer into the output (DeepEP V1's NVLink
    receivers); without it the forwarded rows land where the output wants them. A combine's local leg always reads
    every received row and every node's partial sum (its reductions). The network leg is the NIC's (RDMA engine or
    NCCL's proxy): no SM in this model."""

    name: str
    sms_forward: int
    sms_local: int
    forward_engine: str = "sm"
    copy_out: bool = True

    @property
    def sms(self) -> int:
        return self.sms_forward + self.sms_local


# DeepEP V1's internode kernels: half the SMs forward (even blocks: RDMA -> NVLink), half send and receive (odd
# blocks: RDMA senders and NVLink receivers): csrc/kernels/internode.cu, `is_forwarder = sm_id % 2 == 0`
DEEPEP_V1 = Design("DeepEP V1, 24 SMs", 12, 12)


@dataclass(frozen=True)
class Leg:
    name: str
    bytes: float
    rate_gbps: float

    @property
    def time_us(self) -> float:
        return self.bytes / self.rate_gbps / 1e3


@dataclass(frozen=True)
class Projection:
    """One projected call: its legs, time (the slowest leg), bottleneck, and rates in both conventions:
    ``network_gbps`` (bytes that leave the node / time, ours) and ``deepep_gbps`` (DeepEP's logical RDMA bytes,
    one row per target node, the token's own included / time)."""

    op: str
    gpu: str
    design: str
    ep: int
    legs: tuple
    deepep_bytes: float
    network_bytes: float

    @property
    def time_us(self) -> float:
        return max(leg.time_us for leg in self.legs)

    @property
    def bottleneck(self) -> str:
        return max(self.legs, key=lambda leg: leg.time_us).name

    @property
    def network_gbps(self) -> float:
        return self.network_bytes / self.time_us / 1e3

    @property
    def deepep_gbps(self) -> float:
        return self.deepep_bytes / self.time_us / 1e3


def leg_rates(gpu: str, design: Design) -> dict:
    """GB/s of each leg on ``gpu`` ("H800" or "H200") for ``design``."""
    if gpu not in NVLINK_PER_DIRECTION:
        raise ValueError(f"gpu must be one of {sorted(NVLINK_PER_DIRECTION)}, got {gpu!r}")
    link = NVLINK_PER_DIRECTION[gpu].value * NVLINK_EFFICIENCY.value
    if design.forward_engine == "copy_engine":
        nvlink = link
    elif design.forward_engine == "sm":
        nvlink = min(link, rate_at(SM_PUSH_OVER_NVLINK.value, design.sms_forward))
    else:
        raise ValueError(f"forward_engine must be 'sm' or 'copy_engine', got {design.forward_engine!r}")
    return {"network": NIC_LINE_RATE.value * IB_PAYLOAD_EFFICIENCY.value, "nvlink": nvlink,
            "local copies": rate_at(SM_LOCAL_COPY.value, design.sms_local)}


def project(op: str, traffic: Traffic, gpu: str, design: Design, tokens: int = 4096, hidden: int = 7168,
            fp8: bool | None = None, rates: dict | None = None) -> Projection:
    """The projected ``op`` ("dispatch" or "combine") of ``tokens`` tokens a GPU. ``fp8`` None: FP8 dispatch and
    BF16 combine (DeepSeek-V3's and DeepEP's setting). ``rates`` (GB/s by leg: "network", "nvlink",
    "local copies") replaces `leg_rates`' for the legs it names: a benchmark's measured leg rates, for example."""
    if op not in ("dispatch", "combine"):
        raise ValueError(f"op must be 'dispatch' or 'combine', got {op!r}")
    row = token_bytes(hidden, fp8=(op == "dispatch") if fp8 is None else fp8)
    given = dict(rates or {})
    if unknown := sorted(set(given) - {"network", "nvlink", "local copies"}):
        raise ValueError(f"rates: unknown legs {unknown}; the legs are 'network', 'nvlink', 'local copies'")
    if any(not (isinstance(v, (int, float)) and v > 0) for v in given.values()):
        raise ValueError(f"rates must be numbers > 0 (GB/s), got {given}")
    rates = {**leg_rates(gpu, design), **given}
    local_rows = traffic.node_pairs + (traffic.received if design.copy_out or op == "combine" else 0.0)
    legs = (Leg("network", tokens * traffic.crossings * row, rates["network"]),
            Leg("nvlink", tokens * traffic.forwarded * row, rates["nvlink"]),
            Leg("local copies", tokens * local_rows * row, rates["local copies"]))
    return Projection(op=op, gpu=gpu, design=design.name, ep=traffic.num_nodes * traffic.ranks_per_node, legs=legs,
                      deepep_bytes=tokens * traffic.node_pairs * row, network_bytes=tokens * traffic.crossings * row)


def best_design(op: str, traffic: Traffic, gpu: str, sms: int, forward_engine: str = "sm", copy_out: bool = False,
                tokens: int = 4096, hidden: int = 7168) -> tuple[Design, Projection]:
    """The split of ``sms`` SMs between forwarding and local copies that the model projects fastest (every SM on
    local copies when the copy engines forward)."""
    splits = [0] if forward_engine == "copy_engine" else range(1, sms)
    best = None
    for fwd in splits:
        design = Design(f"smsplit, {sms} SMs ({'copy-engine' if forward_engine == 'copy_engine' else fwd} forward, "
                        f"{sms - fwd} local{', copy-out' if copy_out else ''})", fwd, sms - fwd, forward_engine,
                        copy_out)
        p = project(op, traffic, gpu, design, tokens, hidden)
        if best is None or p.time_us < best[1].time_us:
            best = (design, p)
    return best


def flat_network_time_us(op: str, traffic: Traffic, tokens: int = 4096, hidden: int = 7168) -> float:
    """The network leg of a flat all-to-all (one row per destination rank off the node) at the same NIC rate: the
    lower bound of NCCL's all-to-all for the same tokens."""
    row = token_bytes(hidden, fp8=op == "dispatch")
    return tokens * traffic.flat_offnode * row / (NIC_LINE_RATE.value * IB_PAYLOAD_EFFICIENCY.value) / 1e3


def compare_with_deepep(op: str = "dispatch") -> list[dict]:
    """The model fed DeepEP V1's published settings, beside its published GB/s (its own convention)."""
    s = DEEPEP_V1_SETTINGS
    rows = []
    for ep, published in DEEPEP_V1_PUBLISHED[op].items():
        traffic = simulate_routing(ep // s["ranks_per_node"], s["ranks_per_node"], s["num_experts"], s["topk"],
                                   "deepep_test")
        p = project(op, traffic, "H800", DEEPEP_V1, s["tokens"], s["hidden"])
        rows.append(dict(ep=ep, predicted_gbps=p.deepep_gbps, published_gbps=published,
                         ratio=p.deepep_gbps / published, time_us=p.time_us, bottleneck=p.bottleneck,
                         network_gbps=p.network_gbps, within_15pct=abs(p.deepep_gbps / published - 1) <= 0.15))
    return rows


def _markdown() -> str:
    out = []
    out.append("Per-token rows (simulated, 16384 tokens of one source rank, seed 0; 256 experts, top-8, 8 GPUs a node)\n")
    out.append("| EP | routing | target nodes (mean / max) | crossings | NVLink forwards | destination ranks | "
               "DeepEP node pairs | flat rows off node |")
    out.append("|---|---|---|---|---|---|---|---|")
    for ep in (16, 32, 64):
        for rule in ROUTING_RULES:
            t = simulate_routing(ep // 8, 8, 256, 8, rule)
            out.append(f"| {ep} | {rule} | {t.nodes_per_token:.3f} / {t.max_nodes} | {t.crossings:.3f} | "
                       f"{t.forwarded:.3f} | {t.received:.3f} | {t.node_pairs:.3f} | {t.flat_offnode:.3f} |")
    for op in ("dispatch", "combine"):
        out.append(f"\nDeepEP V1 {op}, published vs the model fed its settings (H800, 24 SMs, DeepEP's test routing)\n")
        out.append("| EP | published (GB/s, DeepEP) | model (GB/s, DeepEP) | model / published | model time (us) | "
                   "bottleneck | model, bytes leaving the node (GB/s) |")
        out.append("|---|---|---|---|---|---|---|")
        for r in compare_with_deepep(op):
            out.append(f"| {r['ep']} | {r['published_gbps']:.0f} | {r['predicted_gbps']:.1f} | {r['ratio']:.2f} | "
                       f"{r['time_us']:.0f} | {r['bottleneck']} | {r['network_gbps']:.1f} |")
    out.append("\nProjected, DeepSeek-V3 routing (M = 4), 4096 tokens a GPU, hidden 7168, FP8 dispatch / BF16 combine, "
               "400 Gb/s NIC a GPU; smsplit's SM split chosen by `best_design`\n")
    out.append("| GPU | EP | op | design | time (us) | bottleneck | leaving the node (GB/s) | DeepEP convention (GB/s) |")
    out.append("|---|---|---|---|---|---|---|---|")
    for gpu in ("H800", "H200"):
        for ep in (16, 32, 64):
            t = simulate_routing(ep // 8, 8, 256, 8, "deepseek_v3")
            for op in ("dispatch", "combine"):
                projections = [project(op, t, gpu, DEEPEP_V1)]
                projections += [best_design(op, t, gpu, 12, engine, copy_out)[1]
                                for engine, copy_out in (("sm", False), ("copy_engine", False))]
                for p in projections:
                    out.append(f"| {gpu} | {ep} | {op} | {p.design} | {p.time_us:.0f} | {p.bottleneck} | "
                               f"{p.network_gbps:.1f} | {p.deepep_gbps:.1f} |")
                out.append(f"| {gpu} | {ep} | {op} | flat all-to-all, network leg alone | "
                           f"{flat_network_time_us(op, t):.0f} | network | {NIC_LINE_RATE.value * IB_PAYLOAD_EFFICIENCY.value:.1f} | — |")
    return "\n".join(out)


if __name__ == "__main__":
    print(_markdown())
