"""A pool of processes in one process group, to run many multi-rank test cases without respawning.

    pool = gloo_pool(4)                       # started once, reused by every caller in this process
    pool = process_pool(2, "nccl")            # rank r on cuda:r
    results = pool.run(my_case, arg1, arg2)   # my_case(rank, world_size, arg1, arg2) on every rank

`my_case` must be importable by name in the workers (a module-level function). A case that fails on any rank
raises AssertionError here with every failing rank's traceback; the pool then restarts, since a failed case may
leave the group's connections in an unknown state.

Also `misaligned_copy(t)`: an input the device kernels cannot read in 16-byte vectors as it is.
"""

import atexit
import os
import queue
import random
import socket
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a process group's rendezvous. Taken below the kernel's
    ephemeral range (``ip_local_port_range``, 32768-60999 by default), where NCCL's and gloo's own sockets get
    their ports: a port the kernel handed out as ephemeral can be handed out again, to one of those sockets,
    between this check and the rendezvous (the EADDRINUSE a GPU test run once hit)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port between 20000 and 32000 on 127.0.0.1")


def misaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` (same device) whose data starts one element past a 16-byte boundary (an empty
    ``t``: a plain copy, it has no data to place)."""
    if t.numel() == 0:
        return t.clone()
    flat = torch.empty(t.numel() + 16, dtype=t.dtype, device=t.device)
    start = next(i for i in range(1, 17) if (flat.data_ptr() + i * t.element_size()) % 16)
    out = flat[start:start + t.numel()].view(t.shape)
    out.copy_(t)
    assert out.is_contiguous() and out.data_ptr() % 16
    return out


def _worker(rank: int, world_size: int, backend: str, port: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class ProcessPool:
    """`world_size` spawned processes, the ranks of one process group (`backend`: "gloo" or "nccl") on 127.0.0.1."""

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        self.world_size = world_size
        self.backend = backend
        self.processes: List[Any] = []
        self._start()

    def _start(self) -> None:
        context = mp.get_context("spawn")
        port = free_port()
        self.tasks = [context.SimpleQueue() for _ in range(self.world_size)]
        self.results = context.Queue()
        self.processes = [context.Process(target=_worker, args=(rank, self.world_size, self.backend, port,
                                                                 self.tasks[rank], self.results), daemon=True)
                          for rank in range(self.world_size)]
        for p in self.processes:
            p.start()

    def run(self, fn: Callable, *args, timeout_s: float = 120.0) -> List[Any]:
        """Run `fn(rank, world_size, *args)` on every rank; return the results by rank."""
        for task_queue in self.tasks:
            task_queue.put((fn, args))
        outcomes: Dict[int, Any] = {}
        failures = []
        try:
            for _ in range(self.world_size):
                rank, ok, value = self.results.get(timeout=timeout_s)
                outcomes[rank] = value
                if not ok:
                    failures.append(f"--- rank {rank} ---\n{value}")
        except queue.Empty:
            failures.append(f"ranks {sorted(set(range(self.world_size)) - set(outcomes))} did not finish "
                            f"within {timeout_s} s")
        if failures:
            self.restart()
            raise AssertionError(f"{fn.__name__}{args} failed:\n" + "\n".join(failures))
        return [outcomes[r] for r in range(self.world_size)]

    def restart(self) -> None:
        self.close(graceful=False)
        self._start()

    def close(self, graceful: bool = True) -> None:
        for p, task_queue in zip(self.processes, self.tasks):
            if graceful and p.is_alive():
                task_queue.put(None)
        for p in self.processes:
            p.join(timeout=5 if graceful else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        self.processes = []


_POOLS: Dict[Tuple[int, str], ProcessPool] = {}


def process_pool(world_size: int, backend: str = "gloo") -> ProcessPool:
    """The process-wide pool of `world_size` ranks on `backend`, started on first use and closed at exit."""
    if (world_size, backend) not in _POOLS:
        _POOLS[(world_size, backend)] = ProcessPool(world_size, backend)
    return _POOLS[(world_size, backend)]


def gloo_pool(world_size: int) -> ProcessPool:
    """`process_pool(world_size, "gloo")`: CPU ranks."""
    return process_pool(world_size, "gloo")


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


# --- virtual ranks: more ranks than GPUs ---------------------------------------------------------------------------

class VirtualGroup:
    """The part of a process group the device transports use (``rank()``, ``size()``, ``group_name``), for one
    thread of `run_virtual_ranks`."""

    def __init__(self, ranks: "_VirtualRanks", rank: int) -> None:
        self.ranks, self._rank = ranks, rank
        self.group_name = f"virtual{ranks.world_size}"
        self._calls = 0  # collective calls made so far: every rank makes the same ones in the same order

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.ranks.world_size

    def exchange(self, value: Any) -> List[Any]:
        """Every rank's ``value`` of this collective call, by rank, once every rank has given its own."""
        self._calls += 1
        return self.ranks.exchange(self._rank, self._calls, value)

    def barrier(self) -> None:
        self.ranks.barrier.wait()


class _VirtualRanks:
    def __init__(self, world_size: int, timeout_s: float) -> None:
        import threading

        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout_s)
        self._lock = threading.Lock()
        self._values: Dict[int, List[Any]] = {}

    def exchange(self, rank: int, call: int, value: Any) -> List[Any]:
        with self._lock:
            self._values.setdefault(call, [None] * self.world_size)[rank] = value
        self.barrier.wait()
        return list(self._values[call])


def _virtual_symmetric_buffer(numel: int, dtype: torch.dtype, group: VirtualGroup, device: torch.device):
    """`smsplit.ep.transport.symmetric_buffer` for virtual ranks: a plain allocation on the one device, and every
    rank's address of its own (``handle.buffer_ptrs``)."""
    from types import SimpleNamespace

    buffer = torch.empty(numel, dtype=dtype, device=device)
    return buffer, SimpleNamespace(buffer_ptrs=group.exchange(buffer.data_ptr()))


def _virtual_barrier(group=None, device_ids=None, **_) -> None:
    group.barrier()


def _virtual_all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    torch.cuda.current_stream(input.device).synchronize()
    values = group.exchange(input.clone())
    output.view(group.size(), -1).copy_(torch.stack([v.flatten() for v in values]))

    class Done:
        def is_completed(self) -> bool:
            return True

        def wait(self, timeout=None) -> bool:
            return True

    return Done() if async_op else None


def run_virtual_ranks(world_size: int, fn: Callable, *args, timeout_s: float = 300.0) -> List[Any]:
    """
    Run ``fn(rank, world_size, group, *args)`` for every rank of ``world_size`` ranks on the one current GPU: each rank
    a thread of this process on a stream of its own, ``group`` a `VirtualGroup`. Returns the results by rank; a
    rank that raises (or does not finish within ``timeout_s``) fails the run with every failing rank's traceback.

    For testing the device transports (`NvlinkTransport`, `CopyEngineTransport`) with more ranks than there are
    GPUs: while it runs, their symmetric buffers are plain allocations on the GPU whose addresses the ranks exchange,
    and `torch.distributed.barrier` / `all_gather_into_tensor` go between the threads. Their kernels, flags and
    bounded waits are those of one rank per GPU; every peer access stays on the one GPU (no NVLink), and the ranks'
    kernels must fit on the GPU together (``world_size * num_sms`` SMs at most), since each waits for the others.
    ``fn`` must synchronize its own stream only (`torch.cuda.current_stream().synchronize()`): a device-wide
    synchronize would wait for peers' kernels that wait for this rank's next call. Not thread-safe against other
    users of `torch.distributed` in this process while it runs.
    """
    import threading

    import torch.distributed as dist

    from . import copy_engine, nvlink

    ranks = _VirtualRanks(world_size, timeout_s)
    device = torch.cuda.current_device() if torch.cuda.is_available() else None  # (None: host-only ranks)
    results: List[Any] = [None] * world_size
    failures: Dict[int, str] = {}

    def body(rank: int) -> None:
        try:
            if device is None:
                results[rank] = fn(rank, world_size, VirtualGroup(ranks, rank), *args)
                return
            torch.cuda.set_device(device)
            with torch.cuda.stream(torch.cuda.Stream()):
                results[rank] = fn(rank, world_size, VirtualGroup(ranks, rank), *args)
                torch.cuda.current_stream().synchronize()
        except BaseException:
            failures[rank] = traceback.format_exc()
            ranks.barrier.abort()  # the other ranks' barriers raise instead of waiting for this one

    patched = [(nvlink, "symmetric_buffer", _virtual_symmetric_buffer),
               (copy_engine, "symmetric_buffer", _virtual_symmetric_buffer),
               (dist, "barrier", _virtual_barrier), (dist, "all_gather_into_tensor", _virtual_all_gather_into_tensor)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched]
    for module, name, value in patched:
        setattr(module, name, value)
    try:
        threads = [threading.Thread(target=body, args=(rank,), daemon=True) for rank in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        stuck = [rank for rank, t in enumerate(threads) if t.is_alive()]
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
    if stuck:
        failures[-1] = f"ranks {stuck} did not finish within {timeout_s} s"
    if failures:
        first = {rank: text for rank, text in failures.items() if "BrokenBarrierError" not in text} or failures
        raise AssertionError(f"{getattr(fn, '__name__', fn)} on {world_size} virtual ranks failed:\n"
                             + "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in sorted(first.items())))
    return results
