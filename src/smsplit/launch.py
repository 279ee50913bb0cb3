"""Launching: Triton kernels with less host work per call than Triton's JIT (`FastLaunch`), and the rendezvous
port for processes of one process group (`free_port`).

``kernel[grid](*args)`` spends several times the host time of the compiled kernel's own launcher on a kernel of
24-50 arguments (binding and specializing every argument, the cache key, reading knobs, checking the globals the
kernel used). An eager EP call makes one to three launches, so that is a large part of its host time.

`FastLaunch` keeps the compiled kernels it has seen under a key made from what Triton specializes on, and sends a
launch whose key it knows straight to the compiled kernel's launcher; any other goes through the JIT (which compiles
if needed) and its compiled kernel is kept. The key: the grid, the device, each tensor argument's dtype and whether
its address is a multiple of 16, the width class of each int in the kernel's ``do_not_specialize`` (Triton compiles
those for i32, i64 or u64 only), every other argument's type and value, exactly (stricter than Triton, which
looks at an int's ``== 1``, ``% 16`` and width; tuples element by element), the keyword arguments' names, and the
options Triton reads on every launch (``debug``, the instrumentation mode of profilers such as proton). So a hit
has the specialization the JIT would pick. Unlike the JIT, a hit does not check that the module globals the kernel
read at compile time are unchanged (smsplit's are constants), and a kernel with ``pre_run_hooks`` always goes
through the JIT. ``SMSPLIT_FAST_LAUNCH=0`` sends every launch through the JIT (for comparison and as a way out).
"""

from __future__ import annotations

import inspect
import operator
import os
import random
import socket
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import triton.language as tl
from triton import knobs
from triton.runtime import driver

ENV_SWITCH = "SMSPLIT_FAST_LAUNCH"
MAX_KERNELS = 256  # compiled kernels kept per FastLaunch; the least recently used key is dropped past this


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a process group's rendezvous (``MASTER_PORT``, or
    ``init_method="tcp://127.0.0.1:<port>"``). Taken below the kernel's ephemeral range (``ip_local_port_range``,
    32768-60999 by default), where NCCL's and gloo's own sockets get their ports: a port the kernel handed out as
    ephemeral can be handed out again, to one of those sockets, between this check and the rendezvous
    (EADDRINUSE)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port between 20000 and 32000 on 127.0.0.1")


def enabled_by_environment() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def _fingerprint(value: Any) -> Any:
    """What Triton's specialization of one argument depends on (see the module docstring)."""
    if type(value) is int:
        return value
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, tuple):  # each element as an argument of its own (Triton specializes tuples so)
        return tuple, tuple(map(_fingerprint, value))
    if isinstance(value, tl.constexpr):
        return tl.constexpr, _fingerprint(value.value)
    if isinstance(value, float):
        return float, repr(value)  # (0.0 and -0.0 are equal but compile different constexpr kernels)
    return type(value), value  # bools, None, other constexpr values (bool and int keys must differ: True == 1)


def _width(value: Any) -> Any:
    """`_fingerprint` of an argument in the kernel's ``do_not_specialize``: only an int's width class matters."""
    if type(value) is int:
        return int, -2 ** 31 <= value < 2 ** 31, value >= 2 ** 63
    return _fingerprint(value)


