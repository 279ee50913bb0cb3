"""DualPipe / DualPipeV with DeepSeek's call shapes and DeepSeek's custom-autograd pattern, on CPU with gloo.

DeepSeek's DualPipe examples define their linear layer as an autograd Function that writes ``weight.grad``
itself from what it saved (``ctx.saved_tensors``), deferring that work through ``WeightGradStore`` in
split backwards. Such a Function only works if ``ctx.saved_tensors`` gives back the very parameter it saved,
whatever the pipeline does to free memory. These tests run stages built that way (their own classes, stages
of different widths, with and without the overlapped forward/backward hook) through DualPipe and DualPipeV on
2 and 4 ranks and compare losses, outputs and every parameter's gradient with one process running the same
stages micro-batch by micro-batch; a gradient that is None fails. A second part runs the flow of DeepSeek's
examples, written out below with only the imports pointing at smsplit.pipeline (and CPU/gloo for CUDA/NCCL).

One torch.multiprocessing job per world size (2, 4) runs every scenario of that size and records, per rank,
what it measured; the tests assert on those records. Every wait is bounded by the gloo timeout (60 s).
"""

from __future__ import annotations

import json
import os
import queue
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ep_harness import spawn  # (torch.multiprocessing.spawn from a fork server: ep_harness.py)
from pipeline_harness import TIMEOUT, Scenarios, count_freed, expect_error, stage_ids
from smsplit.launch import free_port
from smsplit.pipeline import (
    DualPipe,
    DualPipeV,
    WeightGradStore,
    run_backward,
    schedule,
    set_p2p_tensor_dtype,
    set_p2p_tensor_shapes,
    sum_stage_copies,
)

WIDTHS = (5, 7, 3, 6, 4, 8, 2, 6, 5)  # stage s maps WIDTHS[s] features to WIDTHS[s + 1]
ROWS = 2  # rows per micro-batch


# ----------------------------------------------------------------------------------------------
# stages in DeepSeek's style: an autograd Function that sets .grad on the weight it saved


class SelfAccumulatingMatmul(torch.autograd.Function):
    """y = x @ weight.T. The backward returns the input gradient and adds the weight gradient to
    ``weight.grad`` itself, through the ``weight`` it gets back from ctx.saved_tensors; in a split backward
    (WeightGradStore.enabled) that addition is queued for the schedule's W step."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.mT

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)

        def add_weight_grad():
            weight.grad.add_(grad_y.reshape(-1, grad_y.shape[-1]).mT @ x.reshape(-1, x.shape[-1]))

        if WeightGradStore.enabled:
            WeightGradStore.put(add_weight_grad)
        else:
            add_weight_grad()
        return grad_y @ weight, None


class SelfAccumulatingLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in, dtype=torch.float64) / d_in ** 0.5)

    def forward(self, x):
        return SelfAccumulatingMatmul.apply(x, self.weight)


class WidthStage(nn.Module):
    """d_in -> 2 d_in -> d_out; its output is the custom Function's, which autograd does not save."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.up = SelfAccumulatingLinear(d_in, 2 * d_in)
        self.down = SelfAccumulatingLinear(2 * d_in, d_out)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class HookedWidthStage(WidthStage):
    """The same stage with the overlapped forward/backward hook (forward first, then the backward)."""

    calls = 0

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                                    output_grads1):
        cls.calls += 1
        outputs0 = module0(*inputs0)
        outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else outputs0
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
            loss1.detach_()
        else:
            run_backward(outputs1, output_grads1)
        return outputs0, loss0


