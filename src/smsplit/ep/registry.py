"""The transports by name, and the choice of one per call: the only place that compares backend names.

`ORDER` is the registered transports from the fastest to the slowest as measured (BENCHMARKS.md: on 2 H200s,
replayed from CUDA graphs, ``nvlink_copy_engine`` beats ``nvlink`` for BF16 and FP8 dispatches and combines, both beat
``copy_engine``; the reference transport moves anything anywhere). ``backend="auto"`` takes, per call, the first
that can move it (`choose`); an explicit backend that cannot is an `EPArgumentError` naming one that can.

What a transport can move is its `Capabilities`; what a call asks is a `Move` built from arguments that the header
exchange made agree on every rank, and the `Environment` is the same on every rank, so every rank chooses alike.
"""

from typing import Callable, Dict, Optional, Tuple

import torch

from .device import CopyEngine, NvlinkCopyEngine, NvlinkSmPush
from .hierarchical import HierarchicalTransport
from .reference import ReferenceTransport
from .transport import Capabilities, Environment, EPArgumentError, Move, Transport, reject

AUTO = "auto"
_CLASSES = {cls.name: cls for cls in (NvlinkCopyEngine, NvlinkSmPush, CopyEngine, ReferenceTransport,
                                      HierarchicalTransport)}
# fastest first (see the module docstring); "hierarchical" only where the node layout has several nodes
ORDER = ("nvlink_copy_engine", "nvlink", "copy_engine", "hierarchical", "reference")
# every name `Buffer(backend=)` takes; a name's index is its code in the constructor's header (new names go last)
BACKENDS = (AUTO, "reference", "nvlink", "copy_engine", "nvlink_copy_engine", "hierarchical")
DEVICE_BACKENDS = tuple(name for name in BACKENDS if name in _CLASSES and _CLASSES[name].capabilities().needs_cuda)
assert set(ORDER) == set(_CLASSES) and ORDER[-1] == ReferenceTransport.name
REFERENCE = ReferenceTransport.name  # moves anything, on any device: the last resort of every choice


def check_backend(backend, argument: str = "backend") -> None:
    if backend not in BACKENDS:
        raise reject(argument, f"expected one of {BACKENDS}, got {backend!r}")


def transport_class(name: str):
    return _CLASSES[name]


_CAPABILITIES = {name: cls.capabilities() for name, cls in _CLASSES.items()}


def capabilities(name: str) -> Capabilities:
    return _CAPABILITIES[name]


def candidates(backend: str) -> Tuple[str, ...]:
    """The transports a buffer made with ``backend`` may use: every registered one for "auto"."""
    return ORDER if backend == AUTO else (backend,)


def make(name: str, group, device: torch.device, timeout_s: float, num_nvl_bytes: int, nodes=None,
         reference: Optional[ReferenceTransport] = None, chunk_tokens: Optional[int] = None) -> Transport:
    """A transport of ``name`` other than the reference (the buffer's own header channel, made first). The
    hierarchical transport needs ``nodes`` (the group's `smsplit.nodes.NodeLayout`, or ranks per node) and takes
    ``reference`` (the buffer's header channel, whose waits and failure state it shares; a new one if None) and
    ``chunk_tokens`` (tokens per network chunk; None: its default)."""
    if name == HierarchicalTransport.name:
        if nodes is None:
            raise reject("backend", "backend='hierarchical' needs the node layout (ranks per node); none was given")
        reference = reference if reference is not None else ReferenceTransport(group, device, timeout_s)
        if chunk_tokens is None:
            return HierarchicalTransport(reference, nodes)
        return HierarchicalTransport(reference, nodes, chunk_tokens)
    return _CLASSES[name](group, device, timeout_s, num_nvl_bytes)


def environment(backend: str, device: torch.device, one_node: bool, num_ranks: int, num_nvl_bytes: int,
                num_nodes: int = 1) -> Environment:
    """The `Environment` of a buffer made with ``backend`` on ``device``; the GPU's SM count where a device transport
    may run there (its calls' count must not exceed it)."""
    env = Environment(device.type == "cuda", one_node, num_ranks, num_nvl_bytes, 0, str(device), num_nodes)
    if any(environment_problem(name, env) is None and capabilities(name).needs_cuda for name in candidates(backend)):
        env = env._replace(device_sms=torch.cuda.get_device_properties(device).multi_processor_count)
    return env


