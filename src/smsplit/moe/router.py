"""DeepSeek-V3's gate: sigmoid scores, group-limited top-k, auxiliary-loss-free load balancing.

Experts are split into ``n_groups`` equal groups (in DeepSeek-V3 a group is the experts of one node, so
limiting the groups limits the nodes a token is sent to). A token first picks ``topk_groups`` groups by the
sum of the two highest scores in each group, then its ``topk`` experts among those groups only.

Across nodes the groups are the nodes (`node_limited_groups`): with expert parallelism over several nodes and
experts laid out contiguously over the ranks (rank ``r`` holds experts ``[r * E / ranks, (r + 1) * E / ranks)``,
so node ``n`` holds the ``n``-th contiguous ``E / nodes`` of them), ``n_groups`` = the number of nodes and
``topk_groups`` = M, the most nodes a token may reach: DeepSeek-V3's node-limited routing (M = 4, section 2.1.2).

Load balancing adds a per-expert ``bias`` to the scores *for selection only*: the weights of the selected
experts are their unbiased scores, normalised to sum to one and multiplied by ``route_scale``. After each
step ``update_bias`` lowers the bias of overloaded experts and raises it for underloaded ones by
``bias_update_speed`` (DeepSeek-V3 section 2.1.2).
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._args import check_int


def group_limited_topk(scores: torch.Tensor, bias: torch.Tensor, topk: int, n_groups: int,
                       topk_groups: int) -> torch.Tensor:
    """Expert ids ``[tokens, topk]`` (int64) chosen by ``scores + bias``, from at most ``topk_groups`` of
    the ``n_groups`` contiguous expert groups. ``scores``: ``[tokens, n_experts]`` float; ``bias``:
    ``[n_experts]``; ``n_experts`` must divide into ``n_groups`` and ``topk`` fit in ``topk_groups`` groups."""
    if scores.dim() != 2 or bias.shape != scores.shape[1:]:
        raise ValueError(f"scores must be [tokens, n_experts] and bias [n_experts], got {tuple(scores.shape)} and "
                         f"{tuple(bias.shape)}")
    _check_groups(scores.size(1), topk, n_groups, topk_groups)
    num_tokens, num_experts = scores.shape
    biased = scores + bias
    if n_groups > 1:
        grouped = biased.view(num_tokens, n_groups, num_experts // n_groups)
        group_scores = grouped.topk(min(2, grouped.size(-1)), dim=-1).values.sum(-1)
        chosen_groups = group_scores.topk(topk_groups, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen_groups, True)
        biased = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
    return biased.topk(topk, dim=-1).indices


def _check_groups(n_experts: int, topk: int, n_groups: int, topk_groups: int) -> None:
    """The group-limited top-k's arguments: ints, groups that divide the experts, top-k that fits."""
    for name, value in (("n_experts", n_experts), ("topk", topk), ("n_groups", n_groups),
                        ("topk_groups", topk_groups)):
        check_int(name, value, 1)
    if n_experts % n_groups:
        raise ValueError(f"n_experts={n_experts} must divide into n_groups={n_groups} equal groups")
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"topk_groups must lie in [1, n_groups={n_groups}], got {topk_groups}")
    if topk > topk_groups * (n_experts // n_groups):
        raise ValueError(f"topk={topk} experts do not fit in topk_groups={topk_groups} groups of "
                         f"{n_experts // n_groups}")


# DeepSeek-V3 sends each token to at most 4 nodes (section 2.1.2, "Node-Limited Routing")
DEFAULT_MAX_NODES_PER_TOKEN = 4


def node_limited_groups(n_experts: int, topk: int, n_groups: int, topk_groups: int, nodes=None,
                        max_nodes_per_token: int | None = None) -> tuple[int, int]:
    """The ``(n_groups, topk_groups)`` a router uses when its experts are spread over ``nodes`` (a
    `smsplit.nodes.NodeLayout` of the EP group, experts laid out contiguously over its ranks).

    - No layout, or one node: ``(n_groups, topk_groups)`` unchanged (the configured groups; the routing of one
      machine does not change).
    - Several nodes: ``(num_nodes, M)``, groups = nodes, so a token reaches at most M nodes. M is
      ``max_nodes_per_token``; None means DeepSeek-V3's 4, or every node when there are fewer. The configured
      ``n_groups`` / ``topk_groups`` are not used then: finer groups would not bound the nodes a token reaches.

    ValueError for an M that cannot work (not an int >= 1, more than the nodes), experts that do not split over
    the nodes, or ``topk`` experts that do not fit in M nodes' experts."""
    _check_groups(n_experts, topk, n_groups, topk_groups)
    if max_nodes_per_token is not None:
        check_int("max_nodes_per_token", max_nodes_per_token, 1)
    if nodes is None or nodes.num_nodes == 1:
        return n_groups, topk_groups
    num_nodes = nodes.num_nodes
    if max_nodes_per_token is None:
        m = min(DEFAULT_MAX_NODES_PER_TOKEN, num_nodes)
    elif max_nodes_per_token > num_nodes:
        raise ValueError(f"max_nodes_per_token={max_nodes_per_token} is more than the {num_nodes} nodes of the EP "
                         f"group ({nodes.ranks_per_node} ranks per node)")
    else:
        m = int(max_nodes_per_token)
    if n_experts % num_nodes:
        raise ValueError(f"n_experts={n_experts} must divide evenly over the {num_nodes} nodes")
    if topk > m * (n_experts // num_nodes):
        raise ValueError(f"topk={topk} experts do not fit in max_nodes_per_token={m} nodes of "
                         f"{n_experts // num_nodes} experts each")
    return num_nodes, m


class Router(nn.Module):
    """DeepSeek-V3 gate.

    Args:
        dim: hidden size of the tokens routed.
        n_experts: routed experts over all EP ranks.
        topk: experts per token.
        n_groups: expert groups (nodes); ``n_experts`` must divide by it.
        topk_groups: groups a token may use; ``topk_groups * n_experts / n_groups >= topk``.
        route_scale: factor on the normalised weights.
        bias_update_speed: the step of the balancing bias (gamma in the paper; 0 freezes it).

    ``forward(x)`` returns ``(topk_weights [tokens, topk] float32, topk_idx [tokens, topk] int64)`` and,
    in training mode, adds the number of tokens each expert received to ``self.load``.
    """

    def __init__(self, dim: int, n_experts: int, topk: int, n_groups: int = 1, topk_groups: int = 1,
                 route_scale: float = 1.0, bias_update_speed: float = 1e-3):
        super().__init__()
        check_int("dim", dim, 1)
        _check_groups(n_experts, topk, n_groups, topk_groups)
        # (bias_update_speed 0 is allowed: DeepSeek-V3 freezes the bias for its last 500B tokens)
        for name, value, zero_ok in (("route_scale", route_scale, False), ("bias_update_speed", bias_update_speed, True)):
            if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0
                    or (value == 0 and not zero_ok)):
                raise ValueError(f"{name} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {value!r}")
        self.dim, self.n_experts, self.topk = dim, n_experts, topk
        self.n_groups, self.topk_groups = n_groups, topk_groups
        self.route_scale, self.bias_update_speed = route_scale, bias_update_speed
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        nn.init.normal_(self.weight, std=dim ** -0.5)
        # (fp32 whatever the module is cast to: see `_apply`)
        self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32))
        self.register_buffer("load", torch.zeros(n_experts, dtype=torch.float32), persistent=False)

    def _apply(self, fn, recurse=True):
        """``.to(device)`` moves the balancing state; a cast (``.to(torch.bfloat16)``, ``.half()``) leaves it
        in fp32: in bf16 the token count would stop at 256 and bias steps of 1e-3 would round away."""
        super()._apply(fn, recurse)
        for name in ("bias", "load"):
            buf = self._buffers.get(name)
            if buf is not None and buf.dtype != torch.float32:
                self._buffers[name] = buf.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        topk_idx = group_limited_topk(scores.detach(), self.bias, self.topk, self.n_groups, self.topk_groups)
        weights = scores.gather(1, topk_idx)
        # (a floor for scores that underflow to 0: such weights come out 0, not NaN)
        total = weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
        weights = weights / total * self.route_scale
        if self.training:
            with torch.no_grad():
                self.load.index_add_(0, topk_idx.flatten(), torch.ones(topk_idx.numel(), dtype=self.load.dtype, device=x.device))
        return weights, topk_idx

    @torch.no_grad()
    def update_bias(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Move the bias against the load counted since the last call (summed over ``group`` when
        given, so every rank makes the same update) and reset the count. Returns the load used."""
        return update_biases([self], group)[0]


@torch.no_grad()
def update_biases(routers: list[Router], group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """`Router.update_bias` for several routers with one all-reduce. With ``group``, every rank must pass as
    many routers of the same sizes: the ranks first compare their counts (one small all-reduce) and all raise
    ValueError if they differ, before the loads' all-reduce."""
    sizes = [r.n_experts for r in routers]
    if group is not None:
        shape = [len(routers), sum(sizes), max(sizes, default=0)]
        words = torch.tensor(shape + [-v for v in shape], dtype=torch.int64,
                             device=routers[0].load.device if routers else _group_device(group))
        dist.all_reduce(words, op=dist.ReduceOp.MAX, group=group)
        most, least = words[:3].tolist(), [-v for v in words[3:].tolist()]
        if most != least:
            raise ValueError(f"update_biases: the ranks pass different routers (count, experts in all, largest "
                             f"from {least} to {most}); every rank must pass the same routers")
    if not routers:
        return []
    if len(set(sizes)) > 1:
        raise ValueError(f"update_biases: routers of different sizes {sorted(set(sizes))}: call it once per size")
    loads = torch.stack([r.load for r in routers])
    if group is not None:
        dist.all_reduce(loads, group=group)
    for router, load in zip(routers, loads):
        router.bias += router.bias_update_speed * torch.sign(load.mean() - load)
        router.load.zero_()
    return list(loads)


def _group_device(group) -> torch.device:
    """Where tensors for ``group``'s collectives live: the current CUDA device for NCCL, else the CPU."""
    if str(dist.get_backend(group)).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
