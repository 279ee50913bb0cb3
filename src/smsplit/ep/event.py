"""EventOverlap: the completion event returned by every Buffer call, and EventHandle (DeepEP's
`deep_ep.utils.EventOverlap` and `EventHandle`)."""

from typing import Optional, Tuple, Union

import torch


class EventHandle:
    """
    DeepEP's `EventHandle`: an event recorded on the current CUDA stream when it is made, so that
    ``EventOverlap(EventHandle())`` can be a call's `previous_event`. Without CUDA it holds no event and waits for
    nothing.

    Attributes:
        event: the recorded `torch.cuda.Event`, or None without CUDA.
    """

    def __init__(self) -> None:
        self.event = None
        if torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event (no host blocking)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """
    A CUDA event plus the tensors that must stay alive until it completes.

    On CPU, and for calls that finish before returning (the reference backend), `event` is None and every
    method is a no-op, so the same calling code runs everywhere.

    Attributes:
        event: the `torch.cuda.Event` recorded after the communication (or an `EventHandle`), or None.
        extra_tensors: tensors whose memory the communication still uses until `event` completes.
    """

    def __init__(self, event: Union[None, torch.cuda.Event, EventHandle] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    @staticmethod
    def record_current_stream(device: torch.device) -> "EventOverlap":
        """An event recorded on the current CUDA stream of `device`; an empty EventOverlap for other devices."""
        if device.type != "cuda":
            return EventOverlap()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return EventOverlap(event)

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event (no host blocking); a no-op without an event."""
        if isinstance(self.event, EventHandle):
            self.event.current_stream_wait()
        elif self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()
