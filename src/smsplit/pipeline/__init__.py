"""Pipeline parallelism: DualPipe / DualPipeV runtimes, zero-bubble weight-gradient deferral, and
a schedule simulator that times the very op lists the runtimes execute."""

from .dualpipe import DualPipe, DualPipeV, run_backward, sum_stage_copies
from .schedule import KINDS, Batch, Message, Op, Simulation, comm_plan, schedule, simulate
from .weight_grad import Linear, WeightGradStore

__all__ = [
    "DualPipe", "DualPipeV", "WeightGradStore", "Linear", "simulate", "schedule", "comm_plan",
    "sum_stage_copies", "run_backward", "Op", "Batch", "Message", "Simulation", "KINDS",
]
