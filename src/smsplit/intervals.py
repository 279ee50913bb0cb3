"""Arithmetic on sets of time intervals: what ran, what ran at once, what ran alone.

An interval is a pair ``(start, end)`` with ``start <= end`` in any unit; a set of intervals is a list of
them in any order, possibly overlapping. These are the numbers behind "exposed communication" (time in which
communication ran and no compute did) and "concurrent time" (time in which both ran): `exposed_comm` of the
MoE overlap and `Trace.concurrent_ns` / `Trace.alone_ns` of SM traces both come from here, so a figure and a
table computed from the same intervals agree.
"""

from __future__ import annotations


def union(intervals) -> list[tuple]:
    """The intervals merged: sorted, disjoint, touching ones joined. Empty intervals are dropped."""
    out: list[tuple] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersection(a, b) -> list[tuple]:
    """The time covered by both ``a`` and ``b`` (each a set of intervals), as sorted disjoint intervals."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def measure(intervals):
    """Total time covered by ``intervals`` (overlaps counted once)."""
    return sum(e - s for s, e in union(intervals))


def alone(a, b):
    """Time covered by ``a`` and not by ``b``: with ``a`` communication and ``b`` compute, the exposed
    communication."""
    return measure(a) - measure(intersection(a, b))


def concurrent(a, b):
    """Time covered by both ``a`` and ``b``."""
    return measure(intersection(a, b))