def environment_problem(name: str, env: Environment, caps: Optional[Capabilities] = None) \
        -> Optional[EPArgumentError]:
    """What keeps transport ``name`` from running at all on ``env`` (checked when an explicit backend is built, and
    by "auto" for every call), or None."""
    caps = caps or capabilities(name)
    if caps.needs_cuda and not env.cuda:
        return reject("backend", f"backend={name!r} moves CUDA tensors over NVLink: it needs an NCCL group (this "
                                 f"group is gloo); use backend='reference'")
    if caps.needs_buffer and env.num_nvl_bytes == 0:
        return reject("num_nvl_bytes", f"backend={name!r} needs a receive buffer: size it with "
                                       f"Buffer.get_buffer_size_hint(..., backend={name!r})")
    if caps.max_ranks and env.num_ranks > caps.max_ranks:
        return reject("group", f"backend={name!r} serves up to {caps.max_ranks} ranks, the group has {env.num_ranks}")
    if caps.one_node and env.num_nodes > 1:
        return reject("backend", f"backend={name!r} moves tokens inside one node; this buffer's node layout has "
                                 f"{env.num_nodes} nodes: use backend='hierarchical' or 'reference'")
    if caps.one_node and not env.one_node:  # (checked by "auto" only: see `Buffer`)
        return reject("backend", f"backend={name!r} needs every rank on one machine (symmetric memory); these "
                                 f"ranks share no /dev/shm: use backend='reference'")
    return None


def environment_problem_of(backend: str, env: Environment) -> Optional[EPArgumentError]:
    """What keeps a buffer made with ``backend`` from running on ``env``: an explicit backend's
    `environment_problem`; none for "auto", which chooses among the transports that run there."""
    return None if backend == AUTO else environment_problem(backend, env)


def _names(dtypes) -> str:
    return " and ".join(sorted(str(d).replace("torch.", "") for d in dtypes)) or "no"


def problem(name: str, move: Move, env: Environment, caps: Optional[Capabilities] = None) -> Optional[EPArgumentError]:
    """The first thing of ``move`` that transport ``name`` cannot do (an `EPArgumentError` naming the argument), or
    None. Its environment is `environment_problem`'s."""
    caps = caps or capabilities(name)
    dispatch = move.op == "dispatch"
    if move.captured:
        if caps.capture == "never":
            return reject("backend", f"the {name} backend cannot run inside a CUDA graph capture (it synchronizes "
                                     f"with the host); the backends that can: {_capturable()}")
        if caps.capture == "cached" and dispatch and move.layout_of is None:
            return reject("handle", f"the {name} backend plans its copies on the host: a captured dispatch needs "
                                    f"the handle of an eager dispatch (cached mode)")
        if dispatch and move.worst <= 0:
            return reject("num_worst_tokens", "a dispatch captured in a CUDA graph needs num_worst_tokens > 0 (a "
                                              "fixed number of received rows: no host synchronization)")
    if move.layout_of is not None and not caps.reads_any_layout:
        if move.layout_of != name:
            return reject("handle", f"the {name} backend moves only layouts its own dispatches made; this handle's "
                                    f"dispatch ran on {move.layout_of}")
        if move.hidden and move.hidden != move.layout_hidden:
            return reject("x", f"the {name} backend moves rows of the hidden size its handle's dispatch moved "
                               f"({move.layout_hidden}), got {move.hidden}")
    if move.dtype is None:
        if not caps.weights_only:
            return reject("x", f"the {name} backend moves no top-k weights without values")
    elif dispatch:
        quantized = move.quantize and (move.dtype in caps.quantizes or torch.float8_e4m3fn in caps.moves)
        if not quantized and move.dtype not in caps.moves:
            return reject("x", f"the {name} backend moves {_names(caps.moves)} values (and quantizes "
                               f"{_names(caps.quantizes)} ones with fp8=True), got {move.dtype}")
    elif move.dtype not in caps.combines:
        return reject("x", f"the {name} backend combines {_names(caps.combines)} rows, got {move.dtype}")
    if move.hidden % caps.hidden_multiple:
        return reject("x", f"the {name} backend needs a hidden size that is a multiple of {caps.hidden_multiple}, "
                           f"got {move.hidden}")
    if dispatch and move.hidden and (caps.needs_buffer or env.num_nvl_bytes > 0) and not move.captured:
        fp8 = move.quantize or move.dtype == torch.float8_e4m3fn
        need = caps.buffer_bytes(env.num_ranks, move.max_tokens, move.hidden, move.num_topk,
                                 torch.bfloat16 if fp8 else move.dtype, fp8, move.dtype, move.combine_rows)
        if need > env.num_nvl_bytes:
            how = (f"with the {name} backend (get_buffer_size_hint(..., backend={name!r}))" if caps.needs_buffer
                   else "(get_buffer_size_hint)")
            return reject("num_nvl_bytes", f"{move.max_tokens} tokens of hidden {move.hidden} need {need} bytes "
                                           f"{how} but the buffer has {env.num_nvl_bytes}")
    if caps.max_topk and move.num_topk > caps.max_topk:
        if dispatch:
            return reject("topk_idx", f"the {name} backend moves up to {caps.max_topk} top-k columns, got "
                                      f"{move.num_topk}")
        return reject("topk_weights", f"the {name} backend combines up to {caps.max_topk} top-k columns, got "
                                      f"{move.num_topk}")
    if caps.needs_cuda and env.device_sms and move.num_sms > env.device_sms:
        return reject(move.sms_argument, f"{move.sms_argument}={move.num_sms} (this call's SM count) exceeds the "
                                         f"{env.device_sms} SMs of {env.device}")
    return None


