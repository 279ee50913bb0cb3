"""Shared pieces of the benchmarks: environment record, timing with CUDA events, result files."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from smsplit import ptx

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

RESULTS = Path(__file__).resolve().parent / "results"
FIGURES = Path(__file__).resolve().parent / "figures"


def environment() -> dict:
    """Machine, date, command and versions, for the head of every result file."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_count"] = torch.cuda.device_count()
        env["sms"] = props.multi_processor_count
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip()
        except Exception:
            pass
    return env


def time_ms(fn, stream=None, warmup: int = 3, repeat: int = 10, inner: int = 1, gate_ms: float = 0.0) -> dict:
    """Median (and min/max) milliseconds of ``fn`` on ``stream`` with CUDA events, after warm-up.
    ``inner`` calls are timed together and divided. ``gate_ms`` > 0 holds the stream in a sleep kernel of at least
    that long before each timed run, so that its calls are all queued before the first starts (the GPU's time
    of a host-bound ``fn``, not the host's); ``queued_before_start`` says whether every run's sleep outlasted it."""
    stream = stream or torch.cuda.current_stream()
    queued = True
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if gate_ms > 0:
                torch.cuda._sleep(int(gate_ms * 2e6))  # cycles: at most 2 GHz on Hopper, so at least gate_ms
            start.record(stream)
            for _ in range(inner):
                fn()
            end.record(stream)
            queued = queued and not (gate_ms > 0 and start.query())
            end.synchronize()
            times.append(start.elapsed_time(end) / inner)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "n": repeat,
            "queued_before_start": queued}


def call_times_ms(fn, warmup: int = 3, repeat: int = 10, inner: int = 1, before=None, cuda: bool | None = None) -> list[float]:
    """Milliseconds of each of ``repeat`` timed runs of ``fn`` (``inner`` calls per run, divided),
    after ``warmup`` untimed calls. ``before()``, if given, runs untimed before every warm-up call
    and every timed run (say, synchronize and a barrier, so that ranks start together). Like
    ``time_ms`` but returns every time and also runs on a CPU: CUDA events on the current stream
    (cuda=None: when CUDA is available), else ``time.perf_counter``."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        if cuda:
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / inner)
        else:
            times.append((time.perf_counter() - t0) * 1e3 / inner)
    return times


def max_over_ranks(value: float, dev) -> float:
    """The largest of every rank's ``value`` (a collective on the default group): the slower rank's time."""
    import torch.distributed as dist

    t = torch.tensor([value], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def join_nccl(rank: int, world: int, port: int) -> torch.device:
    """Make this spawned process rank ``rank`` of an NCCL group on ``cuda:rank`` (the first step of a `run_ranks`
    worker); returns its device."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    return dev


def routed_tokens(rank: int, world: int, dev, tokens: int = 4096, hidden: int = 7168, experts: int = 256,
                  topk: int = 8):
    """One rank's EP benchmark inputs, seeded by its rank: bf16 tokens, uniform random top-k expert ids and
    weights, and which ranks each token goes to (experts split evenly over the ranks). Returns
    ``(x, topk_idx, topk_weights, is_token_in_rank, generator)``; the generator draws further inputs."""
    g = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g).to(dev, torch.bfloat16)
    topk_idx = torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices.to(dev)
    topk_weights = torch.rand(tokens, topk, generator=g).to(dev)
    num_local = experts // world
    in_rank = torch.stack([((topk_idx >= r * num_local) & (topk_idx < (r + 1) * num_local)).any(1)
                           for r in range(world)], 1)
    return x, topk_idx, topk_weights, in_rank, g


def add_shape_arguments(parser) -> None:
    """``--tokens --hidden --experts --topk``: the DeepSeek-V3 shape per rank that `routed_tokens` draws by default."""
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)


