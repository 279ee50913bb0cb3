"""DeepEP's `deep_ep.utils` names, where DeepEP code imports them from: `EventOverlap`, `EventHandle`."""

from .event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
