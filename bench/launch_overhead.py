"""Host time of the steps an eager NVLink dispatch / combine takes (one GPU, no peer): where the 200-450 us of host
time per eager call go (BENCHMARKS.md §2). Each step is called ``--reps`` times back to back and the host time per
call is the median of 5 such loops (``time.perf_counter``; the GPU work is queued, never waited for inside a loop):

* ``dispatch_kernel`` (50 arguments) launched through Triton's JIT (`JITFunction.run`: argument binding and
  specialization, the cache key, the launch), through `smsplit.launch.FastLaunch` (since session 33), and the
  same compiled kernel launched directly (``CompiledKernel.run`` with the bound arguments), and the pieces of the
  JIT path alone;
* ``bump_kernel`` (1 argument) through the JIT;
* a 4-byte ``cuMemcpyDtoDAsync`` through cuda-bindings (as the copy-engine steps make them), an event record, a
  stream wait, ``torch.empty``.

    PYTHONPATH=src python3 bench/launch_overhead.py

Writes bench/results/launch_overhead.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402
from fp8_stage import setup, stage_launch_args  # noqa: E402


def host_us(fn, reps):
    loops = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        loops.append((time.perf_counter() - t0) / reps * 1e6)
        torch.cuda.synchronize()
    return statistics.median(loops)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import compute_cache_key

    from smsplit.ep import nvlink
    from smsplit.ep.copy_engine import StreamOps
    from smsplit.launch import FastLaunch

    s = setup(args.tokens, 7168, 256, 8)
    T, H = s["x"].shape
    P = 20
    positional, keyword = stage_launch_args(s, 4, False)
    launch_kwargs = dict(keyword, num_warps=16)

    def jit_launch():
        nvlink.dispatch_kernel[(P,)](*positional, **launch_kwargs)

    compiled = nvlink.dispatch_kernel[(P,)](*positional, **launch_kwargs)
    torch.cuda.synchronize()
    fn = nvlink.dispatch_kernel
    device = driver.active.get_current_device()
    kernel_cache, kernel_key_cache, target, backend, binder = fn.device_caches[device]
    kw = dict(launch_kwargs, debug=fn.debug, instrumentation_mode=knobs.compilation.instrumentation_mode)
    bound_args, specialization, options = binder(*positional, **kw)
    values = list(bound_args.values())
    run = compiled.run

    fast = FastLaunch(nvlink.dispatch_kernel)

    def fast_launch():
        fast(P, *positional, **launch_kwargs)

    def direct_launch():
        stream = driver.active.get_current_stream(device)
        run(P, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)

    ops = StreamOps(torch.device("cuda"))
    src = torch.zeros(4, dtype=torch.int32, device="cuda")
    dst = torch.zeros(4, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream()
    other = torch.cuda.Stream()
    event = torch.cuda.Event()
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")

    fast_bump = FastLaunch(nvlink.bump_kernel)

    def bump():
        nvlink.bump_kernel[(1,)](counter, num_warps=1)

    steps = {
        "dispatch_kernel_jit": jit_launch,
        "dispatch_kernel_fastlaunch": fast_launch,
        "dispatch_kernel_direct": direct_launch,
        "jit_get_stream": lambda: driver.active.get_current_stream(driver.active.get_current_device()),
        "jit_binder": lambda: binder(*positional, **kw),
        "jit_cache_key": lambda: compute_cache_key(kernel_key_cache, specialization, options),
        "bump_kernel_jit": bump,
        "bump_kernel_fastlaunch": lambda: fast_bump(1, counter, num_warps=1),
        "cuMemcpyDtoDAsync_4B": lambda: ops.memcpy(stream, dst.data_ptr(), src.data_ptr(), 4),
        "event_record": lambda: event.record(stream),
        "stream_wait_stream": lambda: other.wait_stream(stream),
        "torch_empty": lambda: torch.empty(T, H, dtype=torch.bfloat16, device="cuda"),
        "current_stream": lambda: torch.cuda.current_stream(),
    }
    rows = []
    for name, step in steps.items():
        step()
        us = host_us(step, args.reps)
        rows.append({"step": name, "host_us": us})
        print(f"{name:24s} {us:8.2f} us per call", flush=True)
    write_result("launch_overhead", {"env": environment(), "reps": args.reps, "rows": rows})


if __name__ == "__main__":
    main()