class UnusedParameterStage(WidthStage):
    """A stage with a parameter its forward never uses: no copy of it gets a gradient."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.unused = nn.Parameter(torch.zeros(3, dtype=torch.float64))


def mse(y, target):
    return ((y - target) ** 2).mean()


def make_stages(kind: str, world: int, cls):
    n = world if kind == "dualpipe" else 2 * world
    torch.manual_seed(5)
    return [cls(WIDTHS[s], WIDTHS[s + 1]) for s in range(n)]


def make_lanes(kind: str, world: int, chunks: int, seed: int):
    """Per lane: (inputs, labels) of chunks-per-lane micro-batches of ROWS rows."""
    n_stages = world if kind == "dualpipe" else 2 * world
    g = torch.Generator().manual_seed(seed)
    lanes, per_lane = (2, chunks // 2) if kind == "dualpipe" else (1, chunks)
    return [(torch.randn(per_lane * ROWS, WIDTHS[0], generator=g, dtype=torch.float64),
             torch.randn(per_lane * ROWS, WIDTHS[n_stages], generator=g, dtype=torch.float64))
            for _ in range(lanes)]


def reference(stages, lanes):
    """Per lane: (losses, outputs) of one process running the stages micro-batch by micro-batch; every
    micro-batch's loss.backward() accumulates into the stages' .grad."""
    out = []
    for x, y in lanes:
        losses, outputs = [], []
        for xc, yc in zip(x.split(ROWS), y.split(ROWS)):
            h = xc
            for stage in stages:
                h = stage(h)
            loss = mse(h, yc)
            loss.backward()
            losses.append(loss.detach())
            outputs.append(h.detach())
        out.append((torch.stack(losses), torch.cat(outputs)))
    return out


def lane_args(kind: str, world: int, rank: int, lanes):
    """(inputs, labels, lane whose loss this rank returns or None): DualPipeV feeds and ends on rank 0;
    DualPipe feeds lane 0 on rank 0 and lane 1 on the last rank, each ending where the other starts."""
    if kind == "dualpipev":
        return ((lanes[0][0],), lanes[0][1], 0) if rank == 0 else ((), None, None)
    if rank == 0:
        return (lanes[0][0],), (lanes[1][1],), 1
    if rank == world - 1:
        return (lanes[1][0],), (lanes[0][1],), 0
    return (), (), None


def train_against_reference(rank, world, kind, cls, steps=2):
    """Train `steps` steps (return_outputs=True) and compare losses, outputs and gradients with the reference.
    Records the parameters whose .grad is None (before DualPipe's copies are summed, so that a lost gradient
    cannot hide behind its other copy), the worst errors, and the sent outputs freed and kept."""
    chunks = 2 * world + 2
    stages = make_stages(kind, world, cls)
    s0, s1 = stage_ids(kind, world, rank)
    mods = [cls(WIDTHS[s], WIDTHS[s + 1]) for s in (s0, s1)]
    for m, s in zip(mods, (s0, s1)):
        m.load_state_dict(stages[s].state_dict())
    pipe = (DualPipe if kind == "dualpipe" else DualPipeV)(nn.Sequential(*mods), timeout_s=60)
    freed = count_freed(pipe)
    HookedWidthStage.calls = 0
    rec = {"none": [], "loss_err": 0.0, "out_err": 0.0, "grad_relerr": 0.0, "losses": 0, "outputs_require_grad": False}
    for step in range(steps):
        lanes = make_lanes(kind, world, chunks, seed=step)
        for m in (*stages, pipe):
            m.zero_grad(set_to_none=True)
        ref = reference(stages, lanes)
        inputs, labels, lane = lane_args(kind, world, rank, lanes)
        loss, outputs = pipe.step(*inputs, num_chunks=chunks, criterion=mse, labels=labels, return_outputs=True)
        rec["none"] += [f"stage {s}: {n}" for m, s in zip(mods, (s0, s1)) for n, p in m.named_parameters()
                        if p.grad is None]
        sum_stage_copies(pipe)
        if lane is None:
            assert loss is None and outputs is None
        else:
            rec["loss_err"] = max(rec["loss_err"], float((loss - ref[lane][0]).abs().max()))
            rec["out_err"] = max(rec["out_err"], float((outputs - ref[lane][1]).abs().max()))
            rec["outputs_require_grad"] |= outputs.requires_grad
            rec["losses"] += len(loss)
        for m, s in zip(mods, (s0, s1)):
            for p, q in zip(m.parameters(), stages[s].parameters()):
                if p.grad is not None:
                    rec["grad_relerr"] = max(rec["grad_relerr"], float((p.grad - q.grad).norm() / q.grad.norm()))
    expected_hook_calls = 0
    if cls is HookedWidthStage:
        expected_hook_calls = steps * sum(op.kind == "FB" for op in schedule(kind, world, chunks)[rank])
    return dict(rec, **freed, hook_calls=HookedWidthStage.calls, expected_hook_calls=expected_hook_calls)


def unused_parameter(rank, world):
    """DualPipe: a parameter no copy uses keeps .grad None through sum_stage_copies, as in one process;
    the others get the reference gradient."""
    stages = make_stages("dualpipe", world, UnusedParameterStage)
    s0, s1 = stage_ids("dualpipe", world, rank)
    mods = [UnusedParameterStage(WIDTHS[s], WIDTHS[s + 1]) for s in (s0, s1)]
    for m, s in zip(mods, (s0, s1)):
        m.load_state_dict(stages[s].state_dict())
    pipe = DualPipe(nn.Sequential(*mods))
    lanes = make_lanes("dualpipe", world, 2 * world, seed=3)
    reference(stages, lanes)
    inputs, labels, _ = lane_args("dualpipe", world, rank, lanes)
    pipe.step(*inputs, num_chunks=2 * world, criterion=mse, labels=labels)
    sum_stage_copies(pipe)
    rec = {"unused_none": [m.unused.grad is None for m in mods], "ref_unused_none": stages[s0].unused.grad is None,
           "grad_relerr": 0.0}
    for m, s in zip(mods, (s0, s1)):
        for (name, p), q in zip(m.named_parameters(), stages[s].parameters()):
            if name != "unused":
                rec["grad_relerr"] = max(rec["grad_relerr"], float((p.grad - q.grad).norm() / q.grad.norm()))
    return rec


def declared_shapes(rank, world, kind, how):
    """A DualPipeV/DualPipe step under a declaration of p2p shapes and dtype: "right" (what the stages send:
    WIDTHS differ per stage, so only a dtype), "shapes" (stage 0's shape for every stream), "dtype"
    (float32), "ranks-differ" (rank 1 declares, the others do not). Then the declaration is taken back and the
    same pipeline runs a step."""
    stages = make_stages(kind, world, WidthStage)
    s0, s1 = stage_ids(kind, world, rank)
    pipe = (DualPipe if kind == "dualpipe" else DualPipeV)((stages[s0], stages[s1]), timeout_s=60)
    chunks = 2 * world
    inputs, labels, lane = lane_args(kind, world, rank, make_lanes(kind, world, chunks, seed=1))
    if how == "right":
        set_p2p_tensor_dtype(torch.float64)
    elif how == "shapes":
        set_p2p_tensor_shapes([(ROWS, WIDTHS[1])])
        set_p2p_tensor_dtype(torch.float64)
    elif how == "dtype":
        set_p2p_tensor_dtype(torch.float32)
    elif how == "ranks-differ" and rank == 1:
        set_p2p_tensor_shapes([(ROWS, WIDTHS[1])])
    ops = []
    pipe.op_hook = lambda op, when: ops.append(op)
    rec = expect_error(lambda: pipe.step(*inputs, num_chunks=chunks, criterion=mse, labels=labels))
    rec["ops"] = len(ops)
    set_p2p_tensor_shapes(None)
    set_p2p_tensor_dtype(None)
    loss, _ = pipe.step(*inputs, num_chunks=chunks, criterion=mse, labels=labels)
    rec["after"] = None if loss is None else len(loss)
    rec["expected_after"] = None if lane is None else (chunks // 2 if kind == "dualpipe" else chunks)
    return rec


# ----------------------------------------------------------------------------------------------
# DeepSeek's example flow (examples/example_dualpipe.py, examples/example_dualpipev.py of
# deepseek-ai/DualPipe), written out as a user adapting it to CPU/gloo would: the same stage class, reference
# step, checks and calls; the imports at the top of this file stand for
#     from dualpipe import DualPipe, DualPipeV, set_p2p_tensor_shapes, set_p2p_tensor_dtype
#     from dualpipe.utils import WeightGradStore, run_backward
# and the process group is gloo on the CPU (the worker starts it) instead of NCCL on a GPU per rank. Sizes are
# small to keep the test short.


class ExampleLinearFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight):
        ctx.save_for_backward(input, weight)
        return F.linear(input, weight)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)

        def grad_weight_fn():
            weight.grad += grad_output.flatten(0, -2).T @ input.flatten(0, -2)

        if WeightGradStore.enabled:
            WeightGradStore.put(grad_weight_fn)
        else:
            grad_weight_fn()
        return grad_output @ weight, None


class ExampleLinear(nn.Linear):
    def forward(self, input):
        return ExampleLinearFunc.apply(input, self.weight)


class ExampleStage(nn.Module):
    """The examples' stage without the overlap hook (forward, then backward, in F&B steps)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear1 = ExampleLinear(hidden_size, hidden_size * 4, bias=False)
        self.linear2 = ExampleLinear(hidden_size * 4, hidden_size, bias=False)

    def forward(self, x):
        return self.linear2(F.gelu(self.linear1(x)))


class ExampleStageWithHook(ExampleStage):
    """The examples' stage as published: with the overlapped forward/backward hook."""

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                                    output_grads1):
        outputs0 = module0(*inputs0)
        outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else outputs0
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
            loss1.detach_()
        else:
            run_backward(outputs1, output_grads1)
        return outputs0, loss0


