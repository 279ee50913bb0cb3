"""The one rule for every `timeout_s` argument (EP buffer, pipelines, demo): a number of seconds in
(0, MAX_TIMEOUT_S]. Waits hand it to gloo as a timedelta and to the GPU kernels as nanoseconds, which overflow
for infinite or huge values."""

from __future__ import annotations

import math

MAX_TIMEOUT_S = 365 * 24 * 3600.0  # a year


def timeout_problem(timeout_s) -> str | None:
    """Why ``timeout_s`` is not a valid timeout (a sentence for the error message), or None if it is."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
            0 < timeout_s <= MAX_TIMEOUT_S and math.isfinite(timeout_s)):
        return f"expected a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}"
    return None
