"""Forward of one micro-batch interleaved with the backward of another, DeepSeek-V3 style.

A module's forward is a list of *pieces*, each either compute (attention, experts) or communication
(dispatch, combine). `Tape` runs the pieces of one micro-batch, cutting the autograd graph between them
(each piece's tensor inputs become fresh leaves), so that its backward can later be run piece by piece.
`overlapped_forward_backward` walks micro-batch A's forward pieces and micro-batch B's backward pieces
(last piece first) side by side and issues a compute piece of one with a communication piece of the other:

    compute stream:  attn F(A)     | mlp B(B)      | mlp F(A) + W  | attn B(B)  + W ...
    comm stream:     combine B(B)  | dispatch F(A) | dispatch B(B) | combine F(A)   ...

(the backward of a combine is a dispatch of gradients and vice versa). Weight gradients of B's compute
pieces go through `WeightGradStore` and run in the next compute slot, so B's next communication piece,
which needs only input gradients, starts earlier. On a GPU, communication pieces run on the SM budget's
comm stream and compute pieces on its compute stream; each micro-batch's pieces are ordered by CUDA events,
so only true dependencies wait. On a CPU everything runs in order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from smsplit import intervals
from smsplit.pipeline.weight_grad import WeightGradStore

COMPUTE, COMM = "compute", "comm"


@dataclass
class Interval:
    kind: str
    name: str
    start: object  # torch.cuda.Event or perf_counter seconds
    end: object


class PieceRunner:
    """Where and how pieces run.

    Args:
        comm_stream, compute_stream: CUDA streams (e.g. ``SmBudget.comm_stream`` / ``.compute_stream``);
            None runs pieces on the current stream (CPU, or a GPU without a budget).
        record: keep the start and end of every piece (CUDA events, or host clocks on CPU) in ``intervals``.
        trace: an `smsplit.trace.Trace`; each piece becomes a span of its stream (GPU only).
    """

    def __init__(self, comm_stream=None, compute_stream=None, record: bool = False, trace=None):
        self.streams = {COMM: comm_stream, COMPUTE: compute_stream}
        self.record, self.trace = record, trace
        self.intervals: list[Interval] = []

    def run(self, kind: str, name: str, chain, fn: Callable, tensors=(), waits=()):
        """Run ``fn()`` as piece ``name`` of micro-batch ``chain`` (anything with an ``event`` attribute)
        after that micro-batch's previous piece and after every CUDA event of ``waits`` (None entries are
        skipped). ``tensors``: tensors made elsewhere that ``fn`` reads.

        The recorded interval starts when the piece's stream has passed all these waits, so time a
        stream spends waiting for another piece is not counted as this piece's (see `exposed_comm`).
        Waits that ``fn`` itself issues fall inside the interval: pass them as ``waits`` instead.

        An exception out of ``fn`` gets the note ``piece 'name'`` (`piece_of` reads it back): a peer's timeout
        in a dispatch then says which layer, and whether forward or backward, it was in."""
        try:
            return self._run(kind, name, chain, fn, tensors, waits)
        except Exception as error:
            if piece_of(error) is None:  # (the innermost piece names it)
                error.add_note(f"{_PIECE_NOTE}{name!r}")
            raise

    def _run(self, kind: str, name: str, chain, fn: Callable, tensors, waits):
        stream = self.streams[kind]
        if stream is None:
            start = time.perf_counter()
            result = fn()
            if self.record:
                self.intervals.append(Interval(kind, name, start, time.perf_counter()))
            return result
        with torch.cuda.stream(stream):
            for event in (*waits, chain.event):
                if event is not None:
                    stream.wait_event(event)
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(stream)
            # Recorded after every wait: the stream reaches this event only once the waits are satisfied,
            # so the interval holds the piece's own kernels, not the time its stream sat blocked.
            start = _event() if self.record else None
            if self.trace is not None:
                with self.trace.span(stream, name, kind=kind):
                    result = fn()
            else:
                result = fn()
            chain.event = _event()
            if self.record:
                self.intervals.append(Interval(kind, name, start, chain.event))
        return result

    @property
    def on_streams(self) -> bool:
        return any(s is not None for s in self.streams.values())

    def sync_in(self, chain) -> None:
        """The next piece of ``chain`` waits for the work queued so far on the current stream."""
        if self.on_streams:
            chain.event = torch.cuda.current_stream().record_event()

    def sync_out(self, chain, tensors=()) -> None:
        """The current stream waits for ``chain``'s pieces; ``tensors`` made there are used here."""
        if self.on_streams and chain.event is not None:
            current = torch.cuda.current_stream()
            current.wait_event(chain.event)
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(current)

    def exposed_comm(self) -> dict:
        """Times of the recorded pieces (synchronizes): ``step_s`` from the first start to the last end,
        ``comm_s`` / ``compute_s`` the time covered by each kind's intervals, ``exposed_comm_s`` the time in
        which communication ran and no compute did, and ``exposed_fraction`` = exposed / step.

        A piece's interval starts once its stream has passed the waits `run` issued for it, so compute
        counts only from when a compute piece could execute, not while its stream waited for (say) a
        communication piece; see `piece_times` for the arithmetic."""
        first = self.intervals[0].start if self.intervals else None
        if isinstance(first, torch.cuda.Event):
            torch.cuda.synchronize()
            spans = [(iv.kind, first.elapsed_time(iv.start) / 1e3, first.elapsed_time(iv.end) / 1e3)
                     for iv in self.intervals]
        else:
            spans = [(iv.kind, iv.start - first, iv.end - first) for iv in self.intervals]
        return piece_times(spans)