def example_criterion(output, target):
    return F.mse_loss(output, target).clone()


def example_ref_step(x, l, model, chunks):
    ys, losses = [], []
    model.zero_grad()
    for micro_x, micro_l in zip(x.chunk(chunks), l.chunk(chunks)):
        micro_y = model(micro_x)
        loss = example_criterion(micro_y, micro_l)
        loss.backward()
        ys.append(micro_y.detach())
        losses.append(loss.detach())
    return torch.stack(losses), torch.cat(ys, 0)


def cal_diff(x, y) -> float:
    x, y = x.double(), y.double()
    return 1 - 2 * (x * y).sum().item() / (x * x + y * y).sum().item()


def example_dualpipe(rank, pp_size, PipelineStage):
    is_first_rank = rank == 0
    is_last_rank = rank == pp_size - 1
    torch.manual_seed(233)
    num_chunks = 20
    micro_batch_size = 3
    seq_len = 4
    hidden_size = 8
    set_p2p_tensor_shapes([(micro_batch_size, seq_len, hidden_size)])
    set_p2p_tensor_dtype(torch.float32)

    full_modules = nn.Sequential(*[PipelineStage(hidden_size) for _ in range(pp_size)])
    full_x = torch.randn(num_chunks * micro_batch_size, seq_len, hidden_size)
    full_l = torch.randn(num_chunks * micro_batch_size, seq_len, hidden_size)
    loss_ref, output_ref = example_ref_step(full_x, full_l, full_modules, num_chunks)

    local_full_modules = nn.Sequential(full_modules[rank], full_modules[pp_size - 1 - rank])
    local_modules = nn.Sequential(PipelineStage(hidden_size), PipelineStage(hidden_size))
    local_modules[0].load_state_dict(local_full_modules[0].state_dict())
    local_modules[1].load_state_dict(local_full_modules[1].state_dict())
    dualpipe_model = DualPipe(local_modules)

    if is_first_rank:
        x = full_x.chunk(2)[0]
        l = full_l.chunk(2)[1]
    elif is_last_rank:
        x = full_x.chunk(2)[1]
        l = full_l.chunk(2)[0]
    else:
        x = None
        l = None

    loss, outputs = dualpipe_model.step(x, num_chunks=num_chunks, criterion=example_criterion, labels=(l,),
                                        return_outputs=False)
    if is_first_rank:
        assert torch.equal(loss, loss_ref.chunk(2)[1])
    elif is_last_rank:
        assert torch.equal(loss, loss_ref.chunk(2)[0])
    else:
        assert loss is None
    assert outputs is None

    for (p0, p1) in zip(local_modules[0].parameters(), local_modules[1].parameters()):
        p0all = torch.empty(pp_size, *p0.shape)
        p1all = torch.empty(pp_size, *p1.shape)
        # (gloo wants the gathered tensor laid out as a concatenation; the same memory as NCCL's stacked one)
        dist.all_gather_into_tensor(p0all.view(-1, *p0.shape[1:]), p0.grad)
        dist.all_gather_into_tensor(p1all.view(-1, *p1.shape[1:]), p1.grad)
        p0.grad += p1all[pp_size - 1 - rank]
        p1.grad += p0all[pp_size - 1 - rank]
    worst = 0.0
    for ((n, p), p_ref) in zip(local_modules.named_parameters(), local_full_modules.parameters()):
        assert cal_diff(p.grad, p_ref.grad) < 1e-13
        worst = max(worst, cal_diff(p.grad, p_ref.grad))
    dualpipe_model.zero_grad()

    with torch.no_grad():
        loss, outputs = dualpipe_model.step(x, num_chunks=num_chunks, criterion=example_criterion, labels=(l,),
                                            return_outputs=True)
    if is_first_rank:
        assert torch.equal(loss, loss_ref.chunk(2)[1])
        assert torch.equal(outputs, output_ref.chunk(2)[1])
    elif is_last_rank:
        assert torch.equal(loss, loss_ref.chunk(2)[0])
        assert torch.equal(outputs, output_ref.chunk(2)[0])
    else:
        assert loss is None
        assert outputs is None
    return {"worst_cal_diff": worst}


