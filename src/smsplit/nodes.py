"""Which ranks of a process group share a machine (a node), and the bytes a dispatch moves between nodes.

Expert parallelism across machines moves tokens over two kinds of link: NVLink (or PCIe) inside a node and the
network (one NIC per GPU) between nodes. DeepSeek-V3's hierarchical path sends a token over the network once per
target node, to the GPU with the same local index there, which forwards it inside its node to every GPU holding
one of the token's experts. This module holds what that path needs to know about the group, and nothing that
moves data:

- `NodeLayout`: ranks per node, number of nodes, the node and local index of a rank, the ranks of a node and a
  rank's peers (same local index, other nodes). Supported layouts: every node holds the same number of ranks and
  the ranks of a node are contiguous in the group (group rank ``r`` on node ``r // ranks_per_node``), which is what
  torchrun's default rank assignment gives.
- `node_layout(group, ranks_per_node=None)`: the layout of a process group, from an explicit ``ranks_per_node``
  (one machine pretending to be several nodes), else from the launcher (``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` as
  torchrun sets them), else from the host names of the ranks. One exchange over the group; every rank raises the
  same ValueError for a layout that cannot work, before anything else runs.
- `check_launch_env(group)`: every rank sees the same values of the NCCL / NVSHMEM / multicast variables that must
  agree across a job (`AGREED_LAUNCH_ENV`); one exchange, the same ValueError on every rank naming what differs.
- `count_node_bytes` / `node_bytes_from_topk`: the bytes one rank's tokens move across node boundaries and inside
  nodes, on the hierarchical path and on a flat all-to-all (the byte count behind a dispatch's report and behind
  `smsplit.ep_projection`).
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._args import check_int

SUPPORTED_LAYOUTS = ("supported layouts: the same number of ranks on every node, the ranks of a node contiguous in "
                     "the group (group rank r on node r // ranks_per_node), as torchrun's default rank assignment "
                     "gives; pass ranks_per_node=N to treat each N consecutive ranks as one node")


@dataclass(frozen=True)
class NodeLayout:
    """``num_nodes`` nodes of ``ranks_per_node`` ranks each; group rank ``r`` lives on node
    ``r // ranks_per_node`` at local index ``r % ranks_per_node``. ``source`` says where the layout came from
    ("explicit", "launcher", "hostname" or "single process"), for messages and reports."""

    ranks_per_node: int
    num_nodes: int
    source: str = "explicit"

    def __post_init__(self) -> None:
        check_int("ranks_per_node", self.ranks_per_node, 1)
        check_int("num_nodes", self.num_nodes, 1)

    @property
    def group_size(self) -> int:
        return self.ranks_per_node * self.num_nodes

    @property
    def spans_nodes(self) -> bool:
        """True when the group covers more than one node (the network leg exists)."""
        return self.num_nodes > 1

    def _check_rank(self, rank) -> int:
        return check_int("rank", rank, 0, stop=self.group_size)

    def node_of(self, rank: int) -> int:
        return self._check_rank(rank) // self.ranks_per_node

    def local_index(self, rank: int) -> int:
        return self._check_rank(rank) % self.ranks_per_node

    def ranks_of_node(self, node: int) -> list[int]:
        node = check_int("node", node, 0, stop=self.num_nodes)
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def peers(self, rank: int) -> list[int]:
        """The ranks with ``rank``'s local index on the other nodes, in node order: the only ranks its network
        leg talks to on the hierarchical path."""
        node, local = divmod(self._check_rank(rank), self.ranks_per_node)
        return [n * self.ranks_per_node + local for n in range(self.num_nodes) if n != node]

    def node_of_expert(self, expert: int, num_experts: int) -> int:
        """The node holding ``expert`` of ``num_experts`` laid out contiguously over the group's ranks (rank ``r``
        holds experts ``[r * E / size, (r + 1) * E / size)``, DeepEP's layout), so node ``n`` holds the ``n``-th
        contiguous ``E / num_nodes`` of them."""
        check_int("num_experts", num_experts, 1)
        if num_experts % self.group_size:
            raise ValueError(f"num_experts={num_experts} must divide evenly over the {self.group_size} ranks")
        return check_int("expert", expert, 0, stop=num_experts) // (num_experts // self.num_nodes)


def layout_from_node_keys(keys: list, source: str) -> NodeLayout:
    """The layout of a group whose rank ``r`` runs on the node named ``keys[r]`` (a host name, a launcher's node
    rank). ValueError, naming the offending ranks, where the nodes hold different numbers of ranks or a node's
    ranks are not contiguous in the group."""
    if not keys:
        raise ValueError("an empty group has no node layout")
    runs: list[tuple[object, int, int]] = []  # (key, first rank, count)
    for rank, key in enumerate(keys):
        if runs and runs[-1][0] == key:
            runs[-1] = (key, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((key, rank, 1))
    seen: dict = {}
    for key, first, count in runs:
        if key in seen:
            earlier = seen[key]
            raise ValueError(f"node layout ({source}): the ranks of node {key!r} are not contiguous in the group "
                             f"(ranks {earlier[0]}..{earlier[0] + earlier[1] - 1} and {first}..{first + count - 1}, "
                             f"other nodes' ranks between them); {SUPPORTED_LAYOUTS}")
        seen[key] = (first, count)
    sizes = {count for _, _, count in runs}
    if len(sizes) > 1:
        detail = ", ".join(f"{key!r}: {count} (ranks {first}..{first + count - 1})" for key, first, count in runs)
        raise ValueError(f"node layout ({source}): the nodes hold different numbers of ranks ({detail}); "
                         f"{SUPPORTED_LAYOUTS}")
    return NodeLayout(ranks_per_node=runs[0][2], num_nodes=len(runs), source=source)


def _launcher_node() -> tuple[str | None, str | None]:
    """(LOCAL_WORLD_SIZE, node rank) as the launcher set them; the node rank is torchrun's GROUP_RANK, or None."""
    return os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("GROUP_RANK")


