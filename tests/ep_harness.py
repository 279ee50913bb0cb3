"""Test harness for multi-rank tests (tests only; the library never imports it): a pool of processes in one
process group, to run many multi-rank test cases without respawning.

    pool = gloo_pool(4)                       # started once, reused by every caller in this process
    pool = process_pool(2, "nccl")            # rank r on cuda:r
    results = pool.run(my_case, arg1, arg2)   # my_case(rank, world_size, arg1, arg2) on every rank

`my_case` must be importable by name in the workers (a module-level function). A case that fails on any rank
raises AssertionError here with every failing rank's traceback; the pool then restarts, since a failed case may
leave the group's connections in an unknown state.

Also `misaligned_copy(t)`: an input the device kernels cannot read in 16-byte vectors as it is; and
`run_ranks_on_one_gpu(world_size, fn, *args)`: ranks of the device transports as processes sharing one GPU, for
more ranks than there are GPUs.

Every process the tests start for ranks comes from `context()`, a fork server that has imported torch and smsplit
once (`spawn(fn, args, nprocs)` is `torch.multiprocessing.spawn` from it): a spawned interpreter spends 2-4 s of CPU
importing them, which made process starts most of the CPU suite's time on a 2-core machine. As with "spawn" (and
unlike "fork"), a child starts from a clean process, not a copy of the test process (no monkeypatches, threads or
CUDA state of it); its environment is the server's, copied when the first test started one: a child that needs a
variable sets it itself.
"""

import atexit
import os
import queue
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.multiprocessing as mp

from smsplit.launch import free_port

# what the fork server imports before it forks (none of it initializes CUDA, so a child can still use a GPU)
PRELOAD = ["torch", "torch.distributed", "numpy", "smsplit.ep", "smsplit.ep.nvlink", "smsplit.ep.copy_engine",
           "smsplit.pipeline", "smsplit.moe", "smsplit.apps.demo"]


def context():
    """The multiprocessing context of the tests' rank processes: the fork server, with `PRELOAD` imported."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # (read when the server starts: the first process of the session)
    return ctx


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True):
    """`torch.multiprocessing.spawn(fn, args, nprocs, join)`, the processes started from `context()`."""
    context()
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")


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
    """`world_size` processes (from `context()`), the ranks of one process group (`backend`: "gloo" or "nccl") on
    127.0.0.1."""

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        self.world_size = world_size
        self.backend = backend
        self.processes: List[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = context()
        port = free_port()
        self.tasks = [ctx.SimpleQueue() for _ in range(self.world_size)]
        self.results = ctx.Queue()
        self.processes = [ctx.Process(target=_worker, args=(rank, self.world_size, self.backend, port,
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


# --- more ranks than GPUs: processes sharing one GPU ------------------------------------------------------------

_SHARING: Dict[str, Any] = {}  # in a rank of `run_ranks_on_one_gpu`: its inboxes, rank, and the peers' buffers


def _shared_symmetric_buffer(numel: int, dtype: torch.dtype, group, device: torch.device):
    """`smsplit.ep.transport.symmetric_buffer` for ranks sharing one GPU: a plain allocation sent to every peer
    through torch's CUDA IPC (a `torch.multiprocessing` queue), and every rank's address of its own in this process
    (``handle.buffer_ptrs``)."""
    from types import SimpleNamespace

    rank, inboxes = _SHARING["rank"], _SHARING["inboxes"]
    buffer = torch.empty(numel, dtype=dtype, device=device)
    for peer, inbox in enumerate(inboxes):
        if peer != rank:
            inbox.put((rank, buffer))
    ptrs = [0] * len(inboxes)
    ptrs[rank] = buffer.data_ptr()
    for _ in range(len(inboxes) - 1):
        source, peer_buffer = inboxes[rank].get(timeout=120)
        _SHARING["peer_buffers"].append(peer_buffer)  # mapped until this process ends
        ptrs[source] = peer_buffer.data_ptr()
    return buffer, SimpleNamespace(buffer_ptrs=ptrs)


def _gloo_barrier(group=None, async_op=False, device_ids=None):
    return _SHARING["barrier"](group=group, async_op=async_op)


def _all_gather_through_host(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    import torch.distributed as dist

    source = input.cpu()
    parts = [torch.empty_like(source) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, source, group=group)
    output.view(len(parts), -1).copy_(torch.stack([p.flatten() for p in parts]))
    return _Completed() if async_op else None


class _Completed:
    """The work handle of a collective that has already finished."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        return True