def example_dualpipev(rank, pp_size, PipelineStage):
    is_first_rank = rank == 0
    torch.manual_seed(233)
    num_chunks = 20
    micro_batch_size = 3
    seq_len = 4
    hidden_size = 8
    set_p2p_tensor_shapes([(micro_batch_size, seq_len, hidden_size)])
    set_p2p_tensor_dtype(torch.float32)

    full_modules = nn.Sequential(*[PipelineStage(hidden_size) for _ in range(pp_size * 2)])
    full_x = torch.randn(num_chunks * micro_batch_size, seq_len, hidden_size)
    full_l = torch.randn(num_chunks * micro_batch_size, seq_len, hidden_size)
    loss_ref, output_ref = example_ref_step(full_x, full_l, full_modules, num_chunks)

    local_full_modules = nn.Sequential(full_modules[rank], full_modules[pp_size * 2 - 1 - rank])
    local_modules = nn.Sequential(PipelineStage(hidden_size), PipelineStage(hidden_size))
    local_modules[0].load_state_dict(local_full_modules[0].state_dict())
    local_modules[1].load_state_dict(local_full_modules[1].state_dict())
    dualpipev_model = DualPipeV(local_modules)

    if is_first_rank:
        x = full_x
        l = full_l
    else:
        x = None
        l = None

    loss, outputs = dualpipev_model.step(x, num_chunks=num_chunks, criterion=example_criterion, labels=(l,),
                                         return_outputs=False)
    if is_first_rank:
        assert torch.equal(loss, loss_ref)
    else:
        assert loss is None
    assert outputs is None

    worst = 0.0
    for ((n, p), p_ref) in zip(local_modules.named_parameters(), local_full_modules.parameters()):
        assert cal_diff(p.grad, p_ref.grad) < 1e-13
        worst = max(worst, cal_diff(p.grad, p_ref.grad))
    dualpipev_model.zero_grad()

    with torch.no_grad():
        loss, outputs = dualpipev_model.step(x, num_chunks=num_chunks, criterion=example_criterion, labels=(l,),
                                             return_outputs=True)
    if is_first_rank:
        assert torch.equal(loss, loss_ref)
        assert torch.equal(outputs, output_ref)
    else:
        assert loss is None
        assert outputs is None
    return {"worst_cal_diff": worst}


