"""DeepSeek-style MoE layer: router, one shared expert, routed experts sharded over EP ranks, tokens moved
by `smsplit.ep.Buffer` (FP8 dispatch, BF16 combine), experts run as grouped GEMMs.

The layer's forward is four steps, which `smsplit.moe.overlap` runs one at a time to interleave them with
another micro-batch's backward:

    route (compute) -> dispatch (comm) -> experts + shared expert (compute) -> combine (comm)

Expert ``e`` of ``n_experts`` lives on EP rank ``e // (n_experts // ep_size)`` (DeepEP's layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from smsplit.moe.router import Router, node_limited_groups
from smsplit.pipeline.weight_grad import Linear, WeightGradStore

# Which implementation `grouped_mm` used, per (device type, dtype, "forward" / "weight"): "torch._grouped_mm"
# or "loop" (read by the benchmark so a fallback is never mistaken for the fast path).
GROUPED_MM_PATH: dict[tuple[str, torch.dtype, str], str] = {}


def _grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if a.dim() == 2 and b.dim() == 3:  # [T, K] x [E, K, N] -> [T, N], rows of group e use b[e]
        out = a.new_zeros(a.size(0), b.size(-1))
        for e, (s, t) in enumerate(zip(starts, ends)):
            if t > s:
                out[s:t] = a[s:t] @ b[e]
        return out
    # [K, T] x [T, N] -> [E, K, N], group e sums over columns / rows s:t
    return torch.stack([a[:, s:t] @ b[s:t] for s, t in zip(starts, ends)])


def _raw_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, what: str) -> torch.Tensor:
    if a.numel() == 0 or b.numel() == 0:
        # No rows, or (weight form) no tokens in any group: zeros, without asking torch._grouped_mm. Its CUDA check
        # refuses a zero-length contraction whatever the strides in some torch versions (pytorch/pytorch PR #192497);
        # where it raises, the first call would switch this key to the loop for good.
        if a.dim() == 2 and b.dim() == 3:
            return a.new_zeros(a.size(0), b.size(-1))
        return a.new_zeros(offs.numel(), a.size(0), b.size(-1))
    key = (a.device.type, a.dtype, what)
    path = GROUPED_MM_PATH.get(key)
    if path != "loop" and hasattr(torch, "_grouped_mm"):
        try:
            out = torch._grouped_mm(a, b, offs=offs)
            GROUPED_MM_PATH[key] = "torch._grouped_mm"
            return out
        except torch.cuda.OutOfMemoryError:
            raise
        except (RuntimeError, NotImplementedError):
            if path == "torch._grouped_mm":  # it worked before for this key: a real error
                raise
    GROUPED_MM_PATH[key] = "loop"
    return _grouped_mm_loop(a, b, offs)


class _GroupedMM(torch.autograd.Function):
    # torch._grouped_mm takes row-major (or, for the weights, column-major) operands only, so x, the weight and
    # the incoming gradient are made contiguous (no copy in the MoE layer, where they already are).

    @staticmethod
    def forward(ctx, x, weight, offs):
        x, weight_c = x.contiguous(), weight.contiguous()
        ctx.save_for_backward(x, weight_c, offs)
        # the deferred weight gradient goes to the weight itself, which must then be a leaf (a parameter): the
        # gradient of a weight computed from one (a cast, say) has to go on through autograd, so it is not deferred
        ctx.leaf_weight = weight if weight.is_leaf else None
        return _raw_grouped_mm(x, weight_c.transpose(-2, -1), offs, "forward")

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, offs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = _raw_grouped_mm(grad_out, weight, offs, "forward") if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None

        def weight_grad():
            return _raw_grouped_mm(grad_out.t(), x, offs, "weight")

        if WeightGradStore.enabled and ctx.leaf_weight is not None:
            weight = ctx.leaf_weight

            def deferred():
                grad = weight_grad()
                weight.grad = grad if weight.grad is None else weight.grad.add_(grad)

            WeightGradStore.put(deferred)
            return grad_x, None, None
        return grad_x, weight_grad(), None


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``x`` ``[T, K]`` times ``weight[e].T``, for ``weight`` ``[E, N, K]``
    (``nn.Linear`` layout) and ``offs`` ``[E]`` int32 cumulative row counts ending at ``T``. Returns ``[T, N]``.

    Uses ``torch._grouped_mm`` where the installed torch runs it for this device and dtype, else a loop of
    matmuls. Differentiable; while ``WeightGradStore.enabled`` the gradient of a leaf ``weight`` (a parameter)
    is deferred to the store (a weight computed from a parameter gets its gradient at once)."""
    return _GroupedMM.apply(x, weight, offs)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts run as two grouped GEMMs on expert-sorted tokens."""

    def __init__(self, num_experts: int, dim: int, inter_dim: int):
        super().__init__()
        self.num_experts, self.dim, self.inter_dim = num_experts, dim, inter_dim
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter_dim, dim))  # gate and up projections
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, inter_dim))
        nn.init.normal_(self.w13, std=dim ** -0.5)
        nn.init.normal_(self.w2, std=inter_dim ** -0.5)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        gate, up = grouped_mm(x, self.w13, offs).chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, self.w2, offs)


class MLP(nn.Module):
    """SwiGLU feed-forward (the shared expert) on deferred-weight-gradient Linears."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w13 = Linear(dim, 2 * inter_dim, bias=False)
        self.w2 = Linear(inter_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


def run_experts(experts: GroupedExperts, recv_x: torch.Tensor, recv_topk_idx: torch.Tensor,
                recv_topk_weights: torch.Tensor, counts: list[int] | None = None, alignment: int = 1) -> torch.Tensor:
    """For each received row, the sum over its local experts ``e`` (``recv_topk_idx >= 0``) of
    ``weight * expert_e(row)``; ``[rows, dim]`` in ``recv_x``'s dtype, zero for rows with no local expert.

    ``counts``: the exact token-expert pairs per local expert as a host list (what `Buffer.dispatch` returns as
    ``num_recv_tokens_per_expert_list`` with its default ``expert_alignment=1``: a list rounded up by a larger one
    gives wrong rows, unchecked); with it nothing here waits for the GPU. None counts them (a sync).
    Pairs are sorted by expert and each expert's group padded with zero rows to a multiple of ``alignment``
    (``torch._grouped_mm`` wants aligned groups on some GPUs)."""
    rows, topk = recv_topk_idx.shape
    n_experts, device = experts.num_experts, recv_x.device
    key = torch.where(recv_topk_idx >= 0, recv_topk_idx, n_experts).flatten()  # no expert: sorted last
    if counts is None:
        counts = torch.bincount(key, minlength=n_experts + 1)[:n_experts].tolist()
    n_pairs = sum(counts)
    order = torch.argsort(key, stable=True)[:n_pairs]
    pair_row = order // topk
    pair_weight = recv_topk_weights.flatten()[order]
    padded = [-(-c // alignment) * alignment for c in counts]
    offs = _host_to_device(torch.tensor(padded).cumsum(0).to(torch.int32), device)
    x_pairs = recv_x[pair_row]
    if alignment > 1 and padded != counts:
        pair_expert = key[order]
        start = _host_to_device(torch.tensor(counts).cumsum(0) - torch.tensor(counts), device)
        padded_start = _host_to_device(torch.tensor(padded).cumsum(0) - torch.tensor(padded), device)
        slot = padded_start[pair_expert] + torch.arange(n_pairs, device=device) - start[pair_expert]
        x_sorted = recv_x.new_zeros(sum(padded), recv_x.size(1)).index_copy(0, slot, x_pairs)
        y_pairs = experts(x_sorted, offs)[slot]
    else:
        y_pairs = experts(x_pairs, offs)
    y_pairs = y_pairs * pair_weight.to(y_pairs.dtype).unsqueeze(1)
    return recv_x.new_zeros(rows, recv_x.size(1)).index_add(0, pair_row, y_pairs)


def _host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class Dispatched:
    """What a dispatch hands the expert step: received rows, their local expert ids (-1: elsewhere) and
    weights, and the handle that combine needs (None without EP)."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    handle: object
    counts: list[int] | None = None  # token-expert pairs per local expert (host), if known


class MoE(nn.Module):
    """DeepSeek-V3 MoE: ``shared(x) + sum_k w_k * expert_{i_k}(x)``.

    Args:
        dim, inter_dim: hidden size and each expert's intermediate size.
        n_experts, topk, n_groups, topk_groups, route_scale: routing (see `Router`); across nodes the groups
            are the nodes (see ``nodes``).
        n_shared: shared experts (one MLP of ``n_shared * inter_dim``).
        ep_rank, ep_size: this rank's place in the EP group; it holds experts
            ``[ep_rank * n_experts // ep_size, (ep_rank + 1) * n_experts // ep_size)``.
        fp8_dispatch: tokens travel in FP8 e4m3 (1x128 scales) and are dequantized on arrival; the
            backward of dispatch (a combine of gradients) travels in the tokens' dtype.
        expert_alignment: pad each expert's token group to this many rows for the grouped GEMM.
        combine_dtype: dtype of the expert outputs on the wire in combine (BF16 as in DeepSeek-V3); None
            keeps the activations' dtype.
        buffer: the `smsplit.ep.Buffer` over the EP group that moves the tokens; needed when ``ep_size > 1``
            (one buffer can serve every layer of a rank), unused when ``ep_size == 1``.
        nodes: the `smsplit.nodes.NodeLayout` of the EP group (``nodes.group_size == ep_size``), or None (one
            node). When it spans several nodes the router limits each token to ``max_nodes_per_token`` of them
            (`smsplit.moe.router.node_limited_groups`: groups = nodes, DeepSeek-V3's node-limited routing).
        max_nodes_per_token: M, the most nodes a token reaches when the EP group spans nodes (None: 4, or every
            node when there are fewer); unused on one node.
    """

    def __init__(self, dim: int, inter_dim: int, n_experts: int, topk: int, n_groups: int = 1,
                 topk_groups: int = 1, n_shared: int = 1, route_scale: float = 1.0, ep_rank: int = 0,
                 ep_size: int = 1, fp8_dispatch: bool = True, expert_alignment: int = 1,
                 combine_dtype: torch.dtype | None = torch.bfloat16, buffer=None, nodes=None,
                 max_nodes_per_token: int | None = None):
        super().__init__()
        for name, value in (("ep_size", ep_size), ("expert_alignment", expert_alignment), ("inter_dim", inter_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(ep_rank, bool) or not isinstance(ep_rank, int) or not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank must be an int in [0, ep_size={ep_size}), got {ep_rank!r}")
        if isinstance(n_shared, bool) or not isinstance(n_shared, int) or n_shared < 0:
            raise ValueError(f"n_shared must be an int >= 0, got {n_shared!r}")
        if fp8_dispatch and ep_size > 1 and dim % 128:
            raise ValueError(f"dim={dim}: FP8 dispatch quantizes in tiles of 128 values, so dim must be a multiple "
                             f"of 128 (or fp8_dispatch=False)")
        if n_experts % ep_size:
            raise ValueError(f"n_experts={n_experts} must divide evenly over ep_size={ep_size} ranks")
        if nodes is not None and nodes.group_size != ep_size:
            raise ValueError(f"nodes: a layout of {nodes.group_size} ranks ({nodes.num_nodes} nodes of "
                             f"{nodes.ranks_per_node}) for an EP group of ep_size={ep_size}")
        n_groups, topk_groups = node_limited_groups(n_experts, topk, n_groups, topk_groups, nodes,
                                                    max_nodes_per_token)
        self.nodes = nodes
        self.n_experts, self.ep_rank, self.ep_size = n_experts, ep_rank, ep_size
        self.n_local_experts = n_experts // ep_size
        self.fp8_dispatch, self.expert_alignment, self.combine_dtype = fp8_dispatch, expert_alignment, combine_dtype
        self.router = Router(dim, n_experts, topk, n_groups, topk_groups, route_scale)
        self.experts = GroupedExperts(self.n_local_experts, dim, inter_dim)
        self.shared = MLP(dim, n_shared * inter_dim) if n_shared > 0 else None
        self.buffer = buffer

    # The four steps of forward, in order.

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[tokens, dim]`` -> ``(topk_weights, topk_idx)``."""
        return self.router(x)

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_idx: torch.Tensor) -> Dispatched:
        if self.buffer is None:
            if self.ep_size != 1:
                raise RuntimeError(f"ep_size={self.ep_size}: the layer needs an smsplit.ep.Buffer over its EP group "
                                   f"(MoE(..., buffer=...))")
            return Dispatched(x, topk_idx, topk_weights, None, None)
        if (self.buffer.group_size, self.buffer.rank) != (self.ep_size, self.ep_rank):
            raise ValueError(f"moe.buffer: its group has {self.buffer.group_size} ranks and this is rank "
                             f"{self.buffer.rank}, but the layer was made with ep_size={self.ep_size}, "
                             f"ep_rank={self.ep_rank} (it holds the experts of that rank)")
        per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx, self.n_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = self.buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights, fp8=self.fp8_dispatch, dequantize=self.fp8_dispatch)
        return Dispatched(recv_x, recv_idx, recv_w, handle, counts)

    def compute(self, x: torch.Tensor, dispatched: Dispatched) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Routed experts on the received rows, and the shared expert on this rank's tokens ``x``."""
        rows = run_experts(self.experts, dispatched.x, dispatched.topk_idx, dispatched.topk_weights,
                           dispatched.counts, self.expert_alignment)
        return rows, (self.shared(x) if self.shared is not None else None)

    def combine(self, rows: torch.Tensor, handle) -> torch.Tensor:
        if handle is None:
            return rows
        combined, _, _ = self.buffer.combine(rows.to(self.combine_dtype or rows.dtype), handle)
        return combined.to(rows.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, idx = self.route(x)
        dispatched = self.dispatch(x, weights, idx)
        rows, shared = self.compute(x, dispatched)
        y = self.combine(rows, dispatched.handle)
        return (y if shared is None else y + shared).view(shape)


def init_moe_(moe: MoE, seed: int) -> None:
    """Initialise ``moe`` from ``seed`` so that every EP layout of the same layer holds the same global
    weights: rank ``r`` of ``ep_size`` gets rows ``r * n_local:(r + 1) * n_local`` of the full expert tensors
    (drawn on the CPU, so CPU and GPU runs agree)."""
    gen = torch.Generator().manual_seed(seed)
    n, lo = moe.n_local_experts, moe.ep_rank * moe.n_local_experts
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if name.startswith("experts."):
                full = torch.randn((moe.n_experts, *p.shape[1:]), generator=gen) * p.shape[-1] ** -0.5
                p.copy_(full[lo:lo + n])
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