def piece_times(spans) -> dict:
    """`PieceRunner.exposed_comm` of pieces given as ``(kind, start_s, end_s)``: ``step_s`` (first start to
    last end), ``comm_s`` and ``compute_s`` (time covered by each kind, overlaps counted once),
    ``exposed_comm_s`` (communication running while no compute runs) and ``exposed_fraction``."""
    spans = list(spans)
    if not spans:
        return dict(step_s=0.0, comm_s=0.0, compute_s=0.0, exposed_comm_s=0.0, exposed_fraction=0.0)
    for kind, start, end in spans:
        if end < start:
            raise ValueError(f"a {kind} piece ends ({end}) before it starts ({start})")
    step = max(e for _, _, e in spans) - min(s for _, s, _ in spans)
    comm = [(s, e) for k, s, e in spans if k == COMM]
    compute = [(s, e) for k, s, e in spans if k == COMPUTE]
    exposed = intervals.alone(comm, compute)
    return dict(step_s=step, comm_s=intervals.measure(comm), compute_s=intervals.measure(compute),
                exposed_comm_s=exposed, exposed_fraction=exposed / step if step > 0 else 0.0)


_PIECE_NOTE = "piece "


def piece_of(error: BaseException) -> str | None:
    """The note ``piece 'name'`` that `PieceRunner.run` added to ``error``, or None."""
    return next((n for n in getattr(error, "__notes__", ()) if n.startswith(_PIECE_NOTE)), None)


def _event():
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


INLINE = PieceRunner()


def _tensors(values):
    return [v for v in values if isinstance(v, torch.Tensor)]


@dataclass
class Piece:
    kind: str
    name: str
    leaves: list  # (source tensor, leaf cut from it)
    outputs: list  # outputs that require grad


@dataclass
class Tape:
    """The forward of one micro-batch through one module, kept piece by piece for its backward.

    ``grads`` maps ``id(tensor)`` of a piece output (or a module input) to its gradient so far."""

    inputs: tuple = ()
    pieces: list = field(default_factory=list)
    grads: dict = field(default_factory=dict)
    event: object = None
    finished: bool = False
    output: object = None
    intercept: bool = False

    def forward_piece(self, runner: PieceRunner, kind: str, name: str, fn: Callable, state: tuple) -> tuple:
        """Run ``fn(*state)`` with each tensor of ``state`` that requires grad replaced by a fresh leaf;
        returns its outputs (a tuple)."""
        leaves, cut = [], []
        for value in state:
            if isinstance(value, torch.Tensor) and value.requires_grad:
                leaf = value.detach().requires_grad_()
                leaves.append((value, leaf))
                value = leaf
            cut.append(value)

        def call():
            out = fn(*cut)
            return out if isinstance(out, tuple) else (out,)

        out = runner.run(kind, name, self, call, _tensors(state))
        self.pieces.append(Piece(kind, name, leaves, [t for t in _tensors(out) if t.requires_grad]))
        return out

    def add_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        key = id(tensor)
        self.grads[key] = grad if key not in self.grads else self.grads[key] + grad

    def next_backward_kind(self) -> str | None:
        return self.pieces[-1].kind if self.pieces else None

    def backward_piece(self, runner: PieceRunner) -> None:
        """Backward of the last piece not yet run backward."""
        piece = self.pieces.pop()
        pairs = [(o, self.grads.pop(id(o))) for o in piece.outputs if id(o) in self.grads]

        def call():
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            for source, leaf in piece.leaves:
                if leaf.grad is not None:
                    self.add_grad(source, leaf.grad)

        runner.run(piece.kind, f"{piece.name} (backward)", self, call, [g for _, g in pairs])

    def backward_all(self, runner: PieceRunner) -> list:
        """Run the remaining pieces backward; returns the gradients of ``inputs`` (None where none)."""
        runner.sync_in(self)
        while self.pieces:
            self.backward_piece(runner)
        grads = self.finish()
        runner.sync_out(self, grads)
        return grads

    def finish(self) -> list:
        self.finished = True
        grads = [self.grads.pop(id(x), None) if isinstance(x, torch.Tensor) else None for x in self.inputs]
        self.grads.clear()
        return grads