# ----------------------------------------------------------------------------------------------
# scenarios: name -> (world size, function(rank, world) -> dict of measurements)



def _no_declared_shapes() -> None:
    set_p2p_tensor_shapes(None)  # (module-wide, as in DeepSeek's: each scenario starts without)
    set_p2p_tensor_dtype(None)


SCENARIOS = Scenarios(__name__, before_each=_no_declared_shapes)
for _world in (2, 4):
    for _kind in ("dualpipe", "dualpipev"):
        for _cls in (WidthStage, HookedWidthStage):
            SCENARIOS[f"custom-{_kind}-{_world}-{'hook' if _cls is HookedWidthStage else 'plain'}"] = (
                _world, lambda rank, world, k=_kind, c=_cls: train_against_reference(rank, world, k, c))
        for _cls in (ExampleStage, ExampleStageWithHook):
            SCENARIOS[f"example-{_kind}-{_world}-{'hook' if _cls is ExampleStageWithHook else 'plain'}"] = (
                _world, lambda rank, world, k=_kind, c=_cls:
                (example_dualpipe if k == "dualpipe" else example_dualpipev)(rank, world, c))
SCENARIOS["unused-parameter-dualpipe-2"] = (2, unused_parameter)
for _how in ("right", "shapes", "dtype", "ranks-differ"):
    SCENARIOS[f"declared-{_how}-dualpipev-2"] = (2, lambda rank, world, h=_how: declared_shapes(rank, world,
                                                                                                 "dualpipev", h))
SCENARIOS["declared-shapes-dualpipe-4"] = (4, lambda rank, world: declared_shapes(rank, world, "dualpipe", "shapes"))


