"""The device transports at the protocol level (`smsplit.ep.transport.Transport`): SM push (``"nvlink"``),
copy-engine-assisted SM push (``"nvlink_copy_engine"``) and copy engine (``"copy_engine"``).

Each owns its engines, one per hidden size (`smsplit.ep.nvlink.NvlinkTransport`,
`smsplit.ep.copy_engine.CopyEngineTransport`: the kernels and their symmetric buffer), made collectively at the
first dispatch of that size with the largest token count whose buffer fits `num_nvl_bytes`. An engine's module
holds Triton kernels: it is imported when the first engine is made, so that importing `smsplit.ep` (and the CPU
reference transport) loads none of them.
"""

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from .rows import SCALE_BLOCK, rank_prefix_matrix_from_counts
from .transport import Capabilities, Received, Tokens, Transport

if TYPE_CHECKING:  # (annotations only)
    from .layout import DispatchHandle

MAX_TOPK = 16  # top-k columns every engine's buffer holds (its size does not depend on a call's top-k)
MAX_ENGINE_TOKENS = 1 << 30  # tokens per rank an engine is sized for at most (rows are named by int32 indices)


@dataclass
class DeviceState:
    """A device transport's state of one layout (`handle.transport_state`): the engine that made it, the engine's
    layout (`NvlinkLayout` / `CopyEngineLayout`), its hidden size, and the SM count of the latest call with it (what
    the kernels ran on; for tests and diagnostics)."""

    engine: object
    layout: object
    hidden: int
    last_num_sms: int