class FastLaunch:
    """
    A `triton.jit` function launched as ``FastLaunch(fn)(grid, *args, stream=None, **kwargs)``, with the arguments
    ``fn[(grid,)](*args, **kwargs)`` takes, on ``stream`` (a `torch.cuda.Stream`; default: the current stream; a
    stream on another device than the current one goes through the JIT, which switches to it).

    ``grid`` is the number of programs (one dimension).
    """

    def __init__(self, fn) -> None:
        self.fn = fn
        self.__doc__ = getattr(fn, "__doc__", None)
        params = list(inspect.signature(getattr(fn, "fn", fn)).parameters.values())
        self._names = [p.name for p in params]
        self._defaults = {p.name: p.default for p in params if p.default is not p.empty}
        self._loose_names = {params[i].name if isinstance(i, int) else i for i in getattr(fn, "do_not_specialize", ())}
        self._loose_positions = [i for i, name in enumerate(self._names) if name in self._loose_names]
        self._kernels: Dict[Tuple, Tuple] = {}
        # (Triton's interpreter, TRITON_INTERPRET=1, has no compiled kernels: every launch goes through it)
        self.enabled = enabled_by_environment() and hasattr(fn, "device_caches")
        self.hits = 0

    def __call__(self, grid: int, *args, stream: Optional[torch.cuda.Stream] = None, **kwargs):
        device = driver.active.get_current_device() if self.enabled else None
        if not self.enabled or self.fn.pre_run_hooks or (stream is not None and stream.device_index != device):
            return self._through_jit(grid, args, kwargs, stream)  # (which also switches to a stream's device)
        positional = [a if type(a) is int else _fingerprint(a) for a in args]
        for i in self._loose_positions:
            if i < len(args):
                positional[i] = _width(args[i])
        loose = self._loose_names
        # the options Triton's JIT reads on every launch and compiles into the kernel (debug checks, profiling)
        options = (self.fn.debug or knobs.runtime.debug, knobs.compilation.instrumentation_mode)
        key = (grid, device, options, len(args), *positional,
               *[(name, _width(value) if name in loose else value if type(value) is int else _fingerprint(value))
                 for name, value in kwargs.items()])
        try:
            entry = self._kernels.get(key)
        except TypeError:  # an unhashable value
            return self._through_jit(grid, args, kwargs, stream)
        if entry is None:
            kernel = self._through_jit(grid, args, kwargs, stream)
            if kernel is not None and hasattr(kernel, "packed_metadata"):
                self._kernels[key] = (kernel, self._tail_taker(len(args), kwargs))
                if len(self._kernels) > MAX_KERNELS:  # (dicts keep insertion order: the first is the least used)
                    self._kernels.pop(next(iter(self._kernels)), None)  # (another thread may have taken it)
            return kernel
        kernel, take_tail = entry
        self._kernels[key] = self._kernels.pop(key, entry)  # most recently used last (the bound drops the first;
        # another thread launching the same kernel may have moved it already)
        full = (*args, *take_tail(kwargs))
        raw_stream = driver.active.get_current_stream(device) if stream is None else stream.cuda_stream
        enter, leave = _launch_hooks()
        metadata = kernel.launch_metadata((grid,), raw_stream, *full) if enter is not None else None
        kernel.run(grid, 1, 1, raw_stream, kernel.function, kernel.packed_metadata, metadata, enter, leave, *full)
        self.hits += 1
        return kernel

    def _tail_taker(self, num_args: int, kwargs: dict) -> Callable[[dict], tuple]:
        """A function giving the arguments after the first ``num_args``, in the signature's order, from keyword
        arguments with ``kwargs``'s names (defaults for the others); C loops where every name is given."""
        tail = self._names[num_args:]
        if tail and all(name in kwargs for name in tail):
            take = operator.itemgetter(*tail)
            return (lambda kw: (take(kw),)) if len(tail) == 1 else take
        defaults = self._defaults
        return lambda kw: tuple(kw[name] if name in kw else defaults[name] for name in tail)

    def _through_jit(self, grid: int, args: tuple, kwargs: dict, stream: Optional[torch.cuda.Stream]):
        if stream is None:
            return self.fn[(grid,)](*args, **kwargs)
        with torch.cuda.stream(stream):
            return self.fn[(grid,)](*args, **kwargs)


def _launch_hooks():
    """Triton's launch hooks (profilers such as proton add them), or (None, None) when none is set."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if not getattr(enter, "calls", enter) and not getattr(leave, "calls", leave):
        return None, None
    return enter, leave