def capture_graph(fn, dev) -> torch.cuda.CUDAGraph:
    """``fn`` run once on a side stream (compiles kernels, plans copies), then captured in a CUDA graph."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def run_ranks(worker, world: int, args):
    """Run ``worker(rank, world, port, args, queue)`` in ``world`` spawned processes (rank r on GPU r) and return
    what rank 0 put on the queue. Raises if a worker fails."""
    import torch.multiprocessing as mp

    from smsplit.launch import free_port

    queue = mp.get_context("spawn").Queue()
    mp.spawn(worker, args=(world, free_port(), args, queue), nprocs=world, join=True)
    return queue.get(timeout=10)


def max_difference(got, want, scale: float = 1.0) -> tuple[float, float]:
    """``(max |got - w|, that over max |w|)`` for ``w = scale * want``, in float32 on ``got``'s device: 0 when both
    are None; both infinite when only one is, when the shapes differ or when ``got`` holds a NaN or an infinity
    (a check of a result against its reference)."""
    if got is None or want is None:
        return (0.0, 0.0) if got is None and want is None else (math.inf, math.inf)
    if got.shape != want.shape:
        return math.inf, math.inf
    if want.numel() == 0:
        return 0.0, 0.0
    got, want = got.detach().reshape(-1), want.detach().reshape(-1)
    diff = largest = 0.0
    step = 1 << 24  # elements at a time: no float32 copy of a whole (large) gradient
    for i in range(0, want.numel(), step):
        w = want[i:i + step].to(got.device, torch.float32) * scale
        d = (got[i:i + step].float() - w).abs().max().item()
        if not math.isfinite(d):
            return math.inf, math.inf
        diff, largest = max(diff, d), max(largest, w.abs().max().item())
    return diff, diff / largest if largest > 0 else (0.0 if diff == 0 else math.inf)


def poison(tensors) -> None:
    """Fill each floating-point tensor of ``tensors`` (None skipped) with NaN, so that memory the allocator hands
    out once they are dropped holds NaN, not their values: a later step that fails to write a result cannot pass
    a check."""
    for t in tensors:
        if t is not None and t.is_floating_point():
            t.detach().fill_(math.nan)


def poison_grads(params) -> None:
    """`poison` every gradient of ``params`` and drop it."""
    for p in params:
        poison([p.grad])
        p.grad = None


def exit_if_roundtrips_failed(rows: list, path, label: str) -> None:
    """Exit naming them when a row's ``roundtrip_equal`` holds a False (``label``: the row's field naming its
    transport), after its times were written to ``path``."""
    bad = [f"{row[label]} P={row['comm_sms']}: {case}" for row in rows
           for case, ok in row["roundtrip_equal"].items() if ok is False]
    if bad:
        sys.exit(f"round trips that did not return their tokens: {'; '.join(bad)} (times recorded in {path})")


def _json_safe(value):
    """``value`` with every NaN or infinite float (a time that was not measured) as None: strict JSON."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_result(name: str, payload: dict) -> Path:
    """Write ``payload`` to bench/results/<name>.json (NaN and infinities as null) and return the path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = _json_safe(json.loads(json.dumps(payload, default=float)))  # (tensors' and numpy's numbers as floats)
    path.write_text(json.dumps(payload, indent=1, allow_nan=False))
    return path


def end_worker(rank: int, queue, result) -> None:
    """The end of a `run_ranks` worker: rank 0 hands ``result`` back, then every rank waits for the others and
    leaves the process group."""
    import torch.distributed as dist

    if rank == 0:
        queue.put(result)
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


def run_and_write(name: str, worker, args, notes: str) -> Path:
    """`run_ranks` on ``args.world`` GPUs, then ``bench/results/<name>.json`` with the environment, the arguments,
    what rank 0 returned and ``notes``."""
    res = run_ranks(worker, args.world, args)
    path = write_result(name, {"env": environment(), "args": vars(args), **res, "notes": notes})
    print(f"wrote {path}")
    return path


def concurrent_run(budget, gemm, copy, n_gemm, n_copy, sleep_ms: float = 25.0):
    """Run ``gemm`` on the budget's compute stream and ``copy`` (any comm work) on its comm stream,
    starting both loops at the same instant (both streams wait on one event recorded after a sleep
    kernel of at least ``sleep_ms``, so every launch is queued before either starts). Returns the per-call
    times of the GEMMs that ran entirely while copies ran, of the copies that ran entirely while GEMMs ran,
    and the windows, with ``queued_before_start``: whether the sleep outlasted the queueing (if not, host-bound
    copies may have left gaps, and the GEMM's slowdown reads low)."""
    torch.cuda.synchronize()
    gate = torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(sleep_ms * 2e6))  # cycles: at most 2 GHz on Hopper, so at least sleep_ms
    gate.record()
    spans = {"gemm": [], "copy": []}
    for stream, fn, n, name in ((budget.compute_stream, gemm, n_gemm, "gemm"), (budget.comm_stream, copy, n_copy, "copy")):
        stream.wait_event(gate)
        with torch.cuda.stream(stream):
            for _ in range(n):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(stream)
                fn()
                e1.record(stream)
                spans[name].append((e0, e1))
    queued_before_start = not gate.query()
    torch.cuda.synchronize()
    window = {k: [(gate.elapsed_time(a), gate.elapsed_time(b)) for a, b in v] for k, v in spans.items()}
    g_lo, g_hi = window["gemm"][0][0], window["gemm"][-1][1]
    c_lo, c_hi = window["copy"][0][0], window["copy"][-1][1]
    gemm_inside = [b - a for a, b in window["gemm"] if a >= c_lo and b <= c_hi]
    copy_inside = [b - a for a, b in window["copy"] if a >= g_lo and b <= g_hi]
    return gemm_inside, copy_inside, {"gemm_window_ms": [g_lo, g_hi], "copy_window_ms": [c_lo, c_hi],
                                      "queued_before_start": queued_before_start}