def _one_gpu_rank(rank: int, world_size: int, port: int, timeout_s: float, inboxes, results, fn: Callable,
                  args: tuple) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from smsplit.ep import copy_engine, nvlink

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        # (gloo's waits, the barrier and all-gather among them, give up after timeout_s too)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        _SHARING.update(rank=rank, inboxes=inboxes, peer_buffers=[], barrier=dist.barrier)
        nvlink.symmetric_buffer = copy_engine.symmetric_buffer = _shared_symmetric_buffer
        dist.barrier, dist.all_gather_into_tensor = _gloo_barrier, _all_gather_through_host
        if hasattr(dist, "all_gather_single"):  # the name the transports call where torch has it (2.13)
            dist.all_gather_single = _all_gather_through_host
        results.put((rank, "ready", None))
        value = fn(rank, world_size, dist.group.WORLD, *args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except BaseException:
        results.put((rank, "failed", traceback.format_exc()))
        return
    results.put((rank, "done", value))
    try:  # no rank unmaps its peers' buffers (by ending) while a peer may still write them
        _SHARING["barrier"]()
    except RuntimeError:  # a peer that never comes here: the parent reports it (its result is missing)
        pass


STARTUP_S = 120.0  # how long `run_ranks_on_one_gpu` waits for its processes to start and join their group
AFTER_FAILURE_S = 60.0  # how long it waits for the other ranks once one has failed (their bounded waits give up)


def run_ranks_on_one_gpu(world_size: int, fn: Callable, *args, timeout_s: float = 300.0) -> List[Any]:
    """
    Run ``fn(rank, world_size, group, *args)`` in ``world_size`` spawned processes that all use GPU 0, ``group``
    their gloo process group (the world); returns the results by rank. A rank that raises or exits, or ranks that
    do not return within ``timeout_s`` of the last one joining the group (joining may take `STARTUP_S`; after a
    rank has failed, the others get at most `AFTER_FAILURE_S` more), fail the run (`AssertionError` with every
    failing rank's traceback, or what was missing) and every rank is ended. ``fn`` must be a module-level function.

    For testing the device transports (`NvlinkTransport`, `CopyEngineTransport`) with more ranks than there are
    GPUs: in these processes their symmetric buffers are plain allocations that the ranks map through CUDA IPC, and
    their `torch.distributed.barrier` / `all_gather_into_tensor` (`all_gather_single`) go through gloo (whose waits
    give up after ``timeout_s``). Their kernels, flags and bounded waits are those of one rank per GPU; every peer
    access stays on the one GPU (no NVLink), and the ranks' kernels run time-sliced between the processes (one
    context each), not side by side, so a run is slow.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    ctx = context()
    inboxes = [ctx.Queue() for _ in range(world_size)]
    results = ctx.Queue()
    port = free_port()
    processes = [ctx.Process(target=_one_gpu_rank, args=(rank, world_size, port, timeout_s, inboxes, results, fn,
                                                         args), daemon=True) for rank in range(world_size)]
    for p in processes:
        p.start()
    deadline = time.monotonic() + STARTUP_S
    ready: set = set()
    outcomes: Dict[int, Any] = {}
    failures: Dict[Any, str] = {}
    waited = f"did not join the group within {STARTUP_S} s"
    try:
        while len(outcomes) + len(failures) < world_size:
            try:
                rank, kind, value = results.get(timeout=0.5)
            except queue.Empty:
                now = time.monotonic()
                for r, p in enumerate(processes):  # a rank that ended without a word: it will send none
                    if p.exitcode is not None and r not in outcomes and r not in failures:
                        failures[r] = f"the process ended with exit code {p.exitcode} and no result"
                if now > deadline and len(outcomes) + len(failures) < world_size:
                    missing = sorted(set(range(world_size)) - set(outcomes) - set(failures))
                    failures["timeout"] = f"ranks {missing} {waited}"
                    break
                continue
            if kind == "ready":
                ready.add(rank)
                if len(ready) == world_size and not failures:  # (after a failure its shorter wait stands)
                    deadline = time.monotonic() + timeout_s
                    waited = f"did not return within {timeout_s} s"
            elif kind == "done":
                outcomes[rank] = value
            else:
                failures[rank] = value
                if time.monotonic() + AFTER_FAILURE_S < deadline:
                    deadline = time.monotonic() + AFTER_FAILURE_S
                    waited = f"did not return within {AFTER_FAILURE_S} s of rank {rank}'s failure"
    finally:
        for p in processes:
            p.join(timeout=10 if not failures else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise AssertionError(f"{getattr(fn, '__name__', fn)} on {world_size} ranks sharing one GPU failed:\n"
                             + "\n".join(f"--- {'rank ' + str(k) if isinstance(k, int) else k} ---\n{text}"
                                         for k, text in sorted(failures.items(), key=lambda kv: str(kv[0]))))
    return [outcomes[r] for r in range(world_size)]
