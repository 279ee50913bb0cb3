"""A tiny DeepSeek-style model: RMSNorm, causal attention with RoPE, MoE blocks, embedding tied to the head.

The model is built as DualPipeV stage modules: ``2 * pp`` stages, pipeline rank ``r`` holding stage ``r``
(module 0) and stage ``2 * pp - 1 - r`` (module 1), so rank 0 holds both the embedding and the head and can
share one weight. Every stage module's forward is a list of pieces (`pieces()`), which is what lets
`overlapped_forward_backward` interleave one micro-batch's forward with another's backward.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from smsplit.moe import overlap
from smsplit.moe.layer import Dispatched, MoE, init_moe_
from smsplit.moe.overlap import COMM, COMPUTE, INLINE, PieceRunner, run_taped
from smsplit.pipeline.weight_grad import Linear


@dataclass
class ModelConfig:
    """The model's sizes: the token vocabulary, model width ``dim``, ``n_layers`` blocks (split evenly over the
    ``2 * pp`` stages), attention heads, and each MoE block's ``n_experts`` routed experts of width ``inter_dim``
    (``topk`` per token, chosen within ``topk_groups`` of ``n_groups`` groups, weights scaled by ``route_scale``)
    beside ``n_shared`` shared experts; ``seq_len`` tokens per sequence; ``fp8_dispatch``: tokens cross ranks in
    FP8 e4m3; ``rope_theta``: RoPE's base; ``max_nodes_per_token``: when the EP group spans several nodes, the
    groups are the nodes and a token reaches at most this many of them (None: DeepSeek-V3's 4, or every node when
    there are fewer; see `smsplit.moe.router.node_limited_groups`), and ``n_groups`` / ``topk_groups`` apply on one
    node only. Bad values raise ValueError when the config is made."""

    vocab_size: int = 64
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    inter_dim: int = 64  # per expert; the shared expert has n_shared * inter_dim
    n_experts: int = 8
    topk: int = 2
    n_groups: int = 4
    topk_groups: int = 2
    n_shared: int = 1
    route_scale: float = 1.0
    seq_len: int = 32
    fp8_dispatch: bool = True
    rope_theta: float = 10000.0
    max_nodes_per_token: int | None = None

    def __post_init__(self) -> None:
        """Reject a model that cannot be built or would train on NaN (``rope_theta <= 0``), before any process
        starts (the router and the layer check their own arguments again)."""
        from smsplit.moe.router import _check_groups

        for name in ("vocab_size", "dim", "n_layers", "n_heads", "inter_dim", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim={self.dim} must split into n_heads={self.n_heads} heads of an even size (RoPE)")
        if isinstance(self.n_shared, bool) or not isinstance(self.n_shared, int) or self.n_shared < 0:
            raise ValueError(f"n_shared must be an int >= 0, got {self.n_shared!r}")
        for name in ("route_scale", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.fp8_dispatch, bool):
            raise ValueError(f"fp8_dispatch must be a bool, got {self.fp8_dispatch!r}")
        if self.fp8_dispatch and self.dim % 128:
            raise ValueError(f"dim={self.dim}: FP8 dispatch quantizes in tiles of 128 values, so dim must be a "
                             f"multiple of 128 (or fp8_dispatch=False)")
        _check_groups(self.n_experts, self.topk, self.n_groups, self.topk_groups)
        m = self.max_nodes_per_token
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_nodes_per_token must be None or an int >= 1, got {m!r}")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[batch, heads, seq, head_dim]``."""
    seq, half = x.size(-2), x.size(-1) // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(seq, device=x.device, dtype=torch.float32)[:, None] * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, rope_theta: float):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_theta = n_heads, dim // n_heads, rope_theta
        self.wqkv = Linear(dim, 3 * dim, bias=False)
        self.wo = Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.wqkv(x).view(b, s, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rope(q, self.rope_theta), rope(k, self.rope_theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    """Pre-norm attention and MoE, each with a residual; forward in four pieces."""

    def __init__(self, cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1, buffer=None, nodes=None):
        super().__init__()
        self.attn_norm, self.moe_norm = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.n_heads, cfg.rope_theta)
        self.moe = MoE(cfg.dim, cfg.inter_dim, cfg.n_experts, cfg.topk, cfg.n_groups, cfg.topk_groups,
                       cfg.n_shared, cfg.route_scale, ep_rank, ep_size, cfg.fp8_dispatch, buffer=buffer, nodes=nodes,
                       max_nodes_per_token=cfg.max_nodes_per_token)

    def attention(self, h):
        h = h + self.attn(self.attn_norm(h))
        x = self.moe_norm(h).flatten(0, -2)
        weights, idx = self.moe.route(x)
        return h, x, weights, idx

    def dispatch(self, h, x, weights, idx):
        d = self.moe.dispatch(x, weights, idx)
        return h, x, d.x, d.topk_idx, d.topk_weights, d.handle, d.counts

    def experts(self, h, x, recv_x, recv_idx, recv_weights, handle, counts):
        rows, shared = self.moe.compute(x, Dispatched(recv_x, recv_idx, recv_weights, handle, counts))
        return h, rows, shared, handle

    def combine(self, h, rows, shared, handle):
        y = self.moe.combine(rows, handle)
        if shared is not None:
            y = y + shared
        return h + y.view_as(h)

    def pieces(self, i: int) -> list:
        return [(COMPUTE, f"attn.{i}", self.attention), (COMM, f"dispatch.{i}", self.dispatch),
                (COMPUTE, f"mlp.{i}", self.experts), (COMM, f"combine.{i}", self.combine)]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        state = (h,)
        for _, _, fn in self.pieces(0):
            state = fn(*state)
            state = state if isinstance(state, tuple) else (state,)
        return state[0]


class Stage(nn.Module):
    """One pipeline stage: optional embedding, ``len(layer_ids)`` blocks, optional final norm and head.

    Args:
        cfg: the model.
        layer_ids: which layers of ``cfg.n_layers`` this stage holds (they seed the weights).
        first, last: whether it has the embedding / the head.
        embedding: the embedding to tie the head to (the first stage's, when both live on one rank);
            a last stage without one makes its own.
        ep_rank, ep_size: place in the expert-parallel group.
        seed: weights are a function of (seed, layer id) only: the same on every rank, device and EP size
            (drawn on the CPU at full expert count). None keeps PyTorch's default initialisation, drawn where
            the module is built (``with torch.device("cuda"): ...``), for benchmarks at full width.
        runner: the `PieceRunner` that decides where the pieces run and records their times (None: in order on
            the current stream, unrecorded).
        buffer: the `smsplit.ep.Buffer` over the EP group, for every block's MoE layer (needed when
            ``ep_size > 1``).
        nodes: the `smsplit.nodes.NodeLayout` of the EP group, or None (one node): across nodes every block's
            router limits tokens to ``cfg.max_nodes_per_token`` nodes (see `MoE`).
    """

    def __init__(self, cfg: ModelConfig, layer_ids, first: bool = False, last: bool = False,
                 embedding: nn.Embedding | None = None, ep_rank: int = 0, ep_size: int = 1,
                 seed: int | None = 0, runner: PieceRunner | None = None, buffer=None, nodes=None):
        super().__init__()
        self.cfg, self.first, self.last = cfg, first, last
        self.layer_ids = list(layer_ids)
        self.blocks = nn.ModuleList(Block(cfg, ep_rank, ep_size, buffer, nodes) for _ in self.layer_ids)
        if (first or last) and embedding is None:
            embedding = nn.Embedding(cfg.vocab_size, cfg.dim)
            if seed is not None:
                with torch.no_grad():
                    gen = torch.Generator().manual_seed(seed)
                    embedding.weight.copy_(torch.randn(embedding.weight.shape, generator=gen) * cfg.dim ** -0.5)
        self.embedding = embedding if first else None
        self.head_weight = embedding.weight if last else None  # tied
        self.norm = RMSNorm(cfg.dim) if last else None
        if seed is not None:
            for layer, block in zip(self.layer_ids, self.blocks):
                _init_block_(block, seed * 1_000_003 + layer + 1)
        self.runner = INLINE if runner is None else runner

    def _embed(self, ids):
        return self.embedding(ids)

    def _head(self, h):
        return F.linear(self.norm(h), self.head_weight)

    def pieces(self) -> list:
        out = [(COMPUTE, "embed", self._embed)] if self.first else []
        for layer, block in zip(self.layer_ids, self.blocks):
            out += block.pieces(layer)
        if self.last:
            out.append((COMPUTE, "head", self._head))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_taped(self.pieces(), (x,), self.runner)

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                                    output_grads1):
        """DualPipe's hook (see `smsplit.moe.overlap.overlapped_forward_backward`)."""
        return overlap.overlapped_forward_backward(module0, inputs0, criterion0, labels0, module1, loss1,
                                                   outputs1, output_grads1)