def interleaved_rounds(budget, gemm, copy, rounds: int, repeat: int, n_gemm: int, copy_factor: float = 1.4,
                       agree=None, copy_host_ms: float = 0.0, copy_inner: int = 1):
    """``rounds`` short rounds on ``budget``, each measuring the GEMM alone (compute stream), the
    copy alone (comm stream) and one concurrent run of both (``concurrent_run``) back to back; odd
    rounds run the three in reverse order, so a drift inside a round biases no side. A round's
    concurrent run queues ``n_gemm`` GEMMs and enough copies to outlast them (``copy_factor`` times
    the GEMMs' time alone, from that round's or, when the concurrent run comes first, the previous
    round's alone figures). Returns one dict per round: the alone medians, the medians of the
    concurrent samples, the sample counts, the kept ratios (alone / concurrent time; the copy's is
    ``None`` when no copy ran entirely inside the GEMMs) and the concurrent run's windows. Across ranks
    whose copies wait for each other, ``agree(n)`` makes every rank's copy count the same (say, the max
    over ranks); ``copy_host_ms`` (host time to queue one copy call) lengthens the gate's sleep so that
    every call is queued before the two loops start. ``copy_inner`` > 1 times the copy alone as that many calls
    queued back to back between two events, divided; with ``copy_host_ms`` > 0 they are queued behind a sleep kernel
    first (``time_ms``'s gate), as the concurrent run queues them: for a copy whose host time per call is near or
    above its GPU time, calls timed as the host issues them would time the host too."""
    out, alone = [], {}
    for r in range(rounds):
        order = ["gemm_alone", "copy_alone", "concurrent"]
        if r % 2:
            order.reverse()
        got = {"round": r, "order": order}
        for step in order:
            if step == "gemm_alone":
                alone["gemm"] = time_ms(gemm, stream=budget.compute_stream, warmup=2, repeat=repeat)["median_ms"]
                got["gemm_alone_ms"] = alone["gemm"]
            elif step == "copy_alone":
                gate_ms = 1.5 * copy_inner * copy_host_ms + 1.0 if copy_host_ms > 0 else 0.0
                timed = time_ms(copy, stream=budget.comm_stream, warmup=2, repeat=repeat, inner=copy_inner,
                                gate_ms=gate_ms)
                alone["copy"] = got["copy_alone_ms"] = timed["median_ms"]
                got["copy_alone_queued_before_start"] = timed["queued_before_start"]
            else:
                n_copy = max(4, int(copy_factor * n_gemm * alone["gemm"] / alone["copy"]))
                n_copy = agree(n_copy) if agree is not None else n_copy
                sleep_ms = max(25.0, 1.5 * n_copy * copy_host_ms + 5.0)
                g, c, w = concurrent_run(budget, gemm, copy, n_gemm, n_copy, sleep_ms=sleep_ms)
                got.update({"gemm_concurrent_ms": statistics.median(g) if g else None,
                            "copy_concurrent_ms": statistics.median(c) if c else None,
                            "gemm_concurrent_samples": len(g), "copy_concurrent_samples": len(c),
                            "n_gemm": n_gemm, "n_copy": n_copy, "window": w})
                got["_samples"] = (g, c)
        got["gemm_kept"] = (got["gemm_alone_ms"] / got["gemm_concurrent_ms"]) if got["gemm_concurrent_ms"] else None
        got["copy_kept"] = (got["copy_alone_ms"] / got["copy_concurrent_ms"]) if got["copy_concurrent_ms"] else None
        out.append(got)
    return out

# ------------------------------------------------------------------------------------------ started together
# Timing a collective call from the moment every rank's GPU is ready, on the GPU clock. Timed one call at a time
# with CUDA events, each rank's time also holds how long its GPU waits for the others (after a host barrier the
# ranks' graphs start tens to a hundred microseconds apart) and the graph's launch. DeepEP's profiled benchmark
# (`bench_kineto` with `barrier_comm_profiling`) aligns the ranks with a GEMM and an all-reduce before each
# profiled call. Here the call is captured in a CUDA graph between two one-thread kernels: a barrier (it adds 1 to
# its word on every rank, ``atom.release.sys`` over NVLink, waits until every rank's word on this GPU has arrived,
# then reads ``%globaltimer``) and a stamp (it reads ``%globaltimer`` once the call's work on the stream is done).
# The call's time is the stamp minus the barrier's exit, on one GPU's clock: the ranks start within the flags'
# latency of each other (a microsecond or two) whenever their hosts launch the graphs. The barrier's round count
# lives on the device, so a graph replays it. Each wait is bounded; a wait that times out is counted and
# `StartTogether.check()` raises on it, so an unaligned figure is never reported as aligned. (A barrier before a
# CUDA start event, with a hold for the host to queue the call, left one rank's call starting about a hold later
# than the other's; this version needs no host timing.)


