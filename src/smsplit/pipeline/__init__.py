"""Pipeline parallelism: DualPipe / DualPipeV runtimes, zero-bubble weight-gradient deferral, and
a schedule simulator that times the very op lists the runtimes execute."""

from .dualpipe import (
    DualPipe,
    DualPipeV,
    PipelineError,
    PipelineTimeoutError,
    run_backward,
    set_p2p_tensor_dtype,
    set_p2p_tensor_shapes,
    sum_stage_copies,
)
from .schedule import (
    KINDS,
    SYNCS,
    Batch,
    Message,
    Op,
    Simulation,
    comm_plan,
    comm_plans,
    schedule,
    simulate,
)
from .weight_grad import Linear, WeightGradStore

__all__ = [
    "KINDS",
    "SYNCS",
    "Batch",
    "DualPipe",
    "DualPipeV",
    "Linear",
    "Message",
    "Op",
    "PipelineError",
    "PipelineTimeoutError",
    "Simulation",
    "WeightGradStore",
    "comm_plan",
    "comm_plans",
    "run_backward",
    "schedule",
    "set_p2p_tensor_dtype",
    "set_p2p_tensor_shapes",
    "simulate",
    "sum_stage_copies",
]
