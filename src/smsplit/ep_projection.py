"""A paper model of expert-parallel dispatch and combine across nodes: per-leg bytes from simulated routing, per-leg
rates from sourced constants and rates measured on an H200, time = the slowest leg plus the pipeline's fill and
drain.

Why a model: the machines lent to this project hold one or two GPUs, so EP16 / EP32 / EP64 cannot be measured.
The model is checked first against DeepEP V1's published internode figures (same settings as its README); see
``docs/internode.md`` for the derivation, every constant's source and the comparison.

The hierarchical path of one GPU (``T`` tokens) runs three legs side by side, pipelined in chunks, each on its own
resource:

- network: rows that leave the GPU's node through its own NIC (one row per target node other than the token's
  own) and rows that arrive (the NIC is full duplex: the busier direction counts), at the rate a NIC sustains;
- NVLink: rows from the GPU that received a row (same local index as the source) to the other GPUs of its node
  that hold the token's experts, out of or into the GPU (the busier direction), at the smaller of the link's
  per-direction rate times the efficiency measured on an H200 and the rate the forwarding SMs push;
- local copies: rows copied by the send / receive SMs (each row into the network send buffer, each received row
  out of the NVLink receive buffer), at the SM copy rate measured on an H200 for that many SMs.

Every rank's tokens are routed (`simulate_routing`), and each leg carries the busiest rank's rows: a call lasts as
long as its slowest rank. A row on the wire is DeepEP's (the values, scales and the metadata that travels with
them). The call takes the slowest leg's time plus the fill and drain of the chunk pipeline: one wave of chunks
(``channels`` x DeepEP's RDMA chunk) on each other leg. A combine moves the same rows backwards (summed inside the
node before the network leg), in BF16.

``python -m smsplit.ep_projection`` prints the tables of ``docs/internode.md``.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, replace

import torch

from smsplit.nodes import NodeLayout, token_bytes


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
PCIE_GEN5_X16_PAYLOAD = Constant(
    32 * 16 / 8 * 128 / 130 * 256 / (256 + 24), "GB/s per direction",
    "the NIC reads and writes GPU memory over PCIe Gen5 x16 (GPUDirect RDMA): 32 GT/s x 16 lanes, 128b/130b "
    "encoding (PCI Express Base Specification 5.0), 256-byte TLP payloads (max payload size 256, the usual server "
    "setting) behind 24 bytes of framing, 4-DW header and LCRC each; DLLPs (acks, flow-control credits) left out")
NIC_SUSTAINED = Constant(
    47.0, "GB/s per NIC and direction",
    "what one NDR 400 Gb/s NIC sustains: 'For NDR @ 400Gbps you should see 46-48GB/s per NIC' (NCCL maintainer, "
    "https://github.com/NVIDIA/nccl-tests/issues/290, 2025-03-03); the middle of that range")
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
SM_PUSH_LINK_FRACTION = Constant(
    max(SM_PUSH_OVER_NVLINK.value.values()) / NVLINK_PER_DIRECTION["H200"].value, "SM push / per-direction line rate",
    "the most the SM push reached on the H200 pair (269.6 GB/s at 32 SMs, SM_PUSH_OVER_NVLINK) over its 450 GB/s "
    "a direction: SM stores over NVLink flatten there (+11% from 8 to 16 SMs, +12% from 16 to 32) while the same "
    "SMs' copies in HBM double with each doubling and the copy engine reaches 0.82 of the same link, so the ceiling "
    "is how SM stores cross each NVLink 4 link, and it scales with the GPU's link bandwidth")
SM_LOCAL_COPY = Constant(
    {8: 493.98 / 2, 16: 927.49 / 2, 24: 1374.0 / 2, 32: 1878.4 / 2}, "GB/s copied by SM count",
    "measured on an H200: `smsplit.copy.sm_copy` (TMA) of 512 MiB inside HBM on a green context of that many SMs, "
    "bytes copied = half the reported read+written (bench/results/sm_split.json copy_alone_gbps, 2026-11-29)")
DEEPEP_V1_CHUNK_TOKENS = Constant(
    {"dispatch": {16: 20, 32: 32, 64: 28}, "combine": {16: 28, 32: 20, 64: 20}}, "tokens per RDMA chunk",
    "DeepEP V1's default configs, `num_max_rdma_chunked_send_tokens` of Buffer.get_dispatch_config / "
    "get_combine_config (deep_ep/buffer.py, deepseek-ai/DeepEP commit 04b06f7): EP16 Config(num_sms, 16, 288, 20, "
    "128), EP32 (8, 288, 32, 128), EP64 (20, 288, 28, 128); combine EP16 (2, 288, 28, 128), EP32 and EP64 "
    "(1, 288, 20, 128)")

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


def wire_row_bytes(op: str, hidden: int, topk: int, fp8: bool) -> int:
    """Bytes of one row in DeepEP V1's RDMA and NVLink buffers: the values (FP8 with one fp32 scale per 128, or
    BF16), an 8-byte source record, the top-k expert ids (dispatch) and weights (fp32 each), rounded up to 16 bytes
    (`get_num_bytes_per_token` of csrc/kernels/internode.cu; a dispatch passes ``num_topk`` ids and weights, a
    combine ``0, 0, num_topk``): 7472 bytes for an FP8 dispatch row of 7168 values and top-8, 14384 for a BF16
    combine row. These are the bytes the links carry; `token_bytes` (the values and scales alone) is what DeepEP's
    and our GB/s count."""
    if op not in ("dispatch", "combine"):
        raise ValueError(f"op must be 'dispatch' or 'combine', got {op!r}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk!r}")
    ids = topk * 4 if op == "dispatch" else 0
    raw = token_bytes(hidden, fp8=fp8) + 8 + ids + topk * 4
    return -(-raw // 16) * 16


# --- routing -------------------------------------------------------------------------------------------------------

ROUTING_RULES = ("deepep_test", "deepseek_v3", "unrestricted")


@dataclass(frozen=True)
class Traffic:
    """Rows a token moves, per token of a rank. Means over every rank: ``crossings`` (rows leaving the node,
    hierarchical), ``forwarded`` (rows between GPUs inside nodes), ``received`` (destination ranks),
    ``node_pairs`` (target nodes, own included: DeepEP's count), ``flat_offnode`` (rows a flat all-to-all sends off
    the node), ``nodes_per_token`` / ``max_nodes`` (distinct target nodes, mean and maximum). The busiest rank's, in
    rows per token of a rank: ``network_max`` (the larger of the rows its NIC sends and receives), ``nvlink_max``
    (the larger of the rows it forwards out and receives in over NVLink), ``local_max`` (rows it packs plus rows
    it receives), ``pack_max`` (rows it packs) and ``flat_max`` (a flat all-to-all's rows off or onto its node).
    The maxima default to the means (a perfectly balanced load), for traffic written by hand."""

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
    tokens: int = 0
    network_max: float | None = None
    nvlink_max: float | None = None
    local_max: float | None = None
    pack_max: float | None = None
    flat_max: float | None = None

    def busiest(self, what: str) -> float:
        """The busiest rank's rows per token of ``what`` ("network", "nvlink", "local", "pack", "flat")."""
        mean = {"network": self.crossings, "nvlink": self.forwarded, "local": self.node_pairs + self.received,
                "pack": self.node_pairs, "flat": self.flat_offnode}[what]
        value = getattr(self, f"{what}_max")
        return mean if value is None else value


def _route(kind: str, num_nodes: int, num_experts: int, topk: int, max_nodes: int, tokens: int,
           gen: torch.Generator) -> torch.Tensor:
    if kind == "deepep_test":
        # DeepEP's tests/test_internode.py: |N(0,1)| + 1 scores, a node's score is its best expert's, the
        # min(nodes, 4) best nodes, then the top-k among their experts
        scores = torch.randn(tokens, num_experts, generator=gen).abs() + 1
        m = min(num_nodes, 4)
        node_best = scores.view(tokens, num_nodes, -1).amax(-1)
        keep = torch.zeros_like(node_best, dtype=torch.bool).scatter_(1, node_best.topk(m, dim=-1).indices, True)
        masked = scores.view(tokens, num_nodes, -1).masked_fill(~keep.unsqueeze(-1), 0.0).view(tokens, -1)
        return masked.topk(topk, dim=-1).indices
    from smsplit.moe.router import group_limited_topk

    # DeepSeek-V3's gate on random logits: sigmoid scores, a node's score is the sum of its two best, the
    # ``max_nodes`` best nodes (all of them: plain top-k)
    scores = torch.sigmoid(torch.randn(tokens, num_experts, generator=gen))
    return group_limited_topk(scores, torch.zeros(num_experts), topk, num_nodes, max_nodes)


def rank_loads(masks: list[torch.Tensor], layout: NodeLayout) -> dict[str, torch.Tensor]:
    """Rows each rank moves on each leg when source rank ``s`` sends its tokens by ``masks[s]`` (``[tokens, group
    size]`` bool, `is_token_in_rank`): float64 tensors of ``group size``, keyed "net_out" / "net_in" (rows its NIC
    sends / receives: one per token and target node other than the source's, to the same local index there),
    "nvl_out" / "nvl_in" (rows it pushes to / receives from the other GPUs of its node: on each target node the GPU
    at the source's local index forwards to the others holding the token's experts), "pack" (rows it writes into
    its send buffers: one per token and target node, its own included), "recv" (rows it receives) and
    "flat_out" / "flat_in" (a flat all-to-all's rows to / from ranks of other nodes)."""
    if len(masks) != layout.group_size:
        raise ValueError(f"rank_loads needs one mask per rank ({layout.group_size}), got {len(masks)}")
    n, g = layout.num_nodes, layout.ranks_per_node
    for s, mask in enumerate(masks):
        if mask.dim() != 2 or mask.size(1) != layout.group_size or mask.size(0) != masks[0].size(0):
            raise ValueError(f"masks[{s}] must be [tokens, {layout.group_size}] with the tokens of masks[0], got "
                             f"{tuple(mask.shape)}")
    stack = torch.stack([mask.bool() for mask in masks])  # [source, token, rank]
    per_rank_all = stack.sum(1, dtype=torch.float64).view(-1, n, g)  # rows of each source each rank receives
    per_node_all = stack.view(len(masks), -1, n, g).any(-1).sum(1, dtype=torch.float64)  # its tokens reaching a node
    loads = {k: torch.zeros(n, g, dtype=torch.float64)
             for k in ("net_out", "net_in", "nvl_out", "nvl_in", "pack", "recv", "flat_out", "flat_in")}
    for s in range(len(masks)):
        node, local = divmod(s, g)
        per_rank, per_node = per_rank_all[s], per_node_all[s]
        off = torch.ones(n, dtype=torch.bool)
        off[node] = False
        loads["net_out"][node, local] += per_node[off].sum()
        loads["net_in"][off, local] += per_node[off]
        pushed = per_rank.clone()
        pushed[:, local] = 0.0  # the receiving GPU keeps its own rows
        loads["nvl_out"][:, local] += pushed.sum(1)
        loads["nvl_in"] += pushed
        loads["pack"][node, local] += per_node.sum()
        loads["recv"] += per_rank
        loads["flat_out"][node, local] += per_rank[off].sum()
        loads["flat_in"][off] += per_rank[off]
    return {k: v.view(-1) for k, v in loads.items()}


def simulate_routing(num_nodes: int, ranks_per_node: int = 8, num_experts: int = 256, topk: int = 8,
                     rule: str = "deepseek_v3", max_nodes: int = 4, tokens: int = 4096, seed: int = 0) -> Traffic:
    """`Traffic` of ``tokens`` random tokens on every rank routed by ``rule``: "deepep_test" (DeepEP's internode
    test), "deepseek_v3" (`smsplit.moe.router.group_limited_topk` with groups = nodes, ``max_nodes`` of them) or
    "unrestricted" (plain top-k). Random uniform routing: every expert equally likely, no skew; the busiest rank
    differs from the mean only by chance."""
    if rule not in ROUTING_RULES:
        raise ValueError(f"rule must be one of {ROUTING_RULES}, got {rule!r}")
    if num_experts % (num_nodes * ranks_per_node):
        raise ValueError(f"num_experts={num_experts} must divide evenly over {num_nodes * ranks_per_node} ranks")
    # DeepSeek-V3's rule with M >= the number of nodes is the unrestricted one (same draws, same choices): simulated
    # once
    m = min(max_nodes, num_nodes) if rule == "deepseek_v3" else num_nodes
    kind = "deepep_test" if rule == "deepep_test" else "grouped"
    traffic = _simulate(num_nodes, ranks_per_node, num_experts, topk, kind, m, tokens, seed)
    return replace(traffic, rule=rule)


@functools.lru_cache(maxsize=None)
def _simulate(num_nodes: int, ranks_per_node: int, num_experts: int, topk: int, kind: str, max_nodes: int,
              tokens: int, seed: int) -> Traffic:
    layout = NodeLayout(ranks_per_node, num_nodes)
    gen = torch.Generator().manual_seed(seed)
    masks, hit_sum, hit_max = [], 0.0, 0
    for node in range(num_nodes):  # a node's ranks at a time: one routing call, memory bounded by a node's tokens
        topk_idx = _route(kind, num_nodes, num_experts, topk, max_nodes, tokens * ranks_per_node, gen)
        # expert e lives on rank e // (experts a rank): a token's rank mask, as `is_token_in_rank_from_topk` makes it
        mask = torch.zeros(topk_idx.size(0), layout.group_size, dtype=torch.bool).scatter_(
            1, topk_idx // (num_experts // layout.group_size), True)
        hit = mask.view(-1, num_nodes, ranks_per_node).any(-1).sum(-1)
        hit_sum, hit_max = hit_sum + float(hit.sum()), max(hit_max, int(hit.max()))
        masks.extend(mask.split(tokens))
    loads = rank_loads(masks, layout)
    n_tokens = tokens * layout.group_size

    def busiest(*keys):
        return max(float(loads[k].max()) for k in keys) / tokens

    def mean(key):
        return float(loads[key].sum()) / n_tokens

    return Traffic(rule=kind, num_nodes=num_nodes, ranks_per_node=ranks_per_node,
                   crossings=mean("net_out"), forwarded=mean("nvl_out"), received=mean("recv"),
                   node_pairs=mean("pack"), flat_offnode=mean("flat_out"), nodes_per_token=hit_sum / n_tokens,
                   max_nodes=hit_max, tokens=tokens, network_max=busiest("net_out", "net_in"),
                   nvlink_max=busiest("nvl_out", "nvl_in"),
                   local_max=float((loads["pack"] + loads["recv"]).max()) / tokens, pack_max=busiest("pack"),
                   flat_max=busiest("flat_out", "flat_in"))


# --- the model -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Design:
    """How an implementation spends its SMs: ``sms_forward`` push rows over NVLink (forward_engine "sm"), or the copy
    engines do (forward_engine "copy_engine": no SM, the copy engine's measured rate); ``sms_local`` copy rows into the
    network send buffer and, with ``copy_out``, out of the NVLink receive buffer into the output (DeepEP V1's NVLink
    receivers); without it the forwarded rows land where the output wants them. A combine's local leg always reads
    every received row and every node's partial sum (its reductions). The network leg is the NIC's (RDMA engine or
    NCCL's proxy): no SM in this model. ``channels`` (default: one per pair of SMs, DeepEP's rule) is how many
    chunk streams run at once: one wave of ``channels`` chunks is the pipeline's fill and drain."""

    name: str
    sms_forward: int
    sms_local: int
    forward_engine: str = "sm"
    copy_out: bool = True
    channels: int | None = None

    @property
    def sms(self) -> int:
        return self.sms_forward + self.sms_local

    @property
    def num_channels(self) -> int:
        return self.channels if self.channels is not None else max(1, self.sms // 2)


# DeepEP V1's internode kernels: half the SMs forward (even blocks: RDMA -> NVLink), half send and receive (odd
# blocks: RDMA senders and NVLink receivers), a channel per pair: csrc/kernels/internode.cu,
# `is_forwarder = sm_id % 2 == 0`, `num_channels = gridDim.x / 2`
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
    """One projected call: its legs (the busiest rank's bytes on each), the pipeline's fill and drain, time (the
    slowest leg plus the fill), bottleneck, and rates in both conventions: ``network_gbps`` (bytes that leave the
    node, values and scales, per GPU on average / time, ours) and ``deepep_gbps`` (DeepEP's logical RDMA bytes, one
    row per target node, the token's own included / time)."""

    op: str
    gpu: str
    design: str
    ep: int
    legs: tuple
    deepep_bytes: float
    network_bytes: float
    fill_us: float = 0.0

    @property
    def time_us(self) -> float:
        return max(leg.time_us for leg in self.legs) + self.fill_us

    @property
    def bottleneck(self) -> str:
        return max(self.legs, key=lambda leg: leg.time_us).name

    @property
    def network_gbps(self) -> float:
        return self.network_bytes / self.time_us / 1e3

    @property
    def deepep_gbps(self) -> float:
        return self.deepep_bytes / self.time_us / 1e3


def network_rate() -> float:
    """GB/s a GPU's NIC moves in each direction: the smallest of the NDR line rate times the InfiniBand payload
    efficiency, the PCIe Gen5 x16 payload rate between NIC and GPU, and what an NDR NIC is observed to sustain."""
    return min(NIC_LINE_RATE.value * IB_PAYLOAD_EFFICIENCY.value, PCIE_GEN5_X16_PAYLOAD.value, NIC_SUSTAINED.value)


def leg_rates(gpu: str, design: Design) -> dict:
    """GB/s of each leg on ``gpu`` ("H800" or "H200") for ``design``."""
    if gpu not in NVLINK_PER_DIRECTION:
        raise ValueError(f"gpu must be one of {sorted(NVLINK_PER_DIRECTION)}, got {gpu!r}")
    line = NVLINK_PER_DIRECTION[gpu].value
    link = line * NVLINK_EFFICIENCY.value
    if design.forward_engine == "copy_engine":
        nvlink = link
    elif design.forward_engine == "sm":
        # the SMs' own rate (measured by SM count) or the ceiling SM stores reach on this GPU's links
        nvlink = min(link, rate_at(SM_PUSH_OVER_NVLINK.value, design.sms_forward), SM_PUSH_LINK_FRACTION.value * line)
    else:
        raise ValueError(f"forward_engine must be 'sm' or 'copy_engine', got {design.forward_engine!r}")
    return {"network": network_rate(), "nvlink": nvlink, "local copies": rate_at(SM_LOCAL_COPY.value, design.sms_local)}


def project(op: str, traffic: Traffic, gpu: str, design: Design, tokens: int = 4096, hidden: int = 7168,
            fp8: bool | None = None, rates: dict | None = None, topk: int = 8,
            chunk_tokens: int | None = None) -> Projection:
    """The projected ``op`` ("dispatch" or "combine") of ``tokens`` tokens a GPU. ``fp8`` None: FP8 dispatch and
    BF16 combine (DeepSeek-V3's and DeepEP's setting). ``rates`` (GB/s by leg: "network", "nvlink",
    "local copies") replaces `leg_rates`' for the legs it names: a benchmark's measured leg rates, for example.
    ``chunk_tokens`` (tokens per network chunk) defaults to DeepEP V1's config for this EP."""
    if op not in ("dispatch", "combine"):
        raise ValueError(f"op must be 'dispatch' or 'combine', got {op!r}")
    fp8 = (op == "dispatch") if fp8 is None else fp8
    given = dict(rates or {})
    if unknown := sorted(set(given) - {"network", "nvlink", "local copies"}):
        raise ValueError(f"rates: unknown legs {unknown}; the legs are 'network', 'nvlink', 'local copies'")
    if any(not (isinstance(v, (int, float)) and v > 0) for v in given.values()):
        raise ValueError(f"rates must be numbers > 0 (GB/s), got {given}")
    ep = traffic.num_nodes * traffic.ranks_per_node
    if chunk_tokens is None:
        if ep not in DEEPEP_V1_CHUNK_TOKENS.value[op]:
            raise ValueError(f"no DeepEP V1 chunk size for EP{ep}; pass chunk_tokens")
        chunk_tokens = DEEPEP_V1_CHUNK_TOKENS.value[op][ep]
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens!r}")
    rates = {**leg_rates(gpu, design), **given}
    row, wire = token_bytes(hidden, fp8=fp8), wire_row_bytes(op, hidden, topk, fp8)
    local = traffic.busiest("local") if design.copy_out or op == "combine" else traffic.busiest("pack")
    legs = (Leg("network", tokens * traffic.busiest("network") * wire, rates["network"]),
            Leg("nvlink", tokens * traffic.busiest("nvlink") * wire, rates["nvlink"]),
            Leg("local copies", tokens * local * wire, rates["local copies"]))
    # a wave: every channel's chunk in flight at once; the first wave fills the legs behind the slowest, the last
    # drains those after it, so each other leg adds the time of one wave of its own rows
    waves = max(1.0, tokens * traffic.node_pairs / (design.num_channels * chunk_tokens))
    slowest = max(legs, key=lambda leg: leg.time_us)
    fill = sum(leg.time_us for leg in legs if leg is not slowest) / waves
    return Projection(op=op, gpu=gpu, design=design.name, ep=ep, legs=legs, fill_us=fill,
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
                        copy_out, channels=max(1, sms // 2))
        p = project(op, traffic, gpu, design, tokens, hidden)
        if best is None or p.time_us < best[1].time_us:
            best = (design, p)
    return best


def flat_network_time_us(op: str, traffic: Traffic, tokens: int = 4096, hidden: int = 7168) -> float:
    """The network leg of a flat all-to-all (one row per destination rank off the node, the busiest rank's NIC) at
    the same NIC rate: the lower bound of NCCL's all-to-all for the same tokens."""
    row = token_bytes(hidden, fp8=op == "dispatch")
    return tokens * traffic.busiest("flat") * row / network_rate() / 1e3


def compare_with_deepep(op: str = "dispatch") -> list[dict]:
    """The model fed DeepEP V1's published settings, beside its published GB/s (its own convention)."""
    s = DEEPEP_V1_SETTINGS
    rows = []
    for ep, published in DEEPEP_V1_PUBLISHED[op].items():
        traffic = simulate_routing(ep // s["ranks_per_node"], s["ranks_per_node"], s["num_experts"], s["topk"],
                                   "deepep_test", tokens=s["tokens"])
        p = project(op, traffic, "H800", DEEPEP_V1, s["tokens"], s["hidden"], topk=s["topk"])
        rows.append(dict(ep=ep, predicted_gbps=p.deepep_gbps, published_gbps=published,
                         ratio=p.deepep_gbps / published, time_us=p.time_us, fill_us=p.fill_us,
                         bottleneck=p.bottleneck, network_gbps=p.network_gbps,
                         within_15pct=abs(p.deepep_gbps / published - 1) <= 0.15))
    return rows


def _markdown() -> str:
    out = []
    out.append("Per-token rows (simulated: 4096 tokens on every rank, seed 0; 256 experts, top-8, 8 GPUs a node):\n"
               "means over the ranks, and the busiest rank's\n")
    out.append("| EP | routing | target nodes (mean / max) | crossings | NVLink forwards | destination ranks | "
               "DeepEP node pairs | flat rows off node | busiest: network / NVLink / local |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for ep in (16, 32, 64):
        for rule in ROUTING_RULES:
            t = simulate_routing(ep // 8, 8, 256, 8, rule)
            out.append(f"| {ep} | {rule} | {t.nodes_per_token:.3f} / {t.max_nodes} | {t.crossings:.3f} | "
                       f"{t.forwarded:.3f} | {t.received:.3f} | {t.node_pairs:.3f} | {t.flat_offnode:.3f} | "
                       f"{t.busiest('network'):.3f} / {t.busiest('nvlink'):.3f} / {t.busiest('local'):.3f} |")
    for op in ("dispatch", "combine"):
        out.append(f"\nDeepEP V1 {op}, published vs the model fed its settings (H800, 24 SMs, DeepEP's test routing)\n")
        out.append("| EP | published (GB/s, DeepEP) | model (GB/s, DeepEP) | model / published | model time (us) | "
                   "of it fill and drain (us) | bottleneck | model, bytes leaving the node (GB/s) |")
        out.append("|---|---|---|---|---|---|---|---|")
        for r in compare_with_deepep(op):
            out.append(f"| {r['ep']} | {r['published_gbps']:.0f} | {r['predicted_gbps']:.1f} | {r['ratio']:.2f} | "
                       f"{r['time_us']:.0f} | {r['fill_us']:.0f} | {r['bottleneck']} | {r['network_gbps']:.1f} |")
    out.append("\nProjected, DeepSeek-V3 routing (M = 4), 4096 tokens a GPU, hidden 7168, FP8 dispatch / BF16 "
               "combine,\n400 Gb/s NIC a GPU; smsplit's SM split chosen by `best_design`\n")
    out.append("| GPU | EP | op | design | time (us) | bottleneck | leaving the node (GB/s) | "
               "DeepEP convention (GB/s) |")
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
                flat = flat_network_time_us(op, t)
                flat_gbps = 4096 * t.flat_offnode * token_bytes(7168, fp8=op == "dispatch") / flat / 1e3
                out.append(f"| {gpu} | {ep} | {op} | flat all-to-all, network leg alone | {flat:.0f} | network | "
                           f"{flat_gbps:.1f} | — |")
    return "\n".join(out)


if __name__ == "__main__":
    print(_markdown())