@triton.jit
def barrier_kernel(bases_ptr, round_ptr, missed_ptr, stamp_ptr, rank, R, timeout_ns):
    """Round r = ``*round_ptr`` + 1: add 1 to word ``rank`` of every rank's counters (``bases_ptr``: their
    addresses), wait until every word of this rank's counters is >= r (a wait that times out adds 1 to
    ``*missed_ptr``), then store the GPU clock in ``*stamp_ptr``. One warp."""
    target = tl.load(round_ptr, volatile=True) + 1
    tl.store(round_ptr, target)
    for d in range(R):
        ptx.atom_add_release_sys(tl.load(bases_ptr + d).to(tl.pointer_type(tl.int32)) + rank, 1)
    own = tl.load(bases_ptr + rank).to(tl.pointer_type(tl.int32))
    missed = 0
    for s in range(R):
        seen = ptx.wait_geq_sys(own + s, target, timeout_ns)
        missed += (seen < target).to(tl.int32)
    tl.debug_barrier()  # every thread after thread 0's waits
    tl.atomic_add(missed_ptr, missed)
    tl.store(stamp_ptr, ptx.globaltimer())


@triton.jit
def stamp_kernel(stamp_ptr):
    """Store the GPU clock in ``*stamp_ptr``."""
    tl.store(stamp_ptr, ptx.globaltimer())


class StartTogether:
    """``graph(fn)`` captures ``fn`` between the barrier and the stamp; ``times_ms(graph)`` replays it and returns
    each replay's time from the barrier's exit to the stamp. Every rank of the default group must capture and replay
    the same graphs in the same order."""

    def __init__(self, dev: torch.device, timeout_s: float = 10.0):
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group.group_name)
        self.dev, self.rank, self.world = dev, dist.get_rank(), dist.get_world_size()
        self.counters = symm_mem.empty(self.world, dtype=torch.int32, device=dev)
        self.counters.zero_()
        handle = symm_mem.rendezvous(self.counters, group)
        self.bases = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=dev)
        self.round = torch.zeros(1, dtype=torch.int32, device=dev)
        self.missed = torch.zeros(1, dtype=torch.int32, device=dev)
        self.stamps = torch.zeros(2, dtype=torch.int64, device=dev)
        self.timeout_ns = int(timeout_s * 1e9)
        torch.cuda.synchronize(dev)
        dist.barrier(device_ids=[dev.index])

    def barrier(self) -> None:
        """Queue the barrier (its exit time to ``stamps[0]``) on the current stream."""
        barrier_kernel[(1,)](self.bases, self.round, self.missed, self.stamps, self.rank, self.world, self.timeout_ns,
                             num_warps=1)

    def stamp(self) -> None:
        """Queue the stamp (the time to ``stamps[1]``) on the current stream."""
        stamp_kernel[(1,)](self.stamps[1:], num_warps=1)

    def graph(self, fn) -> torch.cuda.CUDAGraph:
        """``fn`` between the barrier and the stamp, run once on a side stream (compiles; every rank meets once),
        then captured."""
        def step():
            self.barrier()
            fn()
            self.stamp()

        return capture_graph(step, self.dev)

    def times_ms(self, graph: torch.cuda.CUDAGraph, warmup: int = 3, repeat: int = 20) -> list[float]:
        """Milliseconds from the barrier's exit to the stamp, for each of ``repeat`` replays after ``warmup``; the
        GPU idle before each (a synchronization). Raises if a barrier wait timed out."""
        times = []
        for i in range(warmup + repeat):
            torch.cuda.synchronize(self.dev)
            graph.replay()
            torch.cuda.synchronize(self.dev)
            start, end = self.stamps.tolist()
            if i >= warmup:
                times.append((end - start) / 1e6)
        self.check()
        return times

    def median_ms(self, fn, warmup: int = 3, repeat: int = 20) -> float:
        """The median of `times_ms` for ``fn`` in a graph of its own."""
        graph = self.graph(fn)
        ms = statistics.median(self.times_ms(graph, warmup, repeat))
        del graph
        return ms

    def check(self) -> None:
        missed = int(self.missed.item())
        if missed:
            raise RuntimeError(f"rank {self.rank}, start-together barrier: {missed} waits timed out (the ranks did "
                               "not start together)")