def _capturable() -> str:
    return ", ".join(name for name in ORDER if capabilities(name).capture != "never")


# (backend, move, env, internal) -> the transport `choose` gave with the registered capabilities
_CHOSEN: Dict[tuple, str] = {}
_CHOSEN_MAX = 4096  # distinct calls remembered (a Move holds the token count, which may vary per step): then cleared


def choose(backend: str, move: Move, env: Environment, internal: bool = False,
           capabilities_of: Callable[[str], Capabilities] = capabilities) -> str:
    """
    The transport of one call on a buffer made with ``backend``: for "auto", the first of `ORDER` that can move
    ``move`` on ``env`` (for a new layout with ``num_worst_tokens``, one that could also capture it); for an
    explicit backend, that one, or (``internal``: a backward pass, which the caller did
    not ask for by backend) the reference transport where it cannot. ``capabilities_of``: each name's
    `Capabilities` (the registered ones'; tests pass others).

    Raises:
        EPArgumentError: naming the argument that no candidate can move; for an explicit backend, naming the
            backend that can, if any.
    """
    # The choice is a function of its arguments and the registered capabilities, which never change: each eager
    # call makes it once or twice, so it is remembered (a refusal is not: its error is raised afresh each time).
    if capabilities_of is not capabilities:
        return _choose(backend, move, env, internal, capabilities_of)
    key = (backend, move, env, internal)
    name = _CHOSEN.get(key)
    if name is None:
        name = _choose(backend, move, env, internal, capabilities_of)
        if len(_CHOSEN) >= _CHOSEN_MAX:
            _CHOSEN.clear()
        _CHOSEN[key] = name
    return name


def _choose(backend: str, move: Move, env: Environment, internal: bool,
            capabilities_of: Callable[[str], Capabilities]) -> str:
    """`choose`, made afresh."""
    names = candidates(backend)
    # "auto" moves a new layout with num_worst_tokens on a transport that could capture it too: an eager warm-up
    # and the capture of the same code then take the same transport (whose buffer the warm-up made)
    padded_layout = move.op == "dispatch" and move.layout_of is None and move.worst > 0
    if internal and backend != AUTO:
        names = names + (REFERENCE,)
    first = unusable = None
    for name in names:
        caps = capabilities_of(name)
        if backend == AUTO:  # (an explicit backend's environment is checked when the buffer is made)
            trouble = environment_problem(name, env, caps)
            if trouble is not None:
                unusable = unusable or trouble
                continue
            if padded_layout and caps.capture == "cached":  # (see below)
                continue
            if caps.hierarchical and env.num_nodes == 1:  # (a node layout of one node: nothing crosses a network)
                continue
        trouble = problem(name, move, env, caps)
        if trouble is None:
            return name
        first = first or trouble
    first = first or unusable
    if backend != AUTO:
        able = [name for name in ORDER if name not in names and environment_problem(name, env, capabilities_of(name))
                is None and problem(name, move, env, capabilities_of(name)) is None
                and not (capabilities_of(name).hierarchical and env.num_nodes == 1)]
        if able:
            first = EPArgumentError(first.argument, f"{first}; backend={able[0]!r} can")
    raise first


def size_hint(backend: str, num_ranks: int, max_tokens: int, hidden: int, num_topk: int, x_dtype: torch.dtype,
              fp8: bool, combine_dtype: torch.dtype) -> int:
    """`Buffer.get_buffer_size_hint`: the bytes ``backend``'s transport needs ("auto": enough for each of them)."""
    return max(capabilities(name).buffer_bytes(num_ranks, max_tokens, hidden, num_topk, x_dtype, fp8, combine_dtype,
                                               False) for name in candidates(backend))


__all__ = ["AUTO", "BACKENDS", "DEVICE_BACKENDS", "ORDER", "REFERENCE", "candidates", "capabilities",
           "check_backend", "choose", "environment", "environment_problem", "environment_problem_of", "make", "problem",
           "size_hint", "transport_class"]
