"""Expert-parallel dispatch and combine with DeepEP's normal-kernel API (`Buffer`), on pluggable transports."""

from .buffer import Buffer, Config, topk_idx_t
from .event import EventHandle, EventOverlap
from .layout import DispatchHandle, compute_dispatch_layout
from .transport import EPAbortError, EPArgumentError, EPError, EPTimeoutError, Transport

__all__ = ["Buffer", "Config", "DispatchHandle", "EPAbortError", "EPArgumentError", "EPError", "EPTimeoutError",
           "EventHandle", "EventOverlap", "Transport", "compute_dispatch_layout", "topk_idx_t"]