class _TapeEnd(torch.autograd.Function):
    """Joins a taped forward back to autograd: a plain ``backward()`` through the module's output runs the
    tape backward piece by piece. ``output.grad_fn.tape`` is how the overlapped path finds the tape."""

    @staticmethod
    def forward(ctx, tape, runner, anchor, *inputs):
        ctx.tape, ctx.runner = tape, runner
        return tape.output.detach()

    @staticmethod
    def backward(ctx, grad_output):
        tape = ctx.tape
        if tape.intercept:  # overlapped_forward_backward wants only the gradient of the output
            tape.intercept = False
            tape.add_grad(tape.output, grad_output)
            return (None, None, None, *[None] * len(tape.inputs))
        if tape.finished:
            raise RuntimeError("this micro-batch's backward already ran (overlapped_forward_backward)")
        tape.add_grad(tape.output, grad_output)
        return (None, None, None, *tape.backward_all(ctx.runner))


def run_taped(pieces: list, inputs: tuple, runner: PieceRunner = INLINE) -> torch.Tensor:
    """Forward ``inputs`` through ``pieces`` (``[(kind, name, fn)]``, each ``fn(*state) -> state``, the last
    returning one tensor) on a new tape; returns the output, differentiable back to ``inputs``."""
    tape = Tape(inputs=tuple(inputs))
    state = tuple(inputs)
    runner.sync_in(tape)
    for kind, name, fn in pieces:
        state = tape.forward_piece(runner, kind, name, fn, state)
    (output,) = state
    runner.sync_out(tape, [output])
    tape.output = output
    if not output.requires_grad:
        return output
    return _join(tape, runner, inputs)


def _join(tape: Tape, runner: PieceRunner, inputs: tuple) -> torch.Tensor:
    # The anchor (an empty leaf) makes the result differentiable when no input is (token ids). The last
    # piece's output is not an input of _TapeEnd: autograd would run its graph again after the tape did.
    anchor = torch.empty(0, requires_grad=True)
    return _TapeEnd.apply(tape, runner, anchor, *inputs)


