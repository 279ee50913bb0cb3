"""Timing a collective call from the moment every rank's GPU is ready, on the GPU clock.

Timed one call at a time with CUDA events, each rank's time also holds how long its GPU waits for the others (after
a host barrier the ranks' graphs start tens to a hundred microseconds apart, `bench/combine_timeline.py`) and the
graph's launch. DeepEP's profiled benchmark (`bench_kineto` with `barrier_comm_profiling`) aligns the ranks with a
GEMM and an all-reduce before each profiled call. Here the call is
captured in a CUDA graph between two one-thread kernels: a barrier (it adds 1 to its word on every rank,
``atom.release.sys`` over NVLink, waits until every rank's word on this GPU has arrived, then reads ``%globaltimer``)
and a stamp (it reads ``%globaltimer`` once the call's work on the stream is done). The call's time is the stamp
minus the barrier's exit, on one GPU's clock: the ranks start within the flags' latency of each other (a
microsecond or two) whenever their hosts launch the graphs. The barrier's round count lives on the device, so a
graph replays it. Each wait is bounded; a wait that times out is counted and `check()` raises on it, so an unaligned
figure is never reported as aligned.

(Session 15 tried the barrier before a CUDA start event instead, with a hold after it for the host to queue the
call: one rank's call still started about a hold later than the other's, for a reason not found; this version needs
no host timing.)
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from common import capture_graph  # bench/ (the scripts that import this module put it on the path)

from smsplit import ptx


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
