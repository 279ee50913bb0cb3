"""The one rule for an integer argument, wherever the library takes one: an int (a numpy integer too, never a bool)
in a range, taken on as a Python int (which kernel launches and int64 headers need); anything else raises an error
that names the argument and says what it must be. Each caller keeps its own error type and phrasing through
``error``: plain `ValueError("{name} must be ...")` by default, the EP buffer's `EPArgumentError` there.

This module imports nothing of the library, so every module may use it.
"""

from __future__ import annotations

import numbers
from typing import Callable, Optional

# Above any real count or size: an int argument must not exceed it, so that sums and products of counts stay inside
# int64 (tensors, the EP header words) whatever the caller's own range.
MAX_INT = (1 << 62) - 1


def must_be(name: str, wanted: str) -> ValueError:
    """The default error of `check_int`: ``ValueError("{name} must be {wanted}")``."""
    return ValueError(f"{name} must be {wanted}")


def check_int(name: str, value, minimum: int, maximum: Optional[int] = None, *, stop: Optional[int] = None,
              error: Callable[[str, str], Exception] = must_be) -> int:
    """
    ``value`` as a Python int if it is an int (a numpy integer too; not a bool) with ``minimum <= value``,
    ``value <= maximum`` where ``maximum`` is given, ``value < stop`` where ``stop`` is given, and
    ``value <= MAX_INT``.

    Raises:
        ``error(name, wanted)`` otherwise, ``wanted`` saying what the value must be and what it was: "an int in
        [0, 4), got 7" (with ``stop``), "an int in [1, 65536], got 'many'" (with ``maximum``), "an int >= 1, got 0"
        (neither), or "an int <= 4611686018427387903, got ..." (an int above `MAX_INT` where no range is given).
    """
    high = MAX_INT if maximum is None else min(maximum, MAX_INT)
    if type(value) is int and minimum <= value <= high and (stop is None or value < stop):
        return value  # (the usual case, without the ABC check below)
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if integral and minimum <= value <= high and (stop is None or value < stop):
        return int(value)
    if stop is not None:
        wanted = f"an int in [{minimum}, {stop})"
    elif maximum is not None:
        wanted = f"an int in [{minimum}, {maximum}]"
    elif integral and value > MAX_INT:
        wanted = f"an int <= {MAX_INT}"
    else:
        wanted = f"an int >= {minimum}"
    raise error(name, f"{wanted}, got {value!r}")
