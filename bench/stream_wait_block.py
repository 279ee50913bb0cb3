"""Does a stream memory wait on one stream hold back a kernel queued after it on another? One GPU.

The dispatch gate's copy stream waits (``cuStreamWaitValue32``) for a word that a kernel sets. In session 15 the
staged FP8 dispatch, whose copy-stream wait was queued before the launch that sets the peer's word, hung on 2 H200,
while the BF16 path (the launch queued first) passed; the guess is that the two streams can share a hardware queue,
so that a pending wait blocks what is queued after it on the other stream. Here: a pinned host word, a wait for it
on a side stream, then a kernel on the current stream that sets it (the order of the staged path before the fix),
and the other order (the fix). A host thread sets the word itself after ``--release-ms``, so nothing hangs; the
figure is how long the wait took to pass and whether the kernel or the host released it. Run with a few
``CUDA_DEVICE_MAX_CONNECTIONS`` values (1 makes every stream share one queue).

    PYTHONPATH=src python3 bench/stream_wait_block.py
Writes bench/results/stream_wait_block.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402

from smsplit import ptx  # noqa: E402


@triton.jit
def set_word_kernel(word_addr, value, delay_ns):
    """After ``delay_ns`` on the GPU clock, store ``value`` to the int32 at address ``word_addr`` (pinned host
    memory; release, system scope)."""
    word_ptr = word_addr.to(tl.pointer_type(tl.int32))
    start = ptx.globaltimer()
    now = start
    while now - start < delay_ns:
        now = ptx.globaltimer()
    ptx.st_release_sys(word_ptr, value)


def trial(ops, side, word, kernel_first: bool, release_ms: float, kernel_delay_us: float) -> dict:
    word.zero_()
    torch.cuda.synchronize()
    released_by_host = threading.Event()

    def host_release():
        time.sleep(release_ms / 1e3)
        if word.item() == 0:  # pinned: a plain host store the GPU sees
            released_by_host.set()
            word.fill_(2)

    timer = threading.Thread(target=host_release)
    t0 = time.perf_counter()
    if kernel_first:
        set_word_kernel[(1,)](word.data_ptr(), 1, int(kernel_delay_us * 1e3), num_warps=1)
        ops.wait_geq(side, word.data_ptr(), 1)
    else:
        ops.wait_geq(side, word.data_ptr(), 1)
        set_word_kernel[(1,)](word.data_ptr(), 1, int(kernel_delay_us * 1e3), num_warps=1)
    done = side.record_event()
    timer.start()
    done.synchronize()
    passed_ms = (time.perf_counter() - t0) * 1e3
    timer.join()
    torch.cuda.synchronize()
    return {"kernel_first": kernel_first, "passed_after_ms": passed_ms, "released_by": "host" if
            released_by_host.is_set() else "kernel", "word": int(word.item())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--release-ms", type=float, default=2000.0)
    parser.add_argument("--kernel-delay-us", type=float, default=100.0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    from smsplit.ep.copy_engine import StreamOps

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ops = StreamOps(dev)
    side = torch.cuda.Stream(dev)
    word = torch.zeros(1, dtype=torch.int32).pin_memory()
    set_word_kernel[(1,)](word.data_ptr(), 0, 0, num_warps=1)  # compile
    torch.cuda.synchronize()
    rows = []
    for kernel_first in (True, False):
        for _ in range(args.reps):
            row = trial(ops, side, word, kernel_first, args.release_ms, args.kernel_delay_us)
            rows.append(row)
            print(f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')}: "
                  f"{'kernel, then the wait' if kernel_first else 'wait, then the kernel'}: passed after "
                  f"{row['passed_after_ms']:.2f} ms, released by the {row['released_by']}", flush=True)
    path = write_result("stream_wait_block", {"env": environment(), "args": vars(args), "rows": rows,
                                              "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
