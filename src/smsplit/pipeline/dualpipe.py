"""DualPipe and DualPipeV runtimes: walk `comm_plan` (the ops of `schedule`, with p2p batches)."""

from __future__ import annotations

import contextlib
import itertools
import operator
import zlib
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from ..timeouts import timeout_problem
from .schedule import (
    Batch,
    Op,
    check_chunks,
    chunks_per_lane,
    comm_plan,
    header_first,
    lanes,
    stage_of,
)
from .weight_grad import WeightGradStore

HEADER_LEN = 64
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES.append(getattr(torch, _name))


_declared_shapes: tuple[tuple[int, ...], ...] | None = None
_declared_dtype: torch.dtype | None = None


def set_p2p_tensor_shapes(shapes) -> None:
    """Declare the shapes of the tensors every pipeline stage sends to the next, one shape per tensor of a
    micro-batch (DeepSeek's `dualpipe.set_p2p_tensor_shapes`). None takes the declaration back.

    The runtime learns what ranks send anyway (see `DualPipe`), so the declaration is a check: the first step
    after it (or after `reset_shapes`) compares what every stage sent with it, and if a stage sent other
    shapes, every rank raises a ValueError naming that stage and its rank at the end of that step (the step
    itself ran with the shapes it learned). Applies to every DualPipe and DualPipeV of the process, on every
    stream; call it with the same value on every rank (a step on ranks that declared differently raises a
    ValueError on every rank before it starts)."""
    global _declared_shapes
    if shapes is None:
        _declared_shapes = None
        return
    if isinstance(shapes, torch.Size) or not isinstance(shapes, (list, tuple)) or not shapes:
        raise TypeError(f"set_p2p_tensor_shapes: give a list of shapes, one per tensor a stage sends, e.g. "
                        f"[(micro_batch, seq, hidden)]; got {shapes!r}")
    out = []
    for i, shape in enumerate(shapes):
        try:
            if not isinstance(shape, (list, tuple, torch.Size)):
                raise TypeError
            dims = tuple(_int_arg(d, "", TypeError) for d in shape)
        except TypeError:
            raise TypeError(f"set_p2p_tensor_shapes: shape {i} must be a tuple of ints, got {shape!r}") from None
        if any(d < 0 for d in dims):
            raise ValueError(f"set_p2p_tensor_shapes: shape {i} has a negative size: {dims}")
        out.append(dims)
    _declared_shapes = tuple(out)


def set_p2p_tensor_dtype(dtype: torch.dtype | None) -> None:
    """Declare the dtype of every tensor the pipeline stages send (DeepSeek's `dualpipe.set_p2p_tensor_dtype`);
    checked as `set_p2p_tensor_shapes` says. None takes the declaration back."""
    global _declared_dtype
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"set_p2p_tensor_dtype: give a torch.dtype, got {dtype!r}")
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"set_p2p_tensor_dtype: the pipeline does not send {dtype}; use one of "
                         f"{', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}")
    _declared_dtype = dtype


def _declaration():
    """The declared (shapes, dtype), either None where not declared; None when neither is."""
    if _declared_shapes is None and _declared_dtype is None:
        return None
    return _declared_shapes, _declared_dtype


def _declaration_differs(meta, declared) -> bool:
    """Whether the (shape, dtype) list ``meta`` of what a stage sends differs from ``declared``."""
    shapes, dtype = declared
    if shapes is not None and [tuple(s) for s, _ in meta] != list(shapes):
        return True
    return dtype is not None and any(d != dtype for _, d in meta)


def _describe(meta) -> str:
    return "[" + ", ".join(f"{tuple(s)} {str(d).removeprefix('torch.')}" for s, d in meta) + "]"