# ----------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n.startswith("custom-")])
def test_functions_that_set_grad_themselves_get_every_gradient(name):
    """Stages whose autograd Function writes weight.grad through what it saved: no .grad is None (DualPipe:
    checked on each copy before they are summed), losses, outputs and gradients equal one process's (float64),
    and without the hook the pipeline still frees the sent outputs (autograd does not save them)."""
    recs = SCENARIOS.records(name)
    assert sum(r["losses"] for r in recs) > 0
    for r, rec in enumerate(recs):
        assert rec["none"] == [], (name, r, rec["none"])
        assert rec["loss_err"] < 1e-12 and rec["out_err"] < 1e-12 and rec["grad_relerr"] < 1e-10, (name, r, rec)
        assert not rec["outputs_require_grad"], "returned outputs are detached (docs/pipeline.md says why)"
        assert rec["hook_calls"] == rec["expected_hook_calls"], rec
    if name.endswith("-plain"):
        assert all(rec["kept"] == 0 for rec in recs) and sum(rec["freed"] for rec in recs) > 0, recs
    else:
        assert sum(rec["expected_hook_calls"] for rec in recs) > 0


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n.startswith("example-")])
def test_deepseek_example_flow_runs_with_only_the_imports_changed(name):
    """The examples' own asserts (torch.equal losses and outputs, gradients within cal_diff < 1e-13) hold."""
    for rec in SCENARIOS.records(name):
        assert rec["worst_cal_diff"] < 1e-13, rec


def test_sum_stage_copies_keeps_none_where_no_copy_has_a_gradient():
    for rec in SCENARIOS.records("unused-parameter-dualpipe-2"):
        assert rec["unused_none"] == [True, True] and rec["ref_unused_none"], rec
        assert rec["grad_relerr"] < 1e-10, rec


def test_declared_shapes_that_match_pass():
    for rec in SCENARIOS.records("declared-right-dualpipev-2"):
        assert rec["type"] is None and rec["after"] == rec["expected_after"], rec


@pytest.mark.parametrize("name, words, sender, sent", [
    ("declared-shapes-dualpipev-2", "stage 2 (modules[1] of pipeline rank 1)", 1, "sends [(2, 6) float64]"),
    ("declared-dtype-dualpipev-2", "stage 0 (modules[0] of pipeline rank 0)", 0, "sends [(2, 7) float64]"),
    ("declared-shapes-dualpipe-4", "stage 1 of lane 0 (modules[0] of pipeline rank 1)", 1, "sends [(2, 3) float64]"),
])
def test_a_stream_that_differs_from_the_declaration_raises_on_every_rank(name, words, sender, sent):
    """Every rank raises a ValueError naming the stage and its rank (the sender says what it sent) after the
    step; once the declaration is taken back, the same pipelines run a step."""
    recs = SCENARIOS.records(name)
    for r, rec in enumerate(recs):
        assert rec["type"] == "ValueError" and words in rec["message"], (r, rec)
        assert "declared with set_p2p_tensor_shapes" in rec["message"], rec
        assert (sent in rec["message"]) == (r == sender), (r, rec)
        assert rec["after"] == rec["expected_after"], (r, rec)


def test_ranks_that_declare_differently_raise_before_the_step():
    for rec in SCENARIOS.records("declared-ranks-differ-dualpipev-2"):
        assert rec["type"] == "ValueError" and "declared different p2p tensor shapes" in rec["message"], rec
        assert rec["ops"] == 0, rec


def test_deepseek_names_import_and_the_queue_is_a_queue():
    import smsplit.pipeline as pipeline

    for name in ("DualPipe", "DualPipeV", "set_p2p_tensor_shapes", "set_p2p_tensor_dtype", "WeightGradStore",
                 "run_backward"):
        assert name in pipeline.__all__ and hasattr(pipeline, name)
    WeightGradStore.clear()
    try:
        assert isinstance(WeightGradStore.funcs_queue, queue.Queue) and WeightGradStore.funcs_queue.empty()
        ran = []
        WeightGradStore.put(lambda: ran.append(torch.is_grad_enabled()))
        WeightGradStore.flush()
        assert not WeightGradStore.funcs_queue.empty()
        WeightGradStore.pop()
        assert ran == [False] and WeightGradStore.funcs_queue.empty()
        WeightGradStore.funcs_queue.put([lambda: ran.append("put by hand")])  # (DeepSeek's code may do so)
        WeightGradStore.pop()
        assert ran == [False, "put by hand"]
        with pytest.raises(RuntimeError, match="no deferred weight gradients are queued"):
            WeightGradStore.pop()
    finally:
        WeightGradStore.clear()