def dense(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` as the device kernels read it: contiguous, rows indexed densely, and 16-byte aligned (their 16-byte
    vector accesses fault on a view that starts mid-vector; such a view is copied)."""
    if t is None:
        return None
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _clone(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.clone()


class DeviceTransport(Transport):
    """The engines of one device backend over ``group`` (see the module docstring), each with a symmetric buffer of
    at most ``num_nvl_bytes``."""

    name = "device"
    keeps_views = False  # the engine returns views into its buffer, which the next dispatch overwrites: cloned here
    engine_options: Dict[str, str] = {}  # keywords of the engine's constructor that select this backend

    def __init__(self, group, device: torch.device, timeout_s: float, num_nvl_bytes: int) -> None:
        super().__init__(group, device, timeout_s)
        self.num_nvl_bytes = num_nvl_bytes
        self._engines: Dict[int, object] = {}  # hidden size -> engine, made at its first dispatch

    # -- what it moves ------------------------------------------------------------------------------------------

    @classmethod
    def engine_class(cls):
        """The engine class (imported here: its module holds Triton kernels)."""
        raise NotImplementedError

    @classmethod
    def engine_bytes(cls, num_ranks: int, max_tokens: int, hidden: int) -> int:
        return cls.engine_class().buffer_bytes(num_ranks, max_tokens, hidden, MAX_TOPK)

    @classmethod
    def _buffer_bytes(cls, num_ranks: int, max_tokens: int, hidden: int, num_topk: int = 0, x_dtype=None,
                      fp8: bool = False, combine_dtype=None, combine_only: bool = False) -> int:
        """A bf16-sized receive area and a combine area per source rank, top-k columns for up to 16, whatever the
        call moves (every dispatch of one hidden size shares the engine)."""
        return cls.engine_bytes(num_ranks, max_tokens, hidden)

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(moves=frozenset((torch.bfloat16, torch.float8_e4m3fn)),
                            quantizes=frozenset((torch.bfloat16, torch.float16, torch.float32)),
                            combines=frozenset((torch.bfloat16,)), weights_only=False, capture=cls.capture,
                            reads_any_layout=False, needs_cuda=True, one_node=True, needs_buffer=True,
                            hidden_multiple=SCALE_BLOCK, max_topk=MAX_TOPK, max_ranks=16,
                            buffer_bytes=cls._buffer_bytes)

    capture = "never"

    # -- engines ------------------------------------------------------------------------------------------------

    def engines(self) -> List[object]:
        """The engines made so far."""
        return list(self._engines.values())

    def prepared(self, hidden: int) -> bool:
        return hidden in self._engines

    def _engine(self, hidden: int):
        """The engine of this hidden size, made (collectively: every rank's call reaches here alike) at its first
        dispatch with the largest token count whose buffer fits `num_nvl_bytes`."""
        engine = self._engines.get(hidden)
        if engine is None:
            fits = lambda tokens: self.engine_bytes(self.num_ranks, tokens, hidden) <= self.num_nvl_bytes  # noqa
            tokens = 1
            while tokens < MAX_ENGINE_TOKENS and fits(tokens * 2):
                tokens *= 2
            low, high = tokens, tokens * 2  # the largest token count that fits lies in [low, high)
            while high - low > 1:
                mid = (low + high) // 2
                low, high = (mid, high) if fits(mid) else (low, mid)
            engine = self.engine_class()(self.group, self.device, low, hidden, MAX_TOPK, timeout_s=self.timeout_s,
                                         **self.engine_options)
            self._engines[hidden] = engine
        return engine

    def raise_if_failed(self) -> None:
        for engine in self._engines.values():
            engine.raise_if_failed()

    # -- Transport ----------------------------------------------------------------------------------------------

    def dispatch(self, handle: "DispatchHandle", tokens: Tokens, *, num_sms: int, stream=None) -> Received:
        if stream is None:  # (what `Buffer` passes: no context to enter)
            return self._dispatch(handle, tokens, num_sms)
        with _on(stream):
            return self._dispatch(handle, tokens, num_sms)

    def _dispatch(self, handle: "DispatchHandle", tokens: Tokens, num_sms: int) -> Received:
        state: Optional[DeviceState] = handle.transport_state
        cached = state is not None
        engine = state.engine if cached else self._engine(tokens.values.size(1))
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src, layout = engine.dispatch(
            dense(tokens.values), dense(tokens.scales), dense(tokens.topk_idx), dense(tokens.topk_weights),
            handle.is_token_in_rank.contiguous(), tokens.num_local_experts, num_sms=num_sms,
            quantize=tokens.quantize, num_worst_tokens=handle.num_worst_tokens,
            cached=state.layout if cached else None, num_recv_tokens=None if cached else handle.num_recv_tokens)
        if cached:
            state.last_num_sms = num_sms
        else:
            handle.transport_state = DeviceState(engine, layout, tokens.values.size(1), num_sms)
            self._made(handle, layout, tokens)
            handle.recv_src_idx = recv_src[:handle.num_recv_rows].clone()  # padding rows: -1 from the kernels
            self.plan(handle, num_sms=num_sms)
        if self.keeps_views:
            return Received(_clone(recv_x), _clone(recv_scales), _clone(recv_topk_idx), _clone(recv_topk_weights))
        return Received(recv_x, recv_scales, recv_topk_idx, recv_topk_weights)

    def _made(self, handle: "DispatchHandle", layout, tokens: Tokens) -> None:
        """Record on ``handle`` what the engine's new ``layout`` holds (its `rank_prefix_matrix`, summed on the
        device from the kernels' count exchange)."""
        if layout.rank_prefix_matrix is not None:
            handle.rank_prefix_matrix = layout.rank_prefix_matrix

    def combine(self, handle: "DispatchHandle", x: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], *,
                num_sms: int, stream=None) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        state: DeviceState = handle.transport_state
        rows = handle.num_recv_rows
        state.last_num_sms = num_sms
        # (a slice costs the host microseconds: only where the rows are more than the handle's, padding included)
        x = dense(x if x.size(0) == rows else x[:rows])
        weights = dense(None if topk_weights is None else
                        topk_weights if topk_weights.size(0) == rows else topk_weights[:rows])
        if stream is None:
            return state.engine.combine(x, weights, state.layout, num_sms=num_sms)
        with _on(stream):
            return state.engine.combine(x, weights, state.layout, num_sms=num_sms)


class NvlinkSmPush(DeviceTransport):
    """``"nvlink"``: the SM-push kernels of `smsplit.ep.nvlink` (SMs store the tokens into the peers' buffers); no
    host synchronization with ``num_worst_tokens``, so its calls can be captured in a CUDA graph."""

    name = "nvlink"
    keeps_views = True
    capture = "always"

    @classmethod
    def engine_class(cls):
        from .nvlink import NvlinkTransport

        return NvlinkTransport


class NvlinkCopyEngine(NvlinkSmPush):
    """``"nvlink_copy_engine"``: the same kernels with ``bulk="copy_engine"`` (the copy engines move the token rows;
    the SMs the metadata, this rank's own rows and the sums). Its copies are planned on the host from a layout, so
    a captured call needs the handle of an eager dispatch, which plans every copy of its layout (`plan`)."""

    name = "nvlink_copy_engine"
    engine_options = {"bulk": "copy_engine"}
    capture = "cached"

    def plan(self, handle: "DispatchHandle", *, num_sms: int) -> None:
        state: DeviceState = handle.transport_state
        state.engine.plan(state.layout, handle.is_token_in_rank, num_sms=num_sms)


class CopyEngine(DeviceTransport):
    """``"copy_engine"``: `smsplit.ep.copy_engine` (SMs pack and sum, the copy engines move the bytes; its layout is
    an all-gather read on the host, so nothing of it can be captured). Its received tensors are fresh."""

    name = "copy_engine"

    @classmethod
    def engine_class(cls):
        from .copy_engine import CopyEngineTransport

        return CopyEngineTransport

    def _made(self, handle: "DispatchHandle", layout, tokens: Tokens) -> None:
        handle.rank_prefix_matrix = rank_prefix_matrix_from_counts(tokens.counts, self.device)


def _on(stream):
    """Run on ``stream`` (None: the current stream, what `Buffer` passes: its calls run on the caller's stream)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)