def run_backward(tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Backward from `tensors` with `grads`, skipping autograd's shape check: the pipeline frees
    the storage of stage outputs once they are sent, and only their autograd graph is needed."""
    Variable._execution_engine.run_backward(tuple(tensors), tuple(grads), False, False, (), True, True)


class PipelineError(RuntimeError):
    """A message or collective of a pipeline step failed (a peer's connection, or no answer in time).

    Attributes:
        rank: the pipeline rank that raised it.
        phase: what it was doing (e.g. "receiving act of chunk 3 from pipeline rank 1").
    """

    def __init__(self, message: str, rank: int, phase: str) -> None:
        super().__init__(message)
        self.rank, self.phase = rank, phase


class PipelineTimeoutError(PipelineError, TimeoutError):
    """A peer did not answer within the pipeline's `timeout_s` (or, without one, the process group's timeout)."""


def _encode_header(tensors: list[torch.Tensor], device) -> torch.Tensor:
    code = [len(tensors)]
    for t in tensors:
        code += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(code + [0] * (HEADER_LEN - len(code)), dtype=torch.int64, device=device)


def _abort_header(device) -> torch.Tensor:
    """Sent instead of a stream's first header when the sender rejected its stage outputs."""
    return torch.tensor([-1] + [0] * (HEADER_LEN - 1), dtype=torch.int64, device=device)


def _differentiable(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` carry gradients between stages (floating point and complex)."""
    return dtype.is_floating_point or dtype.is_complex


def _as_list(outputs) -> list:
    """A stage's outputs as a list (a tensor, or a tuple/list of them); [] for anything else, which
    `_check_sent_outputs` refuses."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    return list(outputs) if isinstance(outputs, (tuple, list)) else []


def _send_problem(outputs: list) -> str | None:
    """Why stage outputs cannot be sent to another rank, or None."""
    for i, t in enumerate(outputs):
        if not isinstance(t, torch.Tensor):
            return f"output {i} is a {type(t).__name__}, not a tensor"
        if t.dtype not in _DTYPES:
            return (f"output {i} has dtype {t.dtype}, which the pipeline does not send; send one of "
                    f"{', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}")
    entries = 1 + sum(2 + t.dim() for t in outputs)
    if entries > HEADER_LEN:
        return (f"outputs of shapes {[tuple(t.shape) for t in outputs]} need {entries} entries of the "
                f"{HEADER_LEN}-entry p2p header (1 + per tensor 2 + its dimensions); return fewer tensors or "
                f"fewer dimensions")
    return None


def _outer_saved_tensor_hooks() -> bool:
    """Whether the caller runs under saved-tensor hooks of its own (e.g. save_on_cpu)."""
    return (torch._C._autograd._saved_tensors_hooks_is_enabled()
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)


@contextlib.contextmanager
def _saved_storages():
    """Yields the set of storage addresses of the tensors that autograd saves for backward inside the
    block (None where saved-tensor hooks are disabled: nothing known). A pair of saved-tensor hooks
    already active (e.g. save_on_cpu) still packs and unpacks; otherwise tensors are kept detached
    (an output kept as is would hold its own grad_fn), and unpacking checks, as autograd does without
    hooks, that they were not modified in place.

    The pipeline uses it only where the caller's own saved-tensor hooks are active (see `_freeable`): under
    any saved-tensor hooks, autograd hands an autograd Function's backward new tensor objects from
    ctx.saved_tensors, not the ones it saved, so a Function that sets ``.grad`` on a saved parameter (the
    deferred weight-gradient pattern of DeepSeek's examples) would set it on a copy. Under the caller's
    hooks that is so without a pipeline too."""
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        yield None
        return
    storages: set[int | None] = set()
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

    def record(t: torch.Tensor) -> None:
        try:
            storages.add(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # (no plain storage: sparse, some subclasses)
            storages.add(None)

    def pack(t: torch.Tensor):
        record(t)
        return outer[0](t) if outer else (t.detach(), t._version)

    def unpack(packed) -> torch.Tensor:
        if outer:
            return outer[1](packed)
        t, version = packed
        if t._version != version:
            raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an "
                               f"inplace operation: {t.type()} {list(t.shape)} is at version {t._version}; "
                               f"expected version {version} instead")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield storages


_EXCLUSIVE: dict[torch.device, int] = {}  # device -> `_storage_count` of a tensor that shares its storage with none


def _storage_count(t: torch.Tensor) -> int | None:
    """How many references `torch._C._storage_Use_Count` counts on the storage of ``t`` (the Python storage
    object it is given included); None where torch does not have it."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    storage = t.untyped_storage()
    return count(storage._cdata)


def _storage_is_exclusive(t: torch.Tensor) -> bool:
    """Whether no tensor but ``t`` holds its storage (True where torch cannot count: freeing ``t`` is safe
    then, only perhaps in vain)."""
    if t.device not in _EXCLUSIVE:
        _EXCLUSIVE[t.device] = _storage_count(torch.empty(1, dtype=t.dtype, device=t.device))
    count = _EXCLUSIVE[t.device]
    return count is None or _storage_count(t) == count


def _freeable(outputs, inputs, saved: set | None = None) -> list[bool]:
    """For each of a stage's outputs, taken right after its forward: whether the pipeline may free its storage
    once it is sent (its autograd graph stays).

    An output may be freed when it is neither a view, nor a leaf (a parameter, or an input handed through), nor
    one of the stage's inputs, and autograd did not save it for the backward. Without ``saved`` (the storages
    `_saved_storages` recorded under the caller's saved-tensor hooks) that is read from reference counts, so
    that no saved-tensor hooks of the pipeline's own run in the forward: autograd holds a tensor it saves as
    an input of an op (the tensor itself, a count more on it), and a new alias of the storage for one an op
    saves as its output (a count more on the storage, which freeing the tensor would not free). Anything else
    holding the tensor or its storage (a view, a cache of the stage) keeps it too."""
    use_count = getattr(torch.Tensor, "_use_count", None)
    if saved is None and use_count is None:
        return [False] * len(outputs)  # (nothing known)
    out = []
    for t in outputs:
        ok = (isinstance(t, torch.Tensor) and t._base is None and t.grad_fn is not None
              and not any(t is i for i in inputs))
        if ok:
            try:
                if saved is not None:
                    ok = t.untyped_storage().data_ptr() not in saved
                else:
                    ok = use_count(t) == 1 and _storage_is_exclusive(t)
            except (RuntimeError, NotImplementedError, TypeError):  # (no plain storage: sparse, some subclasses)
                ok = False
        out.append(ok)
    return out


MAX_CHUNKS = (1 << 31) - 1  # far above any batch's micro-batches


def _int_arg(value, what: str, error: type[Exception]) -> int:
    """``value`` as an int (numpy integers too); ``error`` for bools and non-integers."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise error(f"{what} must be an int, got {value!r}") from None


def _decode_header(header: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]] | None:
    """Shapes and dtypes of the tensors a stream sends; None for an abort header."""
    code = header.tolist()
    if code[0] < 0:
        return None
    out, i = [], 1
    for _ in range(code[0]):
        dtype, ndim = _DTYPES[code[i]], code[i + 1]
        out.append((tuple(code[i + 2:i + 2 + ndim]), dtype))
        i += 2 + ndim
    return out


class _Pipeline(nn.Module):
    kind = ""

    def __init__(self, modules: Sequence[nn.Module], batch_dim: int = 0,
                 process_group: dist.ProcessGroup | None = None,
                 rank_mapping: list[int] | None = None, *, timeout_s: float | None = None,
                 op_hook: Callable[[Op, str], None] | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        if timeout_s is not None and (problem := timeout_problem(timeout_s)):
            raise ValueError(f"{name}: timeout_s: {problem} (or None)")
        if op_hook is not None and not callable(op_hook):
            raise TypeError(f"{name}: op_hook must be a function of (op, when) or None, got {op_hook!r}")
        if isinstance(modules, (nn.Sequential, nn.ModuleList)):  # (DeepSeek's examples pass an nn.Sequential)
            modules = list(modules)
        if not isinstance(modules, (tuple, list)) or len(modules) != 2 or not all(
                isinstance(m, nn.Module) for m in modules):
            raise TypeError(f"{name} takes modules=(module0, module1) (a tuple, list, nn.Sequential or "
                            f"nn.ModuleList of two nn.Modules); got {modules!r}")
        t0, t1 = type(modules[0]), type(modules[1])
        hooked = [t for t in (t0, t1) if hasattr(t, "overlapped_forward_backward")]
        if hooked and t0 is not t1:
            raise TypeError(
                f"{name}: {hooked[0].__name__} defines overlapped_forward_backward but the modules "
                f"differ in type ({t0.__name__}, {t1.__name__}); an F&B step runs one module's "
                f"forward with the other's backward, so give both modules the same type, or "
                f"remove the hook to run forward then backward")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{name} needs torch.distributed: call init_process_group first")
        self.module = nn.ModuleList(modules)
        self.overlapped_forward_backward = bool(hooked)
        self.batch_dim = _int_arg(batch_dim, f"{name}: batch_dim", TypeError)
        self.group = process_group or dist.group.WORLD
        self.num_ranks = self.group.size()
        self.timeout_s = timeout_s
        if rank_mapping is None:
            rank_mapping = list(range(self.num_ranks))
        if sorted(rank_mapping) != list(range(self.num_ranks)):
            raise ValueError(f"{name}: rank_mapping must be a permutation of 0..{self.num_ranks - 1} "
                             f"(one pipeline rank per process-group rank); got {rank_mapping}")
        if self.kind == "dualpipe" and self.num_ranks % 2:
            raise ValueError(f"DualPipe needs an even number of ranks in its process group, got "
                             f"{self.num_ranks}; use DualPipeV, which takes any number of ranks")
        self.rank = rank_mapping[self.group.rank()]
        group_rank_of = {pp_rank: g for g, pp_rank in enumerate(rank_mapping)}
        world = self.group is dist.group.WORLD
        self._peer = {r: g if world else dist.get_global_rank(self.group, g) for r, g in group_rank_of.items()}
        self._lanes = lanes(self.kind, self.num_ranks)
        self._next: dict[int, tuple[int, int] | None] = {}
        self._prev: dict[int, tuple[int, int] | None] = {}
        self._lane_of: dict[int, int] = {}  # module -> its lane
        for li, lane in enumerate(self._lanes):
            for i, (r, m) in enumerate(lane):
                if r == self.rank:
                    self._lane_of[m] = li
                    self._prev[m] = lane[i - 1] if i > 0 else None
                    self._next[m] = lane[i + 1] if i + 1 < len(lane) else None
        self._plans: dict[tuple[int, bool], list] = {}
        self._known_streams: set = set()
        self._input_meta = None  # micro-batch shapes and dtypes of the inputs when the shapes were learned
        self._stream_meta: dict = {}
        self._checked_declaration = None  # the declared p2p shapes/dtype last checked against the learned ones
        self.op_hook: Callable[[Op, str], None] | None = op_hook
        """Called as op_hook(op, "start") before and op_hook(op, "end") after each compute op."""

    # ----------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        for t in itertools.chain(self.module.parameters(), self.module.buffers()):
            return t.device
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def reset_shapes(self) -> None:
        """Forget the learned shapes of the tensors passed between ranks. Call it on every rank
        before a step whose micro-batches have other shapes than before."""
        self._known_streams.clear()
        self._stream_meta.clear()
        self._input_meta = None
        self._checked_declaration = None

    def _plan(self, num_chunks: int, forward_only: bool) -> list:
        key = (num_chunks, forward_only)
        if key not in self._plans:
            self._plans[key] = comm_plan(self.kind, self.num_ranks, num_chunks, self.rank, forward_only)
        return self._plans[key]

    # ----------------------------------------------------------------------------------------
    def step(self, *inputs: torch.Tensor, num_chunks: int = 0, criterion: Callable | None = None,
             labels: Sequence[torch.Tensor] | torch.Tensor = (), return_outputs: bool = False):
        """Run one training step (forward and backward of every micro-batch), or with
        torch.no_grad() one forward-only step.

        inputs: the batch, split into micro-batches along batch_dim. Read only on ranks where a
          lane starts (DualPipe: first and last rank, DualPipeV: first rank).
        num_chunks: number of micro-batches, an int (DualPipe: even and >= 2*ranks, half of them
          enter at each end; DualPipeV: >= 2*ranks).
        criterion: loss, called as criterion(*stage_outputs, *labels) per micro-batch where a lane
          ends (DualPipe: first and last rank, DualPipeV: first rank); required there to train.
        labels: a tensor or a tuple/list of tensors, split like inputs. On DualPipe's first rank they
          belong to the inputs of the last rank and vice versa, and must split into micro-batches of
          those inputs' size.
        return_outputs: also return the last stage's outputs.

        Returns (loss, outputs): loss is a tensor of num_chunks (DualPipe: num_chunks/2) detached
        per-micro-batch losses where a lane ends, else None; outputs are the last stage's outputs
        concatenated along batch_dim there when return_outputs, else None. Gradients accumulate
        into .grad as the sum over micro-batches of each loss's gradient.

        The outputs are detached, also when training (DeepSeek's DualPipe returns them attached to
        the step's graph): that graph has been through its backward already, so they could not be
        differentiated again, and attached they would keep its nodes, and whatever autograd Functions
        keep on their ctx, alive as long as the outputs live.
        """
        forward_only = not torch.is_grad_enabled()
        if isinstance(labels, torch.Tensor):  # (DeepSeek's step takes one label tensor as it is)
            labels = (labels,)
        declared = _declaration()
        check_declared = declared is not None and declared != self._checked_declaration
        first_module = [m for m, prev in self._prev.items() if prev is None]
        last_module = [m for m, nxt in self._next.items() if nxt is None]
        error = None
        lane_sizes = [[0, 0] for _ in self._lanes]  # per lane: micro-batch size of its inputs, of its labels
        try:
            num_chunks = _int_arg(num_chunks, f"{type(self).__name__}.step: num_chunks", ValueError)
            if num_chunks > MAX_CHUNKS:  # (the ranks agree on it through int64 words)
                raise ValueError(f"{type(self).__name__}.step: num_chunks must be at most {MAX_CHUNKS}, got "
                                 f"{num_chunks}")
            self._check_step_args(inputs, num_chunks, criterion, labels, forward_only, first_module, last_module,
                                  lane_sizes)
        except (ValueError, TypeError) as e:
            error = e
        except Exception as e:  # noqa: BLE001 - this rank must not give up alone while its peers wait
            error = ValueError(f"{type(self).__name__}.step: rank {self.rank} failed to check its step arguments: "
                               f"{type(e).__name__}: {e}")
            error.__cause__ = e
        self._agree_on_args(error, -1 if error is not None else num_chunks, forward_only, lane_sizes,
                            zlib.crc32(repr(declared).encode()) if declared is not None else 0, check_declared)
        per_lane = chunks_per_lane(self.kind, num_chunks)
        self._forward_only = forward_only
        self._return_outputs = return_outputs
        self._criterion = criterion
        self._inputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._outputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._out_meta: dict[tuple[int, int], list] = {}
        self._out_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._in_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._results: dict[int, list[torch.Tensor]] = {}
        self._labels = list(zip(*[t.split(t.shape[self.batch_dim] // per_lane, self.batch_dim)
                                  for t in labels])) if last_module else []
        if first_module:
            split = [t.split(t.shape[self.batch_dim] // per_lane, self.batch_dim) for t in inputs]
            for c, chunk in enumerate(zip(*split)):
                self._inputs[(first_module[0], c)] = [self._as_input(t) for t in chunk]
        WeightGradStore.clear()
        self._pending_sends = ([], [])
        self._freeable: dict[tuple[int, int], list[bool]] = {}  # per sent output: may it be freed once sent
        self._rejected: tuple[tuple[int, int], ValueError] | None = None  # outputs whose stream's first header aborts
        try:
            for item in self._plan(num_chunks, forward_only):
                if isinstance(item, Batch):
                    self._exchange(item)
                else:
                    if self.op_hook is not None:
                        self.op_hook(item, "start")
                    self._run(item)
                    if self.op_hook is not None:
                        self.op_hook(item, "end")
            self._finish_sends()
            if not WeightGradStore.funcs_queue.empty() or WeightGradStore.cache:
                raise RuntimeError(f"{type(self).__name__}: deferred weight gradients left after the step")
        finally:
            WeightGradStore.clear()
        if check_declared:
            self._check_declaration(declared)

        loss = outputs = None
        if last_module:
            if criterion is not None:
                loss = torch.stack([self._losses[c] for c in range(per_lane)])
            if return_outputs:
                outputs = [torch.cat(ts, self.batch_dim)
                           for ts in zip(*[self._results[c] for c in range(per_lane)])]
                outputs = outputs[0] if len(outputs) == 1 else tuple(outputs)
        del self._inputs, self._outputs, self._out_meta, self._out_grads, self._in_grads, self._losses
        del self._results, self._labels, self._freeable
        return loss, outputs

    def _check_step_args(self, inputs, num_chunks, criterion, labels, forward_only, first_module, last_module,
                         lane_sizes) -> None:
        """Raise what is wrong with this rank's step arguments; fill ``lane_sizes[lane]`` with the micro-batch
        sizes of the inputs and labels this rank holds for that lane."""
        name = type(self).__name__
        check_chunks(self.kind, self.num_ranks, num_chunks)
        per_lane = chunks_per_lane(self.kind, num_chunks)
        if first_module:
            if not inputs:
                raise ValueError(f"{name}.step: rank {self.rank} runs a first stage and needs inputs")
            lane_sizes[self._lane_of[first_module[0]]][0] = self._split_check(inputs, per_lane, "input") // per_lane
            meta = []
            for i, t in enumerate(inputs):
                dim = self._batch_dim_of(t, f"input {i}")
                meta.append((t.shape[:dim] + (t.shape[dim] // per_lane,) + t.shape[dim + 1:], t.dtype))
            if self._known_streams and self._input_meta is not None and meta != self._input_meta:
                raise ValueError(f"{name}.step: micro-batches of {[tuple(m) for m, _ in meta]} after "
                                 f"{[tuple(m) for m, _ in self._input_meta]} when the shapes between ranks were "
                                 f"learned; call reset_shapes() on every rank first")
            self._input_meta = meta
        if last_module:
            if criterion is None and not forward_only:
                raise ValueError(f"{name}.step: rank {self.rank} runs a last stage and needs a "
                                 f"criterion to train (or call step under torch.no_grad())")
            if not isinstance(labels, (tuple, list)):
                raise TypeError(f"{name}.step: labels must be a tensor, or a tuple or list of tensors, got "
                                f"{type(labels).__name__}")
            if labels:
                lane_sizes[self._lane_of[last_module[0]]][1] = self._split_check(labels, per_lane, "label") // per_lane

    def _batch_dim_of(self, t: torch.Tensor, what: str) -> int:
        """batch_dim as a dimension of ``t`` (negative counts from the end)."""
        if not -t.dim() <= self.batch_dim < t.dim():
            raise ValueError(f"{type(self).__name__}.step: batch_dim {self.batch_dim} is out of range for {what} of "
                             f"shape {tuple(t.shape)} (dimensions {-t.dim()} to {t.dim() - 1})")
        return self.batch_dim % t.dim()

    def _start(self, what: str, collective: Callable, *args, **kwargs):
        """``collective(*args, **kwargs)``, which posts messages or starts a collective (``what`` names it in
        errors); a failure (a peer's connection already closed) raises `PipelineError` naming this rank and ``what``."""
        try:
            return collective(*args, **kwargs)
        except RuntimeError as error:
            raise PipelineError(f"{type(self).__name__} rank {self.rank}: {what}: {error}", self.rank, what) from error

    def _wait(self, work, what: str) -> None:
        """Wait for one message or collective (``what`` names it in errors). Where the host waits (gloo), at most
        `timeout_s` (without one, the process group's timeout); on NCCL only the current stream waits and the host
        runs on (a peer that never sends is then ended by NCCL's watchdog after the process group's timeout). A
        failure raises `PipelineTimeoutError` or `PipelineError` naming this rank and ``what``."""
        try:
            if self.timeout_s is not None and self.device.type != "cuda":  # (CUDA tensors: NCCL, the GPU waits)
                work.wait(timedelta(seconds=self.timeout_s))
            else:
                work.wait()
        except RuntimeError as error:
            if isinstance(error, PipelineError):
                raise
            kind = PipelineTimeoutError if "timed out" in str(error).lower() else PipelineError
            limit = f" (timeout_s={self.timeout_s:g})" if self.timeout_s is not None else ""
            raise kind(f"{type(self).__name__} rank {self.rank}: {what}{limit}: {error}", self.rank, what) from error

    def _agree_on_args(self, error: Exception | None, num_chunks: int, forward_only: bool,
                       lane_sizes: list[list[int]], declared: int = 0, check_declared: bool = False) -> None:
        """All ranks learn whether any rank's step arguments are invalid, whether all ranks ask for the same
        num_chunks and the same mode (training or forward only), whether all declared the same p2p shapes and
        dtype (``declared``: a checksum of the declaration, 0 for none) and check them in this step, and
        whether the labels of each lane, held where it ends, split into micro-batches of the size of its
        inputs, held where it starts; so that all raise before the first p2p message instead of some waiting
        for a peer that gave up or runs another plan. The first call also creates the NCCL communicator with
        every rank taking part, which NCCL's batched p2p needs."""
        words = torch.tensor([0 if error is None else self.rank + 1, num_chunks, -num_chunks, int(forward_only),
                              -int(forward_only), declared, -declared, int(check_declared), -int(check_declared),
                              *itertools.chain(*lane_sizes)], device=self.device)
        if self.num_ranks > 1:
            what = "agreeing with every rank on the step's arguments"
            self._wait(self._start(what, dist.all_reduce, words, op=dist.ReduceOp.MAX, group=self.group,
                                   async_op=True), what)
        if error is not None:
            raise error
        flag, most, least, any_forward_only, all_forward_only, declared_max, declared_min, any_check, all_check, \
            *sizes = words.tolist()
        name = type(self).__name__
        if flag:
            raise ValueError(f"{name}.step: rank {flag - 1} rejected its step arguments (see its error); no rank "
                             f"started the step")
        if most != -least:
            raise ValueError(f"{name}.step: the ranks ask for different num_chunks (from {-least} to {most}); no "
                             f"rank started the step")
        if any_forward_only != -all_forward_only:
            raise ValueError(f"{name}.step: some ranks train and some run forward only (torch.no_grad()); no rank "
                             f"started the step")
        if declared_max != -declared_min:
            raise ValueError(f"{name}.step: the ranks declared different p2p tensor shapes or dtypes "
                             f"(set_p2p_tensor_shapes, set_p2p_tensor_dtype; or some declared and some did not); "
                             f"declare the same on every rank; no rank started the step")
        if any_check != -all_check:
            raise ValueError(f"{name}.step: some ranks have checked the declared p2p tensor shapes against the "
                             f"learned ones and some have not (reset_shapes() was called on some ranks only); call "
                             f"reset_shapes() on every rank; no rank started the step")
        for lane, input_size, label_size in zip(self._lanes, sizes[::2], sizes[1::2]):
            if input_size and label_size and input_size != label_size:
                start, end = lane[0][0], lane[-1][0]
                raise ValueError(
                    f"{name}.step: the labels on rank {end} split into micro-batches of {label_size} along batch_dim "
                    f"{self.batch_dim}, but the inputs they label, on rank {start}, into micro-batches of "
                    f"{input_size}" + (f" (DualPipe's rank {end} holds the labels of rank {start}'s inputs)"
                                       if start != end else "") + "; no rank started the step")

    def _check_declaration(self, declared) -> None:
        """After a step: all ranks learn whether any stage sent other shapes or dtypes than `set_p2p_tensor_shapes`
        and `set_p2p_tensor_dtype` declared, and all raise a ValueError naming the first such stage and its rank."""
        name = type(self).__name__
        mine, meta = 0, None
        for m in (0, 1):
            nxt = self._next.get(m)
            if nxt is None or nxt[0] == self.rank:
                continue
            meta = self._stream_meta.get(("out", nxt[0], m))
            if meta is not None and _declaration_differs(meta, declared):
                mine = 2 * self.num_ranks - (2 * self.rank + m)  # the largest for the first rank and module
                break
        word = torch.tensor([mine], device=self.device)
        if self.num_ranks > 1:
            what = "agreeing with every rank on whether the stages sent the declared p2p tensor shapes"
            self._wait(self._start(what, dist.all_reduce, word, op=dist.ReduceOp.MAX, group=self.group,
                                   async_op=True), what)
        worst = int(word.item())
        if not worst:
            self._checked_declaration = declared
            return
        rank, m = divmod(2 * self.num_ranks - worst, 2)
        lane, stage = stage_of(self.kind, self.num_ranks)[(rank, m)]
        where = f"stage {stage}" + (f" of lane {lane}" if len(self._lanes) > 1 else "") + \
            f" (modules[{m}] of pipeline rank {rank})"
        sent = f"sends {_describe(meta)}" if rank == self.rank else \
            f"sends other tensors (pipeline rank {rank}'s error says which)"
        shapes, dtype = declared
        wanted = " and ".join(
            ([f"shapes {[tuple(s) for s in shapes]}"] if shapes is not None else [])
            + ([f"dtype {str(dtype).removeprefix('torch.')}"] if dtype is not None else []))
        raise ValueError(f"{name}.step: {where} {sent}, not the {wanted} declared with set_p2p_tensor_shapes / "
                         f"set_p2p_tensor_dtype (one shape per tensor of a micro-batch); the step ran with what "
                         f"the stages sent. Declare what the stages send on every rank, or take the declaration "
                         f"back with set_p2p_tensor_shapes(None) and set_p2p_tensor_dtype(None)")

    def _split_check(self, tensors, per_lane: int, what: str) -> int:
        """Check that every tensor splits into ``per_lane`` non-empty micro-batches along batch_dim, all of one
        size; returns that size."""
        name = type(self).__name__
        sizes = set()
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}.step: {what} {i} is a {type(t).__name__}, not a tensor")
            size = t.shape[self._batch_dim_of(t, f"{what} {i}")]
            if size == 0 or size % per_lane:
                raise ValueError(
                    f"{name}.step: {what} {i} has shape {tuple(t.shape)}; its batch_dim "
                    f"{self.batch_dim} must be divisible into {per_lane} micro-batches"
                    + (" (DualPipe sends num_chunks/2 through each lane)" if self.kind == "dualpipe" else "")
                    + "; change num_chunks or the batch size")
            sizes.add(size)
        if len(sizes) > 1:
            raise ValueError(f"{name}.step: the {what}s have different sizes along batch_dim {self.batch_dim}: "
                             f"{sorted(sizes)}")
        return sizes.pop() if sizes else 0

    def _as_input(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(not self._forward_only and _differentiable(t.dtype))

    # ----------------------------------------------------------------------------------------
    def _run(self, op: Op) -> None:
        if op.kind == "W":
            if not self._forward_only:
                WeightGradStore.pop()
            return
        if op.kind != "FB" or not self.overlapped_forward_backward or self._forward_only:
            if op.forward is not None:
                self._forward(*op.forward)
            if op.backward is not None and not self._forward_only:
                self._backward(*op.backward, split=op.split)
            return
        fm, fc = op.forward
        bm, bc = op.backward
        criterion, labels = self._loss_fn(fm, fc)
        loss_b, outputs_b, grads_b = self._backward_inputs(bm, bc)
        outputs_f, loss_f = type(self.module[fm]).overlapped_forward_backward(
            self.module[fm], self._inputs[(fm, fc)], criterion, labels,
            self.module[bm], loss_b, outputs_b, grads_b)
        self._after_forward(fm, fc, outputs_f, loss_f)
        self._after_backward(bm, bc)

    def _loss_fn(self, m: int, c: int):
        if self._next[m] is None and self._criterion is not None:
            return self._criterion, list(self._labels[c]) if self._labels else []
        return None, []

    def _forward(self, m: int, c: int) -> None:
        inputs = self._inputs[(m, c)]
        if self._forward_only:
            del self._inputs[(m, c)]
        nxt = self._next[m]
        if self._forward_only or self.overlapped_forward_backward or nxt is None or nxt[0] == self.rank:
            outputs = self.module[m](*inputs)
        else:  # the outputs are sent, then freed where autograd did not save them
            if _outer_saved_tensor_hooks():
                with _saved_storages() as saved:
                    outputs = self.module[m](*inputs)
                freeable = _freeable(_as_list(outputs), inputs, saved) if saved is not None and None not in saved \
                    else []
            else:
                outputs = self.module[m](*inputs)
                freeable = _freeable(_as_list(outputs), inputs)
            self._freeable[(m, c)] = freeable
        criterion, labels = self._loss_fn(m, c)
        loss = criterion(*([outputs] if isinstance(outputs, torch.Tensor) else outputs), *labels) \
            if criterion is not None else None
        self._after_forward(m, c, outputs, loss)

    def _after_forward(self, m: int, c: int, outputs, loss) -> None:
        nxt = self._next[m]
        if nxt is not None and nxt[0] != self.rank:
            self._check_sent_outputs(m, c, outputs)
            if self._rejected is not None:
                return
        outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        if nxt is None:
            if loss is not None:
                self._losses[c] = loss
            if self._return_outputs:
                self._results[c] = [o.detach() for o in outputs]
            return
        self._out_meta[(m, c)] = [(o.shape, o.dtype) for o in outputs]
        if nxt[0] == self.rank:  # the V's turn: hand over without communication
            self._inputs[(nxt[1], c)] = [self._as_input(o) for o in outputs]
        if not self._forward_only or nxt[0] != self.rank:
            self._outputs[(m, c)] = outputs

    def _check_sent_outputs(self, m: int, c: int, outputs) -> None:
        """Raise a ValueError for outputs that cannot be sent, or that differ from what the receiver learned.
        While the stream's first header is still to be sent, the error waits for it: an abort header goes
        in its place, so that the receiver raises too instead of waiting for data."""
        name = type(self).__name__
        dst = self._next[m][0]
        if not isinstance(outputs, (torch.Tensor, tuple, list)):
            problem = f"it returned a {type(outputs).__name__}; return a tensor or a tuple/list of tensors"
        else:
            outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
            problem = _send_problem(outputs)
        learned = (self.rank, dst, m) in self._known_streams
        if problem is None and learned:
            meta = [(tuple(t.shape), t.dtype) for t in outputs]
            if meta != self._stream_meta[("out", dst, m)]:
                problem = (f"its outputs {meta} differ from {self._stream_meta[('out', dst, m)]}, learned "
                           f"earlier; call reset_shapes() on every rank first")
        if problem is None:
            return
        error = ValueError(f"{name} rank {self.rank}: stage {m}'s outputs for chunk {c} cannot be sent to pipeline "
                           f"rank {dst}: {problem}")
        if learned:
            raise error
        self._rejected = ((m, c), error)

    def _backward_inputs(self, m: int, c: int):
        """(loss, outputs, output grads) to run the backward of (m, c) from."""
        if self._next[m] is None:
            return self._losses[c], [], []
        outputs = self._outputs.pop((m, c))
        grads = iter(self._out_grads.pop((m, c)))
        pairs = [(o, next(grads)) for o in outputs if _differentiable(o.dtype)]
        pairs = [(o, g) for o, g in pairs if o.requires_grad]
        return None, [o for o, _ in pairs], [g for _, g in pairs]

    def _backward(self, m: int, c: int, split: bool) -> None:
        loss, outputs, grads = self._backward_inputs(m, c)
        WeightGradStore.enabled = split
        try:
            if loss is not None:
                loss.backward()
            elif outputs:
                run_backward(outputs, grads)
        finally:
            WeightGradStore.enabled = False
        if split:
            WeightGradStore.flush()
        self._after_backward(m, c)

    def _after_backward(self, m: int, c: int) -> None:
        if c in self._losses and self._next[m] is None:
            self._losses[c] = self._losses[c].detach()
        inputs = self._inputs.pop((m, c))
        prev = self._prev[m]
        if prev is None:
            return
        grads = [t.grad if t.grad is not None else torch.zeros_like(t)
                 for t in inputs if _differentiable(t.dtype)]
        if prev[0] == self.rank:
            self._out_grads[(prev[1], c)] = grads
        else:
            self._in_grads[(m, c)] = grads

    # ----------------------------------------------------------------------------------------
    def _exchange(self, batch: Batch) -> None:
        name = type(self).__name__
        device = self.device
        sent: list[tuple[int, int]] = []
        sends = []
        aborting = None  # (dst, src_module) of the stream whose first header is an abort header
        for sub in header_first(batch, self._known_streams):
            ops, headers, labels = [], [], []  # labels[i]: what ops[i] does, for errors
            for direction, msg, is_header in sub:
                what = f"{msg.kind}{' header' if is_header else ''} of chunk {msg.chunk}"
                if direction == "send":
                    peer = self._peer[msg.dst]
                    if msg.kind == "act" and self._rejected and self._rejected[0] == (msg.src_module, msg.chunk):
                        tensors = [_abort_header(device)]
                        aborting = (msg.dst, msg.src_module)
                    elif msg.kind == "act":
                        tensors = self._outputs[(msg.src_module, msg.chunk)]
                        if is_header:
                            self._stream_meta[("out", msg.dst, msg.src_module)] = [
                                (tuple(t.shape), t.dtype) for t in tensors]
                            tensors = [_encode_header(tensors, device)]
                        else:
                            sent.append((msg.src_module, msg.chunk))
                    else:
                        tensors = self._in_grads.pop((msg.src_module, msg.chunk))
                    ops += [dist.P2POp(dist.isend, t.contiguous(), peer, self.group) for t in tensors]
                    labels += [f"sending {what} to pipeline rank {msg.dst}"] * len(tensors)
                else:
                    peer = self._peer[msg.src]
                    if is_header:
                        buf = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
                        labels.append(f"receiving {what} from pipeline rank {msg.src}")
                        headers.append(((msg.src, msg.src_module), buf, labels[-1]))
                        ops.append(dist.P2POp(dist.irecv, buf, peer, self.group))
                        continue
                    if msg.kind == "act":
                        meta = self._stream_meta[("in", msg.src, msg.src_module)]
                        bufs = [torch.empty(s, dtype=d, device=device) for s, d in meta]
                        self._inputs[(msg.dst_module, msg.chunk)] = bufs
                    else:
                        meta = [(s, d) for s, d in self._out_meta[(msg.dst_module, msg.chunk)]
                                if _differentiable(d)]
                        bufs = [torch.empty(s, dtype=d, device=device) for s, d in meta]
                        self._out_grads[(msg.dst_module, msg.chunk)] = bufs
                    ops += [dist.P2POp(dist.irecv, b, peer, self.group) for b in bufs]
                    labels += [f"receiving {what} from pipeline rank {msg.src}"] * len(bufs)
            if ops:
                batch_what = "; ".join(sorted(set(labels)))
                works = self._start(batch_what, dist.batch_isend_irecv, ops)
                if len(works) != len(ops):  # NCCL coalesces a batch into one work: wait on it
                    for work in works:  # (on a GPU this only makes the current stream wait)
                        self._wait(work, batch_what)
                    works = []
                for op, work, label in zip(ops, works, labels):
                    if op.op is dist.irecv:
                        self._wait(work, label)
                    else:
                        sends.append((work, op.tensor, label))  # the tensor must live until sent
            aborted = []  # (label, src, src_module) of the streams whose first header is an abort header
            for (src, src_module), buf, label in headers:
                meta = _decode_header(buf)
                if meta is None:
                    aborted.append((label, src, src_module))
                    self._known_streams.discard((src, self.rank, src_module))  # to be learned again
                else:
                    self._stream_meta[("in", src, src_module)] = meta
            if aborting or aborted:  # stop after this sub-batch, which both ends post in full
                for work, _, label in sends:
                    self._wait(work, label)
                self._finish_sends()
            if aborting:
                self._known_streams.discard((self.rank, *aborting))
                raise self._rejected[1]
            if aborted:
                label, src, src_module = aborted[0]
                raise PipelineError(f"{name} rank {self.rank}: {label}: pipeline rank {src} rejected the outputs of "
                                    f"its stage {src_module} (see its error) and stopped the step", self.rank, label)
        for msg in batch.recvs:
            if msg.kind == "act" and not self._forward_only:
                for t in self._inputs[(msg.dst_module, msg.chunk)]:
                    t.requires_grad_(_differentiable(t.dtype))
        self._finish_sends()
        self._pending_sends = (sends, sent)

    def _finish_sends(self) -> None:
        """Wait for the previous batch's sends (the CPU does not block on sends when it posts
        them), then free the outputs they carried."""
        works, sent = self._pending_sends
        for work, _, label in works:
            self._wait(work, label)
        for key in sent:
            self._release_output(key)
        self._pending_sends = ([], [])

    def _release_output(self, key: tuple[int, int]) -> None:
        """Free the storage of sent outputs that `_freeable` found free to go at the forward; their autograd
        graph stays. (With the overlap hook nothing is freed: a hook may use torch.autograd.backward, which
        checks output shapes, and its forwards do not go through `_forward`.)"""
        if self._forward_only:
            del self._outputs[key]
            return
        for t, ok in zip(self._outputs[key], self._freeable.pop(key, [])):
            if ok:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)


class DualPipe(_Pipeline):
    """DualPipe (DeepSeek-V3 report, section 3.2.1): micro-batches enter at both ends of the
    pipeline at once, and a forward of one direction runs with a backward of the other.

    Every rank holds two modules: modules[0] is stage `rank` of the direction that starts on rank
    0, modules[1] is stage `rank` of the direction that starts on the last rank, so rank r's
    modules[1] is a copy of rank (ranks-1-r)'s modules[0]. Give the pair the same weights and call
    `sum_stage_copies(pipe)` after `step` to add their gradients.

    modules: (module0, module1). If their type defines the classmethod or staticmethod
      `overlapped_forward_backward(m0, inputs0, criterion0, labels0, m1, loss1, outputs1,
      output_grads1) -> (outputs0, loss0)`, F&B steps call it to overlap the forward of m0 with the
      backward of m1 (from loss1 on the last stage, else from outputs1 with output_grads1);
      otherwise they run the forward, then the backward.
    batch_dim: dimension along which inputs and labels are split into micro-batches (negative: from
      the end of each tensor).
    process_group: the pipeline's ranks (default: the world); needs an even size.
    rank_mapping: rank_mapping[i] is the pipeline rank of process-group rank i (default identity).
    timeout_s: (keyword only) the longest wait for a peer's message or collective where the host
      waits (gloo), in seconds; None: the process group's timeout. A failed or timed-out wait
      raises `PipelineError` / `PipelineTimeoutError` naming the rank and what it waited for. On
      NCCL the host does not wait for messages (the GPU does): a peer that never sends is ended
      by NCCL's watchdog after the process group's timeout, so set that one
      (`init_process_group(timeout=...)`, `new_group(timeout=...)`).
    op_hook: (keyword only) called as op_hook(op, "start") before and op_hook(op, "end") after each
      compute op (for timing); the `op_hook` attribute may also be set or cleared between steps.

    Stage outputs must be a tensor or a tuple/list of tensors; what a rank sends is learned on the
    first step (see `reset_shapes`). Works with any backend that has p2p (NCCL, gloo).
    """

    kind = "dualpipe"


class DualPipeV(_Pipeline):
    """DualPipeV: DualPipe cut in half ("V" schedule). With R ranks the model has 2R stages; rank r
    holds modules[0] = stage r and modules[1] = stage 2R-1-r, so the first rank runs both the first
    and the last stage (inputs, labels, criterion and the loss are all on rank 0).

    Arguments as for `DualPipe`; any number of ranks, num_chunks >= 2*ranks.
    """

    kind = "dualpipev"


def sum_stage_copies(pipe: _Pipeline) -> None:
    """Add up the gradients of the two copies of each DualPipe stage (rank r's modules[0] and rank
    (ranks-1-r)'s modules[1]) so that both copies hold the full gradient and stay equal after an
    optimizer step. A parameter whose copies both have no gradient (``.grad`` None) keeps none, as it
    would without a pipeline; one copy's None counts as zeros. Two p2p exchanges with the mirror rank.
    DualPipeV holds one copy of each stage: nothing to do."""
    if not isinstance(pipe, DualPipe):
        return
    partner = pipe.num_ranks - 1 - pipe.rank
    order = (0, 1) if pipe.rank < partner else (1, 0)
    params = [p for m in order for p in pipe.module[m].parameters() if p.requires_grad]
    mine = torch.tensor([len(params), sum(p.numel() for p in params)], device=pipe.device)
    theirs = torch.empty_like(mine)
    peer = pipe._peer[partner]
    what = f"sum_stage_copies: exchanging parameter counts with mirror rank {partner}"
    for work in pipe._start(what, dist.batch_isend_irecv, [dist.P2POp(dist.isend, mine, peer, pipe.group),
                                                          dist.P2POp(dist.irecv, theirs, peer, pipe.group)]):
        pipe._wait(work, what)
    if not torch.equal(mine, theirs):
        raise ValueError(f"sum_stage_copies: rank {pipe.rank} holds {mine.tolist()} (parameters, "
                         f"elements) but its mirror rank {partner} holds {theirs.tolist()}; the two "
                         f"copies of a stage must have the same parameters")
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int64, device=pipe.device)
    has_theirs = torch.empty_like(has)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    received = [torch.empty_like(g) for g in grads]
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer, pipe.group) for t in (has, *grads)]
    ops += [dist.P2POp(dist.irecv, r, peer, pipe.group) for r in (has_theirs, *received)]
    what = f"sum_stage_copies: exchanging gradients with mirror rank {partner}"
    for work in pipe._start(what, dist.batch_isend_irecv, ops):
        pipe._wait(work, what)
    for p, g, r, mine_has, theirs_has in zip(params, grads, received, has.tolist(), has_theirs.tolist()):
        p.grad = g + r if mine_has or theirs_has else None