def tape_of(tensor: torch.Tensor) -> Tape:
    """The tape of the taped forward that ``tensor`` (a module output, or a loss computed from one) comes from."""
    seen, todo = set(), [tensor.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        if hasattr(fn, "tape"):
            return fn.tape
        seen.add(fn)
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    raise ValueError("this tensor was not made by a taped forward (run_taped): cannot overlap its backward")


def _deliver(tape: Tape, runner: PieceRunner) -> None:
    """Hand the gradients of a tape's inputs to autograd (leaf inputs get ``.grad``; others continue)."""
    grads = tape.finish()
    runner.sync_out(tape, grads)
    pairs = [(x, g) for x, g in zip(tape.inputs, grads) if g is not None and x.requires_grad]
    if pairs:
        torch.autograd.backward([x for x, _ in pairs], [g for _, g in pairs])


def interleave(runner: PieceRunner, f_pieces: list, f_inputs: tuple, b_tape: Tape | None) -> tuple[Tape, tuple]:
    """Forward of ``f_pieces`` on ``f_inputs`` on a new tape, interleaved with the rest of ``b_tape``'s
    backward (its seed gradients already added). Returns the new tape and its final state."""
    f_tape = Tape(inputs=tuple(f_inputs))
    state = tuple(f_inputs)
    runner.sync_in(f_tape)
    if b_tape is not None:
        runner.sync_in(b_tape)
    queue = list(f_pieces)
    own_store = not WeightGradStore.enabled  # else the caller defers W to its own "W" op
    # Deferred weight gradients of B: (closures, the B event they follow). They run on the compute stream
    # after that event without holding up B's chain, so B's next communication does not wait for them.
    pending_w: list[tuple[list[Callable], object]] = []
    w_chain = Tape()

    def run_forward():
        nonlocal state
        kind, name, fn = queue.pop(0)
        state = f_tape.forward_piece(runner, kind, name, fn, state)

    def run_backward():
        if not own_store:
            b_tape.backward_piece(runner)
            return
        saved = WeightGradStore.cache
        WeightGradStore.enabled, WeightGradStore.cache = True, []
        try:
            b_tape.backward_piece(runner)
            if WeightGradStore.cache:
                pending_w.append((WeightGradStore.cache, b_tape.event))
        finally:
            WeightGradStore.enabled, WeightGradStore.cache = False, saved

    def run_w(items):
        for fns, after in items:
            runner.run(COMPUTE, "W", w_chain, lambda fns=fns: _run_closures(fns), waits=(after,))

    def run_pending_w():
        items = pending_w.copy()
        pending_w.clear()
        run_w(items)

    while queue or (b_tape is not None and b_tape.pieces):
        f_kind = queue[0][0] if queue else None
        b_kind = b_tape.next_backward_kind() if b_tape is not None else None
        if f_kind == COMPUTE and b_kind == COMM:
            run_forward()
            run_pending_w()
            run_backward()
        elif f_kind == COMM and b_kind == COMPUTE:
            w_before = pending_w.copy()
            pending_w.clear()
            run_backward()  # its W waits for the next compute slot; older W fill this one
            run_w(w_before)
            run_forward()
        else:  # same kind (or one side done): run them one after the other
            if f_kind is not None:
                run_forward()
            if b_kind is not None:
                run_backward()
    if b_tape is not None:
        run_pending_w()
        runner.sync_out(w_chain)
    runner.sync_out(f_tape, state)
    return f_tape, state


def _run_closures(fns: list[Callable]) -> None:
    with torch.no_grad():  # as WeightGradStore.pop
        for fn in fns:
            fn()


def overlapped_forward_backward(module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1,
                                runner: PieceRunner | None = None):
    """DualPipe's overlap hook: forward ``module0`` on ``inputs0`` (and ``criterion0(outputs0, *labels0)``
    if given) while running the backward of ``module1``'s earlier forward, from ``loss1`` if given, else
    from ``outputs1`` with gradients ``output_grads1``. Returns ``(outputs0, loss0)``.

    Both modules must provide ``pieces()`` (``[(kind, name, fn)]``) and must have made ``outputs1`` with a
    taped forward; gradients equal those of ``module0(*inputs0)`` followed by a plain backward of module1.
    """
    runner = runner or getattr(module0, "runner", None) or INLINE
    b_tape = None
    if loss1 is not None:
        b_tape = _backward_to_tape([loss1], None)
        loss1.detach_()
    elif outputs1 is not None:
        outputs1 = [outputs1] if isinstance(outputs1, torch.Tensor) else list(outputs1)
        grads = list(output_grads1) if isinstance(output_grads1, (list, tuple)) else [output_grads1]
        if outputs1:
            b_tape = _backward_to_tape(outputs1, grads)
    inputs0 = (inputs0,) if isinstance(inputs0, torch.Tensor) else tuple(inputs0)
    f_tape, (output0,) = interleave(runner, module0.pieces(), inputs0, b_tape)
    if b_tape is not None:
        _deliver(b_tape, runner)
    f_tape.output = output0
    if output0.requires_grad:
        output0 = _join(f_tape, runner, inputs0)
    loss0 = None
    if criterion0 is not None:
        labels0 = [labels0] if isinstance(labels0, torch.Tensor) else list(labels0 or [])
        loss0 = criterion0(output0, *labels0)
    return (output0,), loss0


def _backward_to_tape(tensors: list, grads) -> Tape:
    """Backward from ``tensors`` (with ``grads``) down to the output of the taped forward they come from, through
    whatever the module or the loss did to that output; the gradient stays on the tape, whose pieces' backward is
    left to the caller. Returns the tape."""
    tape = tape_of(tensors[0])
    tape.intercept = True
    try:
        torch.autograd.backward(tensors, grads)
    finally:
        tape.intercept = False
    return tape


def serial_forward_backward(module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1,
                            runner: PieceRunner | None = None):
    """The same work as `overlapped_forward_backward` without interleaving: all of module0's forward, then
    all of module1's backward (the baseline the overlap is measured against)."""
    runner = runner or getattr(module0, "runner", None) or INLINE
    inputs0 = (inputs0,) if isinstance(inputs0, torch.Tensor) else tuple(inputs0)
    output0 = run_taped(module0.pieces(), inputs0, runner)
    loss0 = None
    if criterion0 is not None:
        labels0 = [labels0] if isinstance(labels0, torch.Tensor) else list(labels0 or [])
        loss0 = criterion0(output0, *labels0)
    if loss1 is not None:
        loss1.backward()
        loss1.detach_()
    elif outputs1 is not None:
        outputs1 = [outputs1] if isinstance(outputs1, torch.Tensor) else list(outputs1)
        grads = list(output_grads1) if isinstance(output_grads1, (list, tuple)) else [output_grads1]
        torch.autograd.backward(outputs1, grads)
    return (output0,), loss0
