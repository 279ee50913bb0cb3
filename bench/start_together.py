"""A device-side barrier for timing a collective call from the moment every rank's GPU is ready.

Timed one call at a time, each rank's CUDA events also count how long its GPU waits for the others to launch: after a
host barrier the ranks' graphs start tens of microseconds apart (`bench/combine_timeline.py`). DeepEP's benchmark
aligns the ranks with a collective before each timed call; here a one-thread kernel queued just before the start
event adds 1 to its word on every rank (``atom.release.sys`` over NVLink), spins until every rank's word on this GPU
has arrived, then holds ``hold_us`` more on its own clock, so that the host has queued the start event and the call
behind it by the time the barrier ends. The start events then fire within the flags' latency of each other (a
microsecond or two) and the call's work starts at once. Each wait is bounded; a wait that timed out is counted and
``check()`` raises on it, so an unaligned figure is never reported as aligned.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from smsplit import ptx


@triton.jit
def start_together_kernel(bases_ptr, missed_ptr, rank, R, target, timeout_ns, hold_ns):
    """Add 1 to word ``rank`` of every rank's counters (``bases_ptr``: their addresses), wait until every word of this
    rank's counters is >= ``target`` (a wait that times out adds 1 to ``missed_ptr``), then spin ``hold_ns`` on the
    GPU clock."""
    for d in range(R):
        ptx.atom_add_release_sys(tl.load(bases_ptr + d).to(tl.pointer_type(tl.int32)) + rank, 1)
    own = tl.load(bases_ptr + rank).to(tl.pointer_type(tl.int32))
    missed = 0
    for s in range(R):
        seen = ptx.wait_geq_sys(own + s, target, timeout_ns)
        missed += (seen < target).to(tl.int32)
    tl.atomic_add(missed_ptr, missed)
    start = ptx.globaltimer()
    now = start
    while now - start < hold_ns:
        now = ptx.globaltimer()
    tl.debug_barrier()


class StartTogether:
    """``StartTogether(dev)()`` queues the barrier on the current stream; every rank of the default group must call
    it the same number of times. ``check()`` (it synchronizes) raises if any wait timed out."""

    def __init__(self, dev: torch.device, timeout_s: float = 10.0, hold_us: float = 300.0):
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group.group_name)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.counters = symm_mem.empty(self.world, dtype=torch.int32, device=dev)
        self.counters.zero_()
        handle = symm_mem.rendezvous(self.counters, group)
        self.bases = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=dev)
        self.missed = torch.zeros(1, dtype=torch.int32, device=dev)
        self.calls = 0
        self.timeout_ns = int(timeout_s * 1e9)
        self.hold_ns = int(hold_us * 1e3)
        torch.cuda.synchronize(dev)
        dist.barrier(device_ids=[dev.index])

    def __call__(self) -> None:
        self.calls += 1
        start_together_kernel[(1,)](self.bases, self.missed, self.rank, self.world, self.calls, self.timeout_ns,
                                    self.hold_ns, num_warps=1)

    def check(self) -> None:
        missed = int(self.missed.item())
        if missed:
            raise RuntimeError(f"rank {self.rank}, start-together barrier: {missed} of {self.calls * self.world} waits "
                               "timed out (the ranks did not start together)")