def _decide(infos: list[tuple], group_size: int) -> NodeLayout:
    """The layout from every rank's ``(ranks_per_node, LOCAL_WORLD_SIZE, GROUP_RANK, global rank, host)``, in group
    order. Every rank runs this on the same list, so every rank returns the same layout or raises the same error."""
    explicit = [info[0] for info in infos]
    if any(value is not None for value in explicit):
        if len(set(explicit)) > 1:
            detail = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(explicit))
            raise ValueError(f"node layout: the ranks pass different ranks_per_node ({detail}); every rank of the "
                             f"group must pass the same value")
        n = explicit[0]
        check_int("ranks_per_node", n, 1)
        if group_size % n:
            raise ValueError(f"node layout: ranks_per_node={n} does not divide the group's {group_size} ranks into "
                             f"whole nodes; {SUPPORTED_LAYOUTS}")
        return NodeLayout(ranks_per_node=int(n), num_nodes=group_size // int(n), source="explicit")
    local_sizes = [info[1] for info in infos]
    if any(value is not None for value in local_sizes):
        if len(set(local_sizes)) > 1:
            detail = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(local_sizes))
            raise ValueError(f"node layout: LOCAL_WORLD_SIZE differs across the ranks ({detail}); launch every "
                             f"node with the same number of processes (torchrun --nproc-per-node) or pass "
                             f"ranks_per_node")
        try:
            local = int(local_sizes[0])
        except ValueError:
            local = 0
        if local < 1:
            raise ValueError(f"node layout: LOCAL_WORLD_SIZE={local_sizes[0]!r} is not an int >= 1")
        # torchrun's node rank (GROUP_RANK) names the node; without it, its default assignment puts global rank g
        # on node g // LOCAL_WORLD_SIZE
        keys = [int(info[2]) if info[2] is not None else info[3] // local for info in infos]
        return layout_from_node_keys(keys, "launcher")
    return layout_from_node_keys([info[4] for info in infos], "hostname")


NODE_ROW_WORDS = 5  # `node_row`'s words


def node_row(ranks_per_node: int | None, global_rank: int) -> list[int]:
    """This rank's facts for `layout_from_rows`, as int64 words (so that `smsplit.ep.Buffer` gathers them with its
    bounded header exchange): ``ranks_per_node`` (-1: none), ``LOCAL_WORLD_SIZE`` (-1: unset, -2: not an int),
    ``GROUP_RANK`` (-1: unset, -2: not an int), the global rank, and 62 bits of a hash of the host name."""
    def word(value: str | None) -> int:
        if value is None:
            return -1
        try:
            return int(value)
        except ValueError:
            return -2
    local_size, group_rank = _launcher_node()
    return [-1 if ranks_per_node is None else int(ranks_per_node), word(local_size), word(group_rank),
            int(global_rank), _value_word(socket.gethostname())]


def layout_from_rows(rows) -> NodeLayout:
    """The layout from every rank's `node_row`, in group order (``rows``: ``[group size, NODE_ROW_WORDS]`` ints):
    the decision of `node_layout`, which every rank reaches alike from the same rows (the same ValueError where the
    layout cannot work)."""
    def value(word: int):
        return None if word == -1 else ("not an int" if word == -2 else int(word))
    infos = [(value(row[0]), value(row[1]), value(row[2]), int(row[3]), int(row[4])) for row in rows]
    return _decide(infos, len(infos))


def node_layout(group: dist.ProcessGroup | None = None, ranks_per_node: int | None = None) -> NodeLayout:
    """The node layout of ``group`` (the default group when None), agreed by all its ranks.

    ``ranks_per_node=N`` makes each N consecutive ranks one node, whatever machines they run on (one machine
    pretending to be several nodes, for tests and for measuring the algorithm). Without it, nodes are the
    launcher's (torchrun's ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``), else the ranks' host names.

    A collective over ``group`` (one all-gather of a few small Python objects): every rank must call it. Every rank
    raises the same ValueError for a layout that cannot work: ranks passing different ``ranks_per_node``, N not
    dividing the group, nodes of different sizes or with ranks not contiguous in the group. Without an initialized
    process group the layout is one node of one rank."""
    if ranks_per_node is not None:
        check_int("ranks_per_node", ranks_per_node, 1)
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("node_layout: a group was passed but torch.distributed is not initialized")
        if ranks_per_node not in (None, 1):
            raise ValueError(f"node layout: ranks_per_node={ranks_per_node} does not divide a single process "
                             f"(torch.distributed is not initialized)")
        return NodeLayout(1, 1, source="single process")
    size = dist.get_world_size(group)
    local_size, group_rank = _launcher_node()
    mine = (None if ranks_per_node is None else int(ranks_per_node), local_size, group_rank, dist.get_rank(),
            socket.gethostname())
    infos: list = [None] * size
    dist.all_gather_object(infos, mine, group=group)
    return _decide(infos, size)


# Variables NCCL, torch's symmetric memory and NVSHMEM read in each process, whose values must be the same in every
# process of a job: ranks that disagree on NCCL's algorithms, protocols or network, on NVLink multicast, or on
# NVSHMEM's transport or heap size fail inside the first collective or allocation, as a hang or a crash that names
# none of them. A node launched without an `export` is the usual cause. Interface and NIC names (NCCL_SOCKET_IFNAME,
# NCCL_IB_HCA, NVSHMEM_HCA_LIST) may rightly differ between machines and are not checked.
AGREED_LAUNCH_ENV = ("NCCL_NVLS_ENABLE", "NCCL_ALGO", "NCCL_PROTO", "NCCL_IB_DISABLE", "NCCL_NET",
                     "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "NVSHMEM_REMOTE_TRANSPORT",
                     "NVSHMEM_IB_ENABLE_IBGDA", "NVSHMEM_SYMMETRIC_SIZE")


def env_disagreements(values: list[dict], names=AGREED_LAUNCH_ENV) -> list[str]:
    """For each variable of ``names`` whose value differs between the ranks' ``values`` (rank ``r``'s
    ``{name: value or None}``, None: unset), a line naming it and which ranks hold which value."""
    lines = []
    for name in names:
        by_value: dict = {}
        for rank, env in enumerate(values):
            by_value.setdefault(env.get(name), []).append(rank)
        if len(by_value) > 1:
            groups = "; ".join(f"{'unset' if v is None else repr(v)} on ranks {_ranks_text(r)}"
                               for v, r in sorted(by_value.items(), key=lambda item: item[1][0]))
            lines.append(f"{name}: {groups}")
    return lines


def _ranks_text(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _value_word(value: str | None) -> int:
    """A 62-bit hash of an environment value (-1: unset), for a comparison through int64 header words."""
    if value is None:
        return -1
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little") >> 2


def launch_env_words(names=AGREED_LAUNCH_ENV) -> list[int]:
    """This process's values of ``names`` as hashes (`check_launch_env_words` compares every rank's)."""
    return [_value_word(os.environ.get(name)) for name in names]


def check_launch_env_words(rows: list[list[int]], names=AGREED_LAUNCH_ENV) -> None:
    """`check_launch_env` from every rank's `launch_env_words` (``rows``, in group order), gathered by a bounded
    exchange such as `smsplit.ep.Buffer`'s: the same ValueError on every rank, naming each variable that differs
    and which ranks share a value (the values themselves did not travel)."""
    values = [{name: (None if word == -1 else f"value #{word % 9973}") for name, word in zip(names, row)}
              for row in rows]
    if lines := env_disagreements(values, names):
        raise ValueError("launch environment: the ranks were started with different values of variables that "
                         "every process must share (export them the same way on every node):\n  "
                         + "\n  ".join(lines))


def check_launch_env(group: dist.ProcessGroup | None = None, names=AGREED_LAUNCH_ENV) -> dict:
    """This process's values of ``names`` (None: unset), after checking that every rank of ``group`` (the default
    group when None) sees the same ones.

    A collective over ``group`` (one all-gather of a few strings): every rank must call it, before the first NCCL
    collective or symmetric-memory allocation that the variables steer. Every rank raises the same ValueError,
    naming each variable that differs and the ranks on each side, so that a node launched with a different
    environment is an error at start-up, not a hang in the first dispatch. Without an initialized process group
    there is nothing to compare."""
    names = tuple(names)
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"names must be environment variable names, got {names!r}")
    mine = {name: os.environ.get(name) for name in names}
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("check_launch_env: a group was passed but torch.distributed is not initialized")
        return mine
    values: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, mine, group=group)
    if lines := env_disagreements(values, names):
        raise ValueError("launch environment: the ranks were started with different values of variables that "
                         "every process must share (export them the same way on every node):\n  "
                         + "\n  ".join(lines))
    return mine


