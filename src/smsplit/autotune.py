"""Pick the communication split (comm SMs, transport, ...) that makes a step fastest, by measuring it.

    best, table = autotune_split(lambda c: overlapped_step(comm_sms=c["comm_sms"], transport=c["transport"]),
                                 [{"comm_sms": n, "transport": t} for n in (8, 16, 24, 32) for t in ("reference", "nvlink")])

Each candidate's step is run ``warmup`` times, then timed over ``iters`` runs: host clock between two device
synchronizes, so the work the step leaves on any stream of the current device counts (CUDA events on the current
stream would miss work on a budget's streams that the step does not join back). With a process group, every
rank's time is replaced by the slowest rank's, so all ranks pick the same candidate. A candidate whose step
raises is recorded with its error and never picked (on every rank: a failure anywhere counts as infinitely slow).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist


def autotune_split(fn: Callable[[Any], object], candidates: Sequence[Any], *, warmup: int = 2, iters: int = 5,
                   group: dist.ProcessGroup | None = None) -> tuple[Any, list[dict]]:
    """Run ``fn(candidate)`` for each candidate and return ``(best, table)``.

    Args:
        fn: runs one step with the given candidate split.
        candidates: the splits to try (any objects; dicts of settings read well in the table).
        warmup, iters: untimed (>= 0) and timed (>= 1) runs per candidate.
        group: the ranks that tune together (None: this process alone).

    Returns:
        best: the candidate with the lowest time per step.
        table: one dict per candidate, in order: ``candidate``, ``ms`` (time per step, the slowest rank's with
            a group; ``inf`` if it failed), ``error`` (the exception text on this rank, or None).

    Raises:
        ValueError: no candidates, or ``warmup`` / ``iters`` out of range (before anything runs).
        RuntimeError: without a CUDA GPU (there is no SM split to tune on a CPU), or when every candidate fails.
    """
    for name, value, least in (("warmup", warmup, 0), ("iters", iters, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    candidates = list(candidates)
    if not candidates:
        raise ValueError("autotune_split needs at least one candidate")
    if not torch.cuda.is_available():
        raise RuntimeError("autotune_split times steps on a CUDA device and needs a CUDA GPU; this machine "
                           "has none (there are no SMs to split on a CPU)")
    table = []
    for candidate in candidates:
        error = None
        try:
            for _ in range(warmup):
                fn(candidate)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                fn(candidate)
            torch.cuda.synchronize()  # every stream of the device, not only the current one
            ms = (time.perf_counter() - start) * 1e3 / iters
        except Exception as e:  # noqa: BLE001 - a failing candidate is a result, not a crash
            error, ms = f"{type(e).__name__}: {e}", math.inf
        if group is not None:
            t = torch.tensor([ms], dtype=torch.float64,
                             device="cuda" if dist.get_backend(group) == "nccl" else "cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            ms = float(t)
        table.append(dict(candidate=candidate, ms=ms, error=error))
    best = min(table, key=lambda row: row["ms"])
    if math.isinf(best["ms"]):
        raise RuntimeError("autotune_split: every candidate failed: "
                           + "; ".join(f"{row['candidate']!r}: {row['error']}" for row in table))
    return best["candidate"], table
