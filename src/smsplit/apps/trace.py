"""`smsplit trace`: the SM split made visible.

    from smsplit.apps.trace import TraceConfig, run
    summary = run(TraceConfig(out_dir="smsplit-report/trace", comm_sms=20))

On a GPU: give communication 20 SMs (green contexts, or grid mode where the driver has none), run
a bandwidth-bound comm kernel beside a cuBLAS GEMM, and write an SM-by-time trace of where every
block ran. On a CPU-only machine: print what this machine offers and what a GPU run would show.
(`smsplit demo`, the main job, trains the MoE model: `smsplit.apps.demo`.)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from smsplit import info


@dataclass(frozen=True)
class TraceConfig:
    """Where `run` writes its report (``out_dir``, made if missing) and how many SMs it asks for communication
    (``comm_sms``, an int >= 1; the GPU must leave at least one for compute, checked by `run`). Bad values raise
    ValueError when the config is made."""

    out_dir: str = "smsplit-report/trace"
    comm_sms: int = 20

    def __post_init__(self) -> None:
        if isinstance(self.comm_sms, bool) or not isinstance(self.comm_sms, int) or self.comm_sms < 1:
            raise ValueError(f"comm_sms must be an int >= 1, got {self.comm_sms!r}")
        if not isinstance(self.out_dir, (str, os.PathLike)):
            raise ValueError(f"out_dir must be a path, got {self.out_dir!r}")
        object.__setattr__(self, "out_dir", os.fspath(self.out_dir))


def cpu_explanation(comm_sms: int) -> str:
    """What `smsplit trace` would show on a Hopper GPU (132 SMs, granted in groups of 8) for ``comm_sms``."""
    from smsplit.budget import plan_split

    try:
        plan = plan_split(comm_sms, 132, min_partition=8, alignment=8)
        split = (f"the driver grants SMs in\n     groups of 8, so {plan.comm_sms} SMs for communication and "
                 f"{plan.compute_sms} for compute on an H100/H200")
        where = f"exactly the {plan.comm_sms}\n     comm SMs and the GEMM in blue on the other {plan.compute_sms}"
    except ValueError as e:
        split, where = f"on a 132-SM H100/H200 this request fails: {e}", "the comm SMs and the GEMM on the rest"
    return f"""\
No CUDA GPU here, so there are no SMs to split. On a Hopper GPU this demo:
  1. makes SmBudget(comm_sms={comm_sms}): two complementary green contexts; {split};
  2. runs smsplit's persistent copy kernel (16-byte ld.global.nc / st.global.L1::no_allocate)
     on the comm stream while a bf16 GEMM (cuBLAS) runs on the compute stream;
  3. writes <out>/sm_trace.png: one row per SM over time, comm blocks in red on {where}, no SM shared; plus
     <out>/sm_trace.json for chrome://tracing or Perfetto, and <out>/summary.json with the timings.
Run `smsplit info` on a GPU machine to see its SMs, NVLink peers and green-context support."""


def _gpu_demo(out: Path, comm_sms: int, console) -> dict:
    from smsplit.budget import SmBudget, SmBudgetError
    from smsplit.trace import comm_beside_gemm

    try:
        budget = SmBudget(comm_sms, mode="green")
    except (SmBudgetError, ValueError) as e:  # no green contexts, or a request their groups of SMs cannot grant
        console.print(f"[yellow]green contexts: {e}; using mode='grid'[/yellow]")
        budget = SmBudget(comm_sms, mode="grid")
    with budget:
        console.print(f"budget: {budget}")
        start = time.perf_counter()
        trace = comm_beside_gemm(budget)
        elapsed = time.perf_counter() - start
        trace.save_png(out / "sm_trace.png", title=repr(budget), num_sms=budget.total_sms)
        trace.save_chrome(out / "sm_trace.json")
        comm, compute = trace.sms(kind="comm"), trace.sms(kind="compute")
        summary = {"budget": repr(budget), "comm_sms_used": len(comm), "compute_sms_used": len(compute),
                   "shared_sms": sorted(comm & compute), "comm_ms": trace.busy_ns("comm") / 1e6,
                   "compute_ms": trace.busy_ns("compute") / 1e6, "concurrent_ms": trace.concurrent_ns() / 1e6,
                   "comm_alone_ms": trace.alone_ns() / 1e6, "wall_s": elapsed}
        console.print(f"comm kernel ran on {len(comm)} SMs, GEMM on {len(compute)} SMs, "
                      f"shared: {len(comm & compute)}; {trace.timing_line()}")
        return summary


def run(config: TraceConfig) -> dict:
    """On a GPU: the traced comm kernel beside a GEMM (`_gpu_demo`); on a CPU-only machine: what a GPU would show.
    Writes ``summary.json`` (and on a GPU the trace) to ``config.out_dir``; returns the summary. A request the GPU
    cannot grant and a report folder that cannot be made raise ValueError before anything runs."""
    from rich.console import Console

    if not isinstance(config, TraceConfig):
        raise TypeError(f"run takes a TraceConfig, got {config!r}")
    out, comm_sms = config.out_dir, config.comm_sms
    if torch.cuda.is_available():  # a request the GPU cannot grant at all fails before the report folder exists
        from smsplit.budget import plan_split

        plan_split(comm_sms, torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
    console = Console()
    out_dir = Path(out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission
        raise ValueError(f"out: cannot make the report folder {out!r}: {e}") from e
    machine = info.collect()
    console.print(info.render(machine))
    if not torch.cuda.is_available():
        explanation = cpu_explanation(comm_sms)
        console.print(explanation, soft_wrap=True)
        summary = {"gpu": False, "explanation": explanation}
    else:
        summary = {"gpu": True, **_gpu_demo(out_dir, comm_sms, console)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print(f"report: {out_dir.resolve()}")
    return summary