def token_bytes(hidden: int, fp8: bool, scale_block: int = 128, scale_bytes: int = 4, value_bytes: int = 2) -> int:
    """Bytes of one token row on the wire: FP8 e4m3 (1 byte a value) plus one ``scale_bytes`` scale per
    ``scale_block`` values (smsplit's and DeepEP's 1x128 fp32 scales: 7392 bytes at hidden 7168), or
    ``value_bytes`` a value unquantized (BF16: 14336 bytes at hidden 7168). Metadata (top-k ids and weights, source
    index) is not counted: DeepEP's figures do not count it either."""
    check_int("hidden", hidden, 1)
    if fp8:
        return hidden + scale_bytes * -(-hidden // scale_block)
    return value_bytes * hidden


@dataclass(frozen=True)
class NodeBytes:
    """The bytes one source rank's tokens move in one dispatch (a combine of the same handle moves the same rows
    the other way, with its own bytes per row; on the hierarchical path it sums a token's rows inside each node
    before the network leg, so its network bytes are the dispatch's counts).

    Hierarchical path (one network crossing per target node other than the token's own, then NVLink inside the
    target node):
        internode_bytes: rows that leave the source's node: one per (token, target node other than its own).
        intranode_bytes: rows that move between GPUs inside a node: on each target node, from the GPU that
            received the token (same local index as the source; the source itself on its own node) to every other
            GPU of that node holding one of the token's experts.
        local_bytes: rows that stay on the source rank (its own experts): no link carries them.
    Flat all-to-all (one copy per destination rank, as the reference backend and NCCL all-to-all send):
        flat_internode_bytes: one row per (token, destination rank on another node).
        flat_intranode_bytes: one row per (token, other destination rank on the source's node).
    For comparison with DeepEP's "RDMA GB/s":
        deepep_rdma_bytes: one row per (token, target node), the token's own node included (its test's
            ``num_rdma_token_sent * hidden * 2``, times ``(1 + 4/128) / 2`` for FP8): logical bytes, not bytes
            that leave the node.
    max_nodes_crossed: the most network crossings of any one token (at most M - 1 when a token's M target nodes
        include its own, M otherwise).
    """

    tokens: int
    bytes_per_token: int
    internode_bytes: int
    intranode_bytes: int
    local_bytes: int
    flat_internode_bytes: int
    flat_intranode_bytes: int
    deepep_rdma_bytes: int
    max_nodes_crossed: int

    def __add__(self, other: NodeBytes) -> NodeBytes:
        """The sum over source ranks (``bytes_per_token`` must agree)."""
        if self.bytes_per_token != other.bytes_per_token:
            raise ValueError(f"cannot add byte counts of {self.bytes_per_token} and {other.bytes_per_token} "
                             f"bytes a token")
        fields = ("tokens", "internode_bytes", "intranode_bytes", "local_bytes", "flat_internode_bytes",
                  "flat_intranode_bytes", "deepep_rdma_bytes")
        return NodeBytes(bytes_per_token=self.bytes_per_token,
                         max_nodes_crossed=max(self.max_nodes_crossed, other.max_nodes_crossed),
                         **{f: getattr(self, f) + getattr(other, f) for f in fields})


def tokens_per_node(is_token_in_rank: torch.Tensor, layout: NodeLayout) -> torch.Tensor:
    """``[num_nodes]`` int32: how many of the tokens of ``is_token_in_rank`` (``[tokens, group size]`` bool) go to
    each node, a token counted once per node it reaches (DeepEP's ``num_tokens_per_rdma_rank``)."""
    mask = is_token_in_rank.to(torch.bool)
    return mask.view(mask.size(0), layout.num_nodes, layout.ranks_per_node).any(-1).sum(0, dtype=torch.int32)


def count_node_bytes(is_token_in_rank: torch.Tensor, rank: int, layout: NodeLayout, bytes_per_token: int) -> NodeBytes:
    """`NodeBytes` of the tokens of group rank ``rank``, from ``is_token_in_rank`` ``[tokens, group size]`` bool
    (`Buffer.get_dispatch_layout`'s): whether each token goes to each rank. Pure arithmetic on the mask (any
    device; one host sync for the totals)."""
    rank = layout._check_rank(rank)
    check_int("bytes_per_token", bytes_per_token, 1)
    if (not isinstance(is_token_in_rank, torch.Tensor) or is_token_in_rank.dim() != 2
            or is_token_in_rank.size(1) != layout.group_size):
        shape = tuple(is_token_in_rank.shape) if isinstance(is_token_in_rank, torch.Tensor) else type(is_token_in_rank)
        raise ValueError(f"is_token_in_rank must be a [tokens, {layout.group_size}] tensor, got {shape}")
    mask = is_token_in_rank.bool()
    tokens = mask.size(0)
    per_node = mask.view(tokens, layout.num_nodes, layout.ranks_per_node)
    node, local = divmod(rank, layout.ranks_per_node)
    node_hit = per_node.any(-1)  # [tokens, nodes]
    other_nodes = torch.ones(layout.num_nodes, dtype=torch.bool, device=mask.device)
    other_nodes[node] = False
    crossings = (node_hit & other_nodes).sum(-1)
    # on every target node the GPU at the source's local index receives the token (on the source's own node: the
    # source itself) and forwards it to the node's other GPUs that hold its experts
    forwarded = per_node.sum(-1) - per_node[:, :, local].to(torch.int64)
    ranks_off_node = per_node[:, other_nodes, :].sum()
    own_node_others = per_node[:, node, :].sum() - mask[:, rank].sum()
    totals = torch.stack([crossings.sum(), forwarded.sum(), mask[:, rank].sum(), ranks_off_node, own_node_others,
                          node_hit.sum(), crossings.max() if tokens else crossings.new_zeros(())]).tolist()
    b = int(bytes_per_token)
    return NodeBytes(tokens=tokens, bytes_per_token=b, internode_bytes=totals[0] * b, intranode_bytes=totals[1] * b,
                     local_bytes=totals[2] * b, flat_internode_bytes=totals[3] * b,
                     flat_intranode_bytes=totals[4] * b, deepep_rdma_bytes=totals[5] * b,
                     max_nodes_crossed=int(totals[6]))


def is_token_in_rank_from_topk(topk_idx: torch.Tensor, num_experts: int, group_size: int) -> torch.Tensor:
    """``[tokens, group_size]`` bool: whether a token has an expert on each rank, experts laid out contiguously
    (rank ``r`` holds ``[r * E / size, (r + 1) * E / size)``); ids of -1 (no expert) are skipped."""
    check_int("num_experts", num_experts, 1)
    check_int("group_size", group_size, 1)
    if num_experts % group_size:
        raise ValueError(f"num_experts={num_experts} must divide evenly over the {group_size} ranks")
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [tokens, topk], got {tuple(topk_idx.shape)}")
    if topk_idx.numel() and (int(topk_idx.max()) >= num_experts or int(topk_idx.min()) < -1):
        raise ValueError(f"topk_idx must hold expert ids in [0, {num_experts}) or -1")
    from .ep.layout import compute_dispatch_layout  # (here: smsplit.ep's Buffer imports this module)

    return compute_dispatch_layout(topk_idx.long(), num_experts, group_size)[2]


def node_bytes_from_topk(topk_idx: torch.Tensor, num_experts: int, rank: int, layout: NodeLayout,
                         bytes_per_token: int) -> NodeBytes:
    """`count_node_bytes` of rank ``rank``'s tokens routed to ``topk_idx`` ``[tokens, topk]`` (-1: no expert)."""
    return count_node_bytes(is_token_in_rank_from_topk(topk_idx, num_experts, layout.group_size), rank, layout,
                            bytes_per_token)