def _init_block_(block: Block, seed: int) -> None:
    init_moe_(block.moe, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.startswith("moe."):
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def build_stages(cfg: ModelConfig, pp_rank: int = 0, pp_size: int = 1, ep_rank: int = 0, ep_size: int = 1,
                 seed: int = 0, runner: PieceRunner | None = None, buffer=None,
                 nodes=None) -> tuple[Stage, Stage]:
    """DualPipeV's two modules of pipeline rank ``pp_rank``: stage ``pp_rank`` and stage
    ``2 * pp_size - 1 - pp_rank`` of ``2 * pp_size`` stages of ``cfg.n_layers`` layers, both with ``runner``,
    ``buffer`` and ``nodes`` (see `Stage`)."""
    for name, value in (("pp_size", pp_size), ("pp_rank", pp_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "pp_size" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'pp_size' else 0}, got {value!r}")
    if pp_rank >= pp_size:
        raise ValueError(f"pp_rank must lie in [0, pp_size={pp_size}), got {pp_rank}")
    n_stages = 2 * pp_size
    if cfg.n_layers % n_stages:
        raise ValueError(f"n_layers={cfg.n_layers} must divide into 2 * pp_size = {n_stages} stages")
    per = cfg.n_layers // n_stages
    s0, s1 = pp_rank, n_stages - 1 - pp_rank
    m0 = Stage(cfg, range(s0 * per, (s0 + 1) * per), first=s0 == 0, ep_rank=ep_rank, ep_size=ep_size, seed=seed,
               runner=runner, buffer=buffer, nodes=nodes)
    m1 = Stage(cfg, range(s1 * per, (s1 + 1) * per), last=s1 == n_stages - 1, embedding=m0.embedding,
               ep_rank=ep_rank, ep_size=ep_size, seed=seed, runner=runner, buffer=buffer, nodes=nodes)
    return m0, m1
