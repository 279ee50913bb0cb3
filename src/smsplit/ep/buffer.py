"""`Buffer`: expert-parallel dispatch and combine with the shape of DeepEP's normal (high-throughput) kernels.

A thin front: it checks the arguments (`smsplit.ep.checks`), agrees on them with the other ranks (the header of
`smsplit.ep.header`, exchanged by the reference transport), builds the handle, and hands the tokens to the transport
that `smsplit.ep.registry` chooses for the call; the machinery of those steps is `smsplit.ep.calls`, and autograd goes
through `smsplit.ep.autograd`.
"""

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import calls, checks, registry
from .autograd import Untracked, combine_is_tracked, combine_with_grad, dispatch_is_tracked, dispatch_with_grad
from .checks import sms_count, topk_idx_t  # (topk_idx_t: DeepEP's name, exported by smsplit.ep)
from .config import Config
from .event import EventOverlap
from .header import (H_STATUS, HEADER_WORDS, OP_COMBINE, OP_DISPATCH, OP_INIT, OP_NAMES, aborts, agree, agree_init,
                     fill_combine, fill_dispatch, init_header, new_header, status_code)
from .layout import DispatchHandle, compute_dispatch_layout
from ..nodes import tokens_per_node
from .reference import ReferenceTransport
from .registry import BACKENDS, DEVICE_BACKENDS  # (the backend names, for callers and tests)
from .transport import EPArgumentError, EPError, Environment, Traffic, Transport, on_every_rank

Tensorish = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]
__all__ = ["BACKENDS", "DEVICE_BACKENDS", "Buffer", "Config", "HEADER_WORDS", "topk_idx_t"]


