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
from smsplit.copy import sm_copy
from smsplit.trace import Trace, _spin_kernel


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


GEMM_NAME, COPY_NAME = "GEMM (cuBLAS)", "copy (smsplit)"


def comm_beside_gemm(budget, gemm_n: int = 8192, gemms: int = 4, copy_mib: int = 256, copies: int = 4,
                     gate_ns: int = 2_000_000) -> Trace:
    """Trace smsplit's copy kernel beside cuBLAS GEMMs on an `smsplit.budget.SmBudget`: ``copies`` copies of
    ``copy_mib`` MiB with ``budget.comm_sms`` programs on the comm stream (each program recorded), and
    ``gemms`` bf16 GEMMs of ``gemm_n``^3 on the compute stream (a span). Returns the trace of one round;
    ``trace.concurrent_ns()`` is how long the two ran at once. Raises RuntimeError if the copy is wrong.

    Launched cold, the two run one after the other: the traced copy kernel's first launch in a process
    compiles it, or loads it from Triton's cache, and that takes the host longer (hundreds of ms on an H100
    on a first run) than the GEMMs queued before it take to run; once loaded, a copy queued right after the
    GEMMs runs beside them. So one full round runs first, traced into a scratch trace (it loads every
    kernel the round uses, with tracing on, and sets cuBLAS up for the compute stream); then both streams
    wait on one gate, a kernel spinning ``gate_ns`` on the current stream, while the host queues the copies
    and the GEMMs behind it, so that both start together whatever the host's launch order and pace.
    """
    for name, value in (("gemm_n", gemm_n), ("gemms", gemms), ("copy_mib", copy_mib), ("copies", copies),
                        ("gate_ns", gate_ns)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    device = budget.device
    comm, compute = budget.comm_stream, budget.compute_stream
    a = torch.randn(gemm_n, gemm_n, device=device, dtype=torch.bfloat16)
    b = torch.randn(gemm_n, gemm_n, device=device, dtype=torch.bfloat16)
    src = torch.randn(copy_mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)

    def one_round(trace: Trace) -> None:
        _spin_kernel[(1,)](gate_ns, num_warps=1)
        gate = torch.cuda.current_stream(device).record_event()  # also after the inputs, made on this stream
        with torch.cuda.stream(comm):  # the copy first: the comm stream's priority is the higher one
            comm.wait_event(gate)
            for _ in range(copies):
                sm_copy(dst, src, budget.comm_sms, trace=trace, name=COPY_NAME, kind="comm")
        compute.wait_event(gate)
        with trace.span(compute, GEMM_NAME, kind="compute"), torch.cuda.stream(compute):
            for _ in range(gemms):
                a @ b
        comm.synchronize()
        compute.synchronize()

    with torch.cuda.device(device):
        one_round(Trace(device))  # warm-up, discarded
        dst.zero_()
        torch.cuda.synchronize(device)
        trace = Trace(device)
        one_round(trace)
    if not torch.equal(dst, src):
        raise RuntimeError("the comm kernel's copy differs from its source")
    return trace


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