def test_declarations_are_checked_when_made():
    try:
        with pytest.raises(TypeError, match="give a list of shapes"):
            set_p2p_tensor_shapes(torch.Size([2, 3]))
        with pytest.raises(TypeError, match="shape 0 must be a tuple of ints"):
            set_p2p_tensor_shapes([(2, 3.5)])
        with pytest.raises(ValueError, match="negative size"):
            set_p2p_tensor_shapes([(2, -1)])
        with pytest.raises(TypeError, match="give a torch.dtype"):
            set_p2p_tensor_dtype("float32")
        with pytest.raises(ValueError, match="does not send torch.uint32"):
            set_p2p_tensor_dtype(torch.uint32)
        set_p2p_tensor_shapes([[2, 3], torch.Size([4])])
        from smsplit.pipeline import dualpipe
        assert dualpipe._declaration() == (((2, 3), (4,)), None)
    finally:
        set_p2p_tensor_shapes(None)
        set_p2p_tensor_dtype(None)


class SavesItsOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (y,) = ctx.saved_tensors
        return grad_y * y


@pytest.mark.versioned
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_freeable_reads_what_autograd_holds_without_hooks(device):
    """What the pipeline frees once sent, read from reference counts right after a forward under no
    saved-tensor hooks: only outputs that nothing but their own tensor holds."""
    from smsplit.pipeline.dualpipe import _freeable

    x = torch.randn(4, 3, dtype=torch.float64, device=device, requires_grad=True)
    weight = nn.Parameter(torch.randn(5, 3, dtype=torch.float64, device=device))
    h = x * 2
    g = F.gelu(h)  # gelu saves its input h: the tensor itself (while g's graph lives)
    e = x.exp()  # exp saves its output: a new alias of e's storage
    a = h + 1
    view = a[1:]  # a view holds a
    b = x * 3  # nothing holds b
    m = SelfAccumulatingMatmul.apply(x, weight)  # saves x and weight, not its output
    s = SavesItsOutput.apply(x)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert _freeable([h, e, a, view, b, m, s, x, weight], [x]) == [False, False, False, False, True, True, False,
                                                                   False, False]
    del view
    assert _freeable([a], [x]) == [True]
    # what they saved still serves the backward, and the custom Function's weight is the parameter itself
    (g.sum() + e.sum() + m.sum() + s.sum()).backward()
    assert weight.grad is not None and torch.allclose(weight.grad, x.detach().sum(0).expand(5, 3))


def _nccl_worker(rank: int, world: int, port: int, outdir: str) -> None:
    """The examples' flow as published: one GPU per rank, NCCL, CUDA as the default device."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.cuda.set_device(rank)
    torch.set_default_device(f"cuda:{rank}")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    results = {}
    try:
        for name, flow in (("dualpipe", example_dualpipe), ("dualpipev", example_dualpipev)):
            for cls in (ExampleStageWithHook, ExampleStage):
                try:
                    results[f"{name}-{cls.__name__}"] = {"ok": True, **flow(rank, world, cls)}
                except Exception:  # noqa: BLE001 - recorded, then asserted by the test
                    results[f"{name}-{cls.__name__}"] = {"ok": False, "traceback": traceback.format_exc()}
    finally:
        set_p2p_tensor_shapes(None)
        set_p2p_tensor_dtype(None)
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_deepseek_example_flow_on_gpus_with_nccl():
    world = 2
    with tempfile.TemporaryDirectory() as outdir:
        spawn(_nccl_worker, args=(world, free_port(), outdir), nprocs=world, join=True)
        recs = [json.load(open(os.path.join(outdir, f"rank{r}.json"))) for r in range(world)]
    assert len(recs[0]) == 4
    for r, per_rank in enumerate(recs):
        for name, rec in per_rank.items():
            assert rec["ok"], f"{name} failed on rank {r}:\n{rec.get('traceback')}"
            assert rec["worst_cal_diff"] < 1e-13, (name, r, rec)