class Buffer:
    """
    Expert-parallel (EP) communication for Mixture-of-Experts layers: dispatch tokens to the ranks that hold their
    top-k experts, and combine the expert outputs back, with the API and return values of DeepEP's intranode
    normal kernels (`deep_ep.Buffer`). Dispatch and combine are differentiable (each one's backward is the other).

    Every call is collective over `group`: all ranks call the same methods in the same order. Before any token
    moves, the ranks exchange a small header and agree on the arguments; an invalid argument on any rank raises
    `EPArgumentError` (a `ValueError` naming the argument) on every rank. A peer that does not arrive within
    `timeout_s` raises `EPTimeoutError` naming the peer and the phase; after that (and after `EPError`) the buffer
    is unusable. A call that raises on one rank alone aborts the buffer: the peers' waits raise `EPAbortError`
    naming that rank and its error at once. A device kernel's wait that times out is raised by the next call on
    every rank, before it launches anything, or by `check_kernels` (docs/ep.md, "Errors").

    Attributes:
        group, rank, group_size: the communication group, this rank in it, its size.
        num_nvl_bytes: the receive buffer each rank holds (0: the reference transport allocates per call).
        num_rdma_bytes: as given (DeepEP's attribute; the hierarchical transport allocates its messages per call).
        nodes: the node layout (`smsplit.nodes.NodeLayout`): from `ranks_per_node`, else the launcher's, else the
            host names; the same on every rank.
        num_sms: the SMs of a call whose `config` names none: `budget`'s comm SMs, else the constructor's, else the
            class attribute `Buffer.num_sms` (DeepEP's default, 20; `set_num_sms` changes it).
        budget: the `smsplit.budget.SmBudget` whose comm SM count the device kernels use, or None.
        backend: as given: "auto" or the name of a transport (`smsplit.ep.registry`).
        device: CPU for gloo groups, the current CUDA device for NCCL.
        timeout_s: the longest wait for a peer, in seconds.
        transport: the reference transport: the header exchange of every call, the aborts, and the reference's moves.
    """

    num_sms: int = 20  # DeepEP's class default: the SM count of buffers made without one (`set_num_sms`)

    def __init__(self, group: Optional[dist.ProcessGroup] = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False, *,
                 num_sms: Optional[int] = None, budget=None, backend: str = "auto", timeout_s: float = 60.0,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm=None, ranks_per_node: Optional[int] = None) -> None:
        """
        Create the buffer; collective over `group`. The positional arguments are DeepEP's, in DeepEP's order
        (`Buffer(group, num_nvl_bytes, num_rdma_bytes)` works as it does there); smsplit's own are keyword-only.

        Arguments:
            group: the communication group (the default group if None). Gloo groups work on CPU tensors, NCCL groups
                on CUDA tensors of the current device.
            num_nvl_bytes: the receive buffer size per rank in bytes, the same on every rank; 0 for none (reference
                backend only). Dispatches and combines whose worst case does not fit raise `EPArgumentError`. A
                device backend allocates one buffer of this size per hidden size it dispatches (at the first
                dispatch of that size).
            num_rdma_bytes: DeepEP's RDMA buffer size, an int >= 0, recorded and otherwise unused: the hierarchical
                transport sizes its messages per call (docs/internode.md).
            low_latency_mode: must be False (no low-latency kernels).
            num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl: DeepEP's; accepted and ignored (they
                configure its RDMA and low-latency paths).
            num_sms: the SMs the communication kernels use (a call's `config` may name another count); None: the class
                attribute `Buffer.num_sms` at each call (20 unless `Buffer.set_num_sms` changed it, as DeepEP's
                buffers follow it). Ignored when `budget` is given.
            budget: an `SmBudget`; its `comm_sms` replaces `num_sms`. Kernels launch on the current stream: call the
                buffer inside `torch.cuda.stream(budget.comm_stream)` to run them on the comm SMs.
            backend: "auto" (per call, the fastest transport that can move it: docs/ep.md, "Choosing a
                transport"), "reference" (point-to-point `torch.distributed` messages, any device), "nvlink" (the
                SM-push Triton kernels of `smsplit.ep.nvlink`), "nvlink_copy_engine" (the same kernels, the copy
                engines moving the token rows: the fastest; a token's row among those from its source is not always
                in token order, `recv_src_idx` names it) or "copy_engine" (`smsplit.ep.copy_engine`). The device
                backends need an NCCL group of one node and `num_nvl_bytes` from `get_buffer_size_hint(...,
                backend=...)`; an explicit one refuses a call it cannot move, naming a backend that can.
            timeout_s: the longest wait for a peer, in seconds, before `EPTimeoutError`: finite, at most
                `smsplit.timeouts.MAX_TIMEOUT_S` (a year; the waits hand it to gloo and to the kernels as nanoseconds).

        DeepEP's keyword arguments whose position differs between its versions, by keyword only:
            use_fabric, enable_shrink, comm: accepted and ignored (fabric memory, elastic ranks, MPI bootstrap).
            explicitly_destroy: accepted; `destroy` works either way.

        smsplit's node layout, by keyword only:
            ranks_per_node: each N consecutive ranks of `group` form one node, whatever machine they run on (one
                machine emulating several nodes, for tests and for measuring the algorithm); None: the launcher's
                nodes (torchrun's `LOCAL_WORLD_SIZE`, `GROUP_RANK`), else the host names. With several nodes
                "auto" moves tokens hierarchically (once across the network per target node, then inside the node:
                docs/internode.md) and a one-node backend ("nvlink", "nvlink_copy_engine", "copy_engine") is an
                `EPArgumentError` on every rank. An N that does not divide the group, or ranks passing different
                N, is an `EPArgumentError` naming `ranks_per_node` on every rank, before any token moves.
        """
        if group is None:
            group = dist.group.WORLD
        error = None  # an argument error: raised on every rank after the first header exchange (below)
        try:
            num_nvl_bytes, num_rdma_bytes, num_sms = checks.constructor(
                num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_sms, backend, timeout_s, ranks_per_node)
        except EPArgumentError as e:
            if group is None:  # no process group to tell the others through
                raise
            error = e
            timeout_s = timeout_s if e.argument != "timeout_s" else 60.0  # (the exchange needs a bound)

        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        self.num_nvl_bytes = num_nvl_bytes if error is None else 0
        self.num_rdma_bytes = num_rdma_bytes if error is None else 0
        self.budget = budget
        if budget is not None:
            self.num_sms = int(getattr(budget, "comm_sms", num_sms if num_sms is not None else Buffer.num_sms))
        elif num_sms is not None:
            self.num_sms = num_sms
        # (else no instance attribute: self.num_sms reads the class attribute, which `set_num_sms` changes)
        self.timeout_s = float(timeout_s)
        self.backend = backend if error is None else registry.AUTO
        cuda = str(dist.get_backend(group)).lower() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self._cuda = cuda  # (read by every call: `_capturing`)
        self._env = self._environment(one_node=True)  # (known after the exchange below)
        if error is None:
            error = registry.environment_problem_of(self.backend, self._env)
        self.transport = ReferenceTransport(group, self.device, self.timeout_s)  # the headers, aborts and reference
        self._transports = {self.transport.name: self.transport}  # name -> transport, device ones at first use
        self._moved_by: Optional[Transport] = None  # the transport of the last call (`last_traffic`)
        self._device_failure: Optional[str] = None
        self._eager_sms: Optional[int] = None  # the SM count of the last eager call (a captured call's)
        self._round = 0
        self._destroyed = False

        header = init_header(self._header(OP_INIT), num_nvl_bytes if error is None else 0,
                             self.num_sms if error is None else 0, registry.BACKENDS.index(self.backend), error)
        headers = self._exchange(OP_INIT, "the buffer size", header, error)
        agree_init(headers, registry.BACKENDS)
        # Every rank on one machine (the header file was shared): what "auto" needs of a device transport. An
        # explicit one is taken at its word: ranks that share no /dev/shm may still share GPUs.
        self._env = self._environment(one_node=self.transport.one_node)
        self.nodes = calls.agree_nodes(self, ranks_per_node if error is None else None)
        self._env = self._env._replace(num_nodes=self.nodes.num_nodes)
        self.transport.ranks_per_node = self.nodes.ranks_per_node
        self._where = checks.Where(self.device, self.group_size, id(self), self.num_nvl_bytes, self.nodes.num_nodes)
        if self.nodes.num_nodes > 1 and self.backend != registry.AUTO:
            error = registry.environment_problem(self.backend, self._env)
            if error is not None:
                raise on_every_rank(error)

    def _environment(self, one_node: bool) -> Environment:
        """What this buffer runs on, for the registry (the same on every rank)."""
        return registry.environment(self.backend, self.device, one_node, self.group_size, self.num_nvl_bytes)

    # -- the SM count (DeepEP's static API) -------------------------------------------------------------

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """
        Set `Buffer.num_sms`, the SM count of every later call of buffers made without `num_sms` or `budget` (and
        of the configs `get_dispatch_config` / `get_combine_config` make), as DeepEP's `Buffer.set_num_sms`. Every
        rank must set the same count: a call whose ranks differ raises `EPArgumentError` naming `config` on every
        rank before any token moves (an eager call; a captured one must use the count of the eager calls before
        it). Any int >= 1 (DeepEP's must be even); a device backend refuses a count above its GPU's SMs at the call.
        """
        Buffer.num_sms = sms_count("num_sms", new_num_sms)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A `Config` with `Buffer.num_sms` for a dispatch over `num_ranks` ranks (DeepEP's static method; its
        tuned chunk sizes do not apply here)."""
        checks.check_int("num_ranks", num_ranks, 1)
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """A `Config` with `Buffer.num_sms` for a combine over `num_ranks` ranks (DeepEP's static method)."""
        return Buffer.get_dispatch_config(num_ranks)

    # -- sizes ---------------------------------------------------------------------------------------------

    @staticmethod
    def get_buffer_size_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int, num_topk: int = 0,
                             x_dtype: torch.dtype = torch.bfloat16, fp8: bool = False,
                             combine_dtype: torch.dtype = torch.bfloat16, backend: str = "reference") -> int:
        """
        The smallest `num_nvl_bytes` for dispatches and combines of up to `num_max_tokens_per_rank` tokens per rank
        (each at most `num_topk` top-k columns; values of `x_dtype`, or FP8 with `fp8`; combined values of
        `combine_dtype`) on `backend`'s transport: its `Capabilities.buffer_bytes` (docs/ep.md). The reference's
        holds one slot per source rank, each row the larger of a dispatch row and a combine row, plus a header per
        rank; the nvlink transports' a bf16-sized receive and combine area per source rank with top-k columns for
        up to 16; "auto": the largest of them. An unknown backend or a count out of range is an `EPArgumentError`.
        """
        checks.size_hint_arguments(num_max_tokens_per_rank, hidden, num_ranks, num_topk, backend)
        return int(registry.size_hint(backend, int(num_ranks), int(num_max_tokens_per_rank), int(hidden),
                                      int(num_topk), x_dtype, fp8, combine_dtype))

    # -- events ----------------------------------------------------------------------------------------------

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current CUDA stream (an empty EventOverlap without CUDA); `Buffer.capture()` or
        `buffer.capture()`, as in DeepEP."""
        if not torch.cuda.is_available():
            return EventOverlap()
        return EventOverlap.record_current_stream(torch.device("cuda", torch.cuda.current_device()))

    def get_comm_stream(self):
        """
        The stream this buffer's communication runs on, as DeepEP's `get_comm_stream()`. This buffer has none of its
        own (each call runs on the current stream: docs/ep.md, "Differences from DeepEP"), so: `budget.comm_stream`
        where it has a budget, else the current stream of its device (`torch.cpu.current_stream()` on a CPU).
        """
        if self.device.type != "cuda":
            return torch.cpu.current_stream()
        if self.budget is not None:
            return self.budget.comm_stream
        return torch.cuda.current_stream(self.device)

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the kernels are built with Hopper's (sm_90) features, as DeepEP's `is_sm90_compiled()` (read by its
        callers as "FP8 dispatch is available"): True where Triton has its NVIDIA backend, which builds every kernel
        here for sm_90. Like DeepEP's, it says nothing of the GPU present."""
        from triton.backends import backends

        return "nvidia" in backends

    def _check_alive(self) -> None:
        if self._destroyed:
            raise EPError(f"rank {self.rank}: this Buffer was destroyed (Buffer.destroy)")
        self.transport.check_usable()  # (after an abort, a timeout, a lost peer)

    def destroy(self) -> None:
        """End this buffer: later calls raise `EPError`. Its memory is released when the object is collected (no
        collective here: it needs no peer)."""
        self._destroyed = True

    # -- layout ----------------------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) \
            -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """
        Compute the layout that `dispatch` needs; local, no communication.

        Arguments:
            topk_idx: `[num_tokens, num_topk]` with `torch.int64`, the experts each token selected, `-1` for none.
            num_experts: the number of experts over all ranks, a multiple of the number of ranks.
            previous_event, async_finish, allocate_on_comm_stream: as for `dispatch`.

        Returns:
            num_tokens_per_rank: `[num_ranks]` `torch.int`, the tokens sent to each rank; num_tokens_per_rdma_rank:
            `[num_nodes]` `torch.int`, the tokens sent to each node (a token counted once per node), where the
            node layout has several nodes, else None (as DeepEP's intranode buffers); num_tokens_per_expert: `[num_experts]` `torch.int`, the tokens sent to each
            expert; is_token_in_rank: `[num_tokens, num_ranks]` `torch.bool`; event: after the computation.
        """
        # Errors of the arguments' types and shapes leave the buffer usable: the same code passes them alike on every
        # rank. Any later error (ids out of range: data, which differ between ranks) aborts it (docs/ep.md, "Errors").
        num_experts = checks.layout_arguments(topk_idx, num_experts, previous_event, self.group_size, self.device)
        return self._get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish)

    @aborts
    def _get_dispatch_layout(self, topk_idx, num_experts: int, previous_event, async_finish: bool):
        """`get_dispatch_layout` after the checks of its plain arguments."""
        self._check_alive()
        self._wait_previous(previous_event)  # before reading topk_idx on the host: it may come from another stream
        checks.check_topk_idx(topk_idx, None, num_experts, self.device, values=not self._capturing())
        num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank = \
            compute_dispatch_layout(topk_idx, num_experts, self.group_size)
        per_node = tokens_per_node(is_token_in_rank, self.nodes) if self.nodes.num_nodes > 1 else None
        return num_tokens_per_rank, per_node, num_tokens_per_expert, is_token_in_rank, self._finish_event(async_finish)

    # -- dispatch --------------------------------------------------------------------------------------------

    @aborts
    def dispatch(self, x: Tensorish, handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, fp8: bool = False, dequantize: bool = False) \
            -> Tuple[Tensorish, Optional[torch.Tensor], Optional[torch.Tensor], Optional[List[int]],
                     DispatchHandle, EventOverlap]:
        """
        Send each token to every rank that holds one of its top-k experts. Collective.

        Two modes: with layout arguments (`num_tokens_per_rank`, `is_token_in_rank`, `num_tokens_per_expert`, from
        `get_dispatch_layout`), or with `handle=` from an earlier dispatch, which reuses that layout (the cached
        mode: only `x` moves; `topk_idx` and `topk_weights` must be None; the layout arguments are ignored).

        Arguments:
            x: `[num_tokens, hidden]` with `torch.bfloat16` (or `torch.float16` / `torch.float32`), or a tuple
                `(x_fp8, scales)`: `[num_tokens, hidden]` with `torch.float8_e4m3fn` and `[num_tokens, hidden // 128]`
                with `torch.float32` (`hidden` a multiple of 128), as made by `smsplit.fp8.quantize_1x128`; `hidden`
                at least 1; any strides and offset.
            handle: a handle returned by an earlier `dispatch` of this buffer, or the tuple of its six DeepEP fields
                that unpacking it gave (`DispatchHandle.from_deepep_tuple`); selects the cached mode.
            num_tokens_per_rank: `[num_ranks]` with `torch.int`, the number of tokens sent to each rank.
            num_tokens_per_rdma_rank: None, or `get_dispatch_layout`'s `[num_nodes]` tokens per node (DeepEP's
                internode argument; checked for its shape, the transports count nodes from `is_token_in_rank`).
            is_token_in_rank: `[num_tokens, num_ranks]` with `torch.bool`, whether a token goes to a rank.
            num_tokens_per_expert: `[num_experts]` with `torch.int`, the number of tokens sent to each expert;
                `num_experts` must be a multiple of the number of ranks and the same on every rank.
            topk_idx: `[num_tokens, num_topk]` with `torch.int64`, the experts each token selected, `-1` for none;
                ids must lie in `[-1, num_experts)`. May be None (then nothing top-k is received).
            topk_weights: `[num_tokens, num_topk]` with `torch.float`, the weight of each selection; needs `topk_idx`.
            expert_alignment: round each entry of `num_recv_tokens_per_expert_list` up to a multiple of this.
            num_worst_tokens: if positive (at least the tokens this rank receives), the received tensors have exactly
                this many rows (padding rows zero, their `recv_topk_idx` -1) and `num_recv_tokens_per_expert_list`
                is []; the nvlink transports then need no host synchronization, so the call can be captured in a CUDA
                graph (nvlink_copy_engine's in the cached mode only: docs/ep.md, "CUDA graphs").
            config: a `Config` (or anything with an int `num_sms`): this call's SMs, at most the budget's comm SMs,
                the same on every rank (a captured call: that of the eager calls before it); None, or an object
                without a readable `num_sms` (DeepEP's own `deep_ep.Config`): `num_sms`.
            previous_event: the event the current stream waits for before the call reads its inputs.
            async_finish: also return an event recorded after the call's work (which runs on the current stream:
                docs/ep.md, "Differences from DeepEP").
            allocate_on_comm_stream: accepted for DeepEP compatibility; ignored.
            fp8: quantize a floating-point `x` to FP8 e4m3 with one fp32 scale per 128 values before sending
                (`smsplit.fp8.quantize_1x128`); `recv_x` is then `(recv_x_fp8, recv_scales)` (an inf or NaN makes
                its 128-value tile NaN, unchecked, as with DeepEP's cast).
            dequantize: with FP8 on the wire (`fp8=True` or an FP8 `x`), dequantize on receive: `recv_x` is a
                tensor of the input dtype (bfloat16 for an FP8 `x`).

        Returns:
            recv_x: the received tokens, `[num_recv_tokens, hidden]` (`[num_worst_tokens, hidden]` if set), ordered by
                source rank, then by token index on the source rank (nvlink_copy_engine: a few tokens of a source's
                block may take other rows, the same for every dispatch with one handle; `recv_src_idx` names
                them); a tuple `(recv_x_fp8, recv_scales)` when FP8 travelled and `dequantize` is False.
            recv_topk_idx: `[num_recv_tokens, num_topk]` with `torch.int64`: the top-k ids as local expert ids of
                this rank (`0 .. num_local_experts - 1`), -1 for experts on other ranks and for `-1` entries; None in
                the cached mode or without `topk_idx`.
            recv_topk_weights: `[num_recv_tokens, num_topk]` with `torch.float`: the weights, 0 where
                `recv_topk_idx` is -1; None in the cached mode or without `topk_weights`.
            num_recv_tokens_per_expert_list: Python list `[num_local_experts]`, the tokens received for each local
                expert, rounded up to `expert_alignment`; empty if `num_worst_tokens` is set; None in the cached mode.
            handle: the layout, for `combine`, cached dispatches and backward (the same handle in the cached mode).
            event: the event after the communication (meaningful only with `async_finish` on CUDA).
        """
        self._check_alive()
        handle = checks.handle_of(handle)
        expert_alignment, num_worst_tokens = checks.plain_int(expert_alignment), checks.plain_int(num_worst_tokens)
        if dispatch_is_tracked(x, topk_weights, fp8, dequantize):
            fields = dict(handle=handle, num_tokens_per_rank=num_tokens_per_rank,
                          num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                          num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
                          expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                          previous_event=previous_event, async_finish=async_finish, fp8=fp8, dequantize=dequantize,
                          config=config)
            return dispatch_with_grad(self._untracked(), x, topk_weights, fields)
        return self._dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                              num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                              previous_event, async_finish, fp8, dequantize, config=config)

    @aborts
    def _dispatch(self, x: Tensorish, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                  num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, previous_event,
                  async_finish, fp8, dequantize, internal: bool = False, config=None):
        """`dispatch` without autograd. `internal` (a backward pass) allows the cached mode to carry
        `topk_weights` and `x=None`."""
        args = (x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
                topk_idx, topk_weights, expert_alignment, num_worst_tokens, previous_event, fp8, dequantize, internal)
        if self._capturing():  # no header exchange, no host read (`calls.dispatch_captured`)
            try:
                return calls.dispatch_captured(self, args, async_finish, config)
            except EPArgumentError as error:  # (every rank captures the same code: raised alike on every rank)
                raise on_every_rank(error)
        self._wait_previous(previous_event)  # before the checks read the layout's values on the host
        header = self._header(OP_DISPATCH)
        error = None
        try:  # check: this rank's arguments, and the transport for its own tokens
            sms, argument = checks.call_sms(config, self.num_sms, self.budget is not None)
            spec = checks.check_dispatch(self._where, *args)
            move = calls.dispatch_move(spec, handle, fp8 and spec.scales is None, sms, argument, False, internal)
            # (with this rank's own tokens; a cached dispatch's move is the same after the exchange: its choice)
            name = registry.choose(self.backend, move, self._env, internal)
            fill_dispatch(header, spec, handle, sms)
        except EPArgumentError as e:
            error = e
            header[:, H_STATUS] = status_code(e)
        headers = self._exchange(OP_DISPATCH, "counts", header, error)  # agree: with every rank's header
        self._eager_sms = sms
        cached, recv_per_expert, counts = handle is not None, None, None
        if not cached:  # a new layout: the choice for the most tokens any rank sends; its handle
            move, name, recv_per_expert = calls.agree_layout(self, spec, move, headers, internal)
            counts = [row[HEADER_WORDS:] for row in headers]
            handle = calls.new_handle(self, name, spec, move, is_token_in_rank, counts)
        out = calls.run_dispatch(self._transport(name), spec, handle, move, topk_idx, topk_weights, fp8, dequantize,
                                 sms, counts)
        return (*out, calls.per_expert_list(cached, recv_per_expert, expert_alignment, num_worst_tokens), handle,
                self._finish_event(async_finish))

    @aborts
    def check_kernels(self) -> None:
        """
        Raise `EPError` if a kernel of this rank recorded a timeout (a peer that never arrived) since the last
        Buffer call; waits for the current stream. Every eager call does this itself; call it after replaying
        CUDA graphs, where no host code of the buffer runs.
        """
        failure = calls.kernel_failure(self._transports, self.device, whole_stream=True)
        if failure:
            self._device_failure = failure
            raise EPError(f"rank {self.rank}: {failure}")

    # -- combine ---------------------------------------------------------------------------------------------

    @aborts
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None, config=None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) \
            -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """
        Send each received token back to the rank it came from and add up the copies (**without** weights), in
        fp32. Collective; the reverse of the dispatch that made `handle`.

        Arguments:
            x: `[num_recv_tokens, hidden]` (or `[num_worst_tokens, hidden]` if the dispatch padded; the padding rows
                are ignored) with `torch.bfloat16` (or `torch.float16` / `torch.float32`), rows in the order
                `dispatch` returned them; any strides and offset, as for `dispatch`.
            handle: the handle returned by the dispatch being reversed, or the tuple of its six DeepEP fields that
                unpacking it gave (`DispatchHandle.from_deepep_tuple`).
            topk_weights: `[num_recv_tokens, num_topk]` with `torch.float`, summed the same way, or None.
            bias: None, or one or two `[num_tokens, hidden]` tensors of `x`'s dtype added to the result.
            config, previous_event, async_finish, allocate_on_comm_stream: as for `dispatch`.

        Returns:
            combined_x: `[num_tokens, hidden]`, `x`'s dtype: for each token of this rank, the sum of the rows that
                the ranks it was dispatched to sent back (plus `bias`); zero for tokens dispatched nowhere.
            combined_topk_weights: `[num_tokens, num_topk]` with `torch.float`, summed the same way, or None.
            event: the event after the communication (meaningful only with `async_finish` on CUDA).
        """
        self._check_alive()
        handle = checks.handle_of(handle)
        biases = checks.bias_tuple(bias)
        if combine_is_tracked(x, topk_weights, bias, biases):
            return combine_with_grad(self._untracked(), x, handle, topk_weights, biases, previous_event, async_finish,
                                     config)
        return self._combine(x, handle, topk_weights, bias, previous_event, async_finish, config=config)

    @aborts
    def _combine(self, x, handle, topk_weights, bias, previous_event, async_finish, internal: bool = False,
                 config=None):
        """`combine` without autograd; `internal` (a backward pass) allows `x=None`. Captured in a CUDA graph (see
        `calls.dispatch_captured`) it exchanges nothing."""
        captured = self._capturing()
        if not captured:
            self._wait_previous(previous_event)
        header = None if captured else self._header(OP_COMBINE)
        error = None
        try:
            biases = checks.check_combine(self._where, x, handle, topk_weights, bias, previous_event, internal)
            sms, argument = checks.call_sms(config, self.num_sms, self.budget is not None)
            name = registry.choose(self.backend, calls.combine_move(x, handle, topk_weights, sms, argument, captured),
                                   self._env, internal)
            if captured:
                checks.captured_sms(sms, self._eager_sms)
            else:
                fill_combine(header, x, handle, topk_weights, sms)
        except EPArgumentError as e:
            if captured:
                raise on_every_rank(e)
            error = e
            header[:, H_STATUS] = status_code(e)
        if captured:
            self._wait_previous(previous_event)
        else:
            self._exchange(OP_COMBINE, "status", header, error)
            self._eager_sms = sms
        summed_x, summed_weights = self._transport(name).combine(handle, x, topk_weights, num_sms=sms)
        return calls.with_bias(summed_x, biases, x), summed_weights, self._finish_event(async_finish)

    # -- transports, headers, events -------------------------------------------------------------------------

    def _transport(self, name: str):
        """The transport ``name`` of this buffer, made (collectively: every rank's choice is the same) at its first
        use; its buffers are made at their first dispatch of each hidden size."""
        transport = self._transports.get(name)
        if transport is None:
            transport = registry.make(name, self.group, self.device, self.timeout_s, self.num_nvl_bytes,
                                      nodes=self.nodes, reference=self.transport)
            self._transports[name] = transport
        self._moved_by = transport
        return transport

    @property
    def last_traffic(self) -> Optional[Traffic]:
        """
        What this rank's last dispatch or combine sent, counted from its messages (`smsplit.ep.transport.Traffic`):
        rows and bytes to ranks on other nodes (`internode_bytes`) and to the other ranks of its node
        (`intranode_bytes`), rows kept on this rank, messages. The hierarchical transport sends a token across the
        network once per target node; the reference transport (a flat exchange) once per destination rank on another
        node. None before the first call, and after a call of a device transport (their kernels do not count).
        """
        return self._moved_by.last_traffic if self._moved_by is not None else None

    def _header(self, op: int):
        """This call's header rows; a kernel timeout recorded on this rank so far goes into its status."""
        self._round += 1
        self._device_failure = self._device_failure or calls.kernel_failure(self._transports, self.device)
        return new_header(self.group_size, op, self._round, self._device_failure is not None)

    def _exchange(self, op: int, what: str, header, own_error: Optional[EPArgumentError]) -> List[List[int]]:
        """Send this rank's header rows (`what`, for error messages) and agree on the rows every rank sent
        (`header.agree`); returns them as Python ints (indexing a tensor costs microseconds per element), row q
        from rank q."""
        rows = self.transport.exchange_headers(OP_NAMES[op], what, torch.from_numpy(header)).tolist()
        agree(op, self._round, self.rank, rows, own_error, self._device_failure, self.transport)
        return rows

    def _capturing(self) -> bool:
        return self._cuda and torch.cuda.is_current_stream_capturing()

    def _wait_previous(self, previous_event: Optional[EventOverlap]) -> None:
        """Make the current stream wait for `previous_event` (anything else is left to the argument checks,
        which reject it on every rank)."""
        if isinstance(previous_event, EventOverlap):
            previous_event.current_stream_wait()

    def _untracked(self) -> Untracked:
        """This buffer's calls without autograd, for `smsplit.ep.autograd` (its internal contract: `Untracked`)."""
        return Untracked(self.device, self._dispatch, self._combine, self._finish_event)

    def _finish_event(self, async_finish: bool) -> EventOverlap:
        return EventOverlap.record_current_stream(self.device) if async_finish else EventOverlap()
