"""Session 33, one GPU, a one-rank NCCL group: what the host spends on an eager cached Buffer call, by function's own
time (cProfile, sorted by tottime), and what the primitives an eager call uses cost on this host (medians of 2000
calls, host time only).

    PYTHONPATH=src python3 bench/device/session33_profile.py
"""
import cProfile
import dataclasses
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, "bench")
from common import routed_tokens  # noqa: E402

from smsplit.ep import Buffer  # noqa: E402


def host_us(fn, n=2000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if i % 200 == 199:
            torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def enter_stream(s):
    with torch.cuda.stream(s):
        pass


def primitives():
    from triton.runtime import driver
    dev = torch.device("cuda", 0)
    s = torch.cuda.Stream()
    e = torch.cuda.Event()
    x = torch.empty(4096, 7168, dtype=torch.bfloat16, device=dev)
    small = torch.empty(64, device=dev)

    @dataclasses.dataclass
    class D:
        a: int = 0
        b: int = 0
        c: int = 0
        d: int = 0
    d = D()
    steps = {
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "torch.cuda.current_stream(device)": lambda: torch.cuda.current_stream(dev),
        "torch.cuda.current_stream(0)": lambda: torch.cuda.current_stream(0),
        "driver.active.get_current_stream(0)": lambda: driver.active.get_current_stream(0),
        "torch.cuda.current_device()": lambda: torch.cuda.current_device(),
        "torch.cuda.Event()": lambda: torch.cuda.Event(),
        "event.record()": lambda: e.record(),
        "event.record(stream)": lambda: e.record(s),
        "stream.record_event()": lambda: s.record_event(),
        "stream.wait_event(e)": lambda: s.wait_event(e),
        "with torch.cuda.stream(s): pass": lambda: enter_stream(s),
        "is_current_stream_capturing": lambda: torch.cuda.is_current_stream_capturing(),
        "torch.empty(64)": lambda: torch.empty(64, device=dev),
        "torch.empty(4096 x 7168)": lambda: torch.empty(4096, 7168, dtype=torch.bfloat16, device=dev),
        "x.clone() 56 MiB": lambda: x.clone(),
        "small.clone()": lambda: small.clone(),
        "x[:4000]": lambda: x[:4000],
        "x.is_contiguous()": lambda: x.is_contiguous(),
        "x.data_ptr()": lambda: x.data_ptr(),
        "x.view(uint8).view(int32)": lambda: x.view(torch.uint8).view(torch.int32),
        "increment_version": lambda: torch.autograd.graph.increment_version(x),
        "dataclasses.replace": lambda: dataclasses.replace(d, a=1),
        "torch.is_grad_enabled()": lambda: torch.is_grad_enabled(),
        "x.device == dev": lambda: x.device == dev,
        "x.device": lambda: x.device,
        "x.dtype": lambda: x.dtype,
        "x.shape": lambda: x.shape,
        "x.size(1)": lambda: x.size(1),
    }
    for name, fn in steps.items():
        print(f"{name:40s} {host_us(fn):8.2f} us", flush=True)


def profile_calls():
    dev = torch.device("cuda", 0)
    T, H, E, K = 4096, 7168, 256, 8
    x, topk, w, in_rank, g = routed_tokens(0, 1, dev, T, H, E, K)
    for backend in ("nvlink", "nvlink_copy_engine"):
        buf = Buffer(dist.group.WORLD, num_nvl_bytes=Buffer.get_buffer_size_hint(T, H, 1, K, backend=backend),
                     num_sms=20, backend=backend, timeout_s=60)
        per_rank, _, per_expert, in_rank_b, _ = buf.get_dispatch_layout(topk, E)
        recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank_b,
                                                num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w)
        torch.cuda.synchronize()
        for name, fn in (("dispatch", lambda: buf.dispatch(x, handle=handle)),
                         ("combine", lambda: buf.combine(recv, handle))):
            print(f"{backend} {name}: host {host_us(fn, 200):.1f} us a call (median of 200)", flush=True)
            prof = cProfile.Profile()
            prof.enable()
            for i in range(200):
                fn()
                if i % 20 == 19:
                    torch.cuda.synchronize()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(32)
            print(f"--- {backend} {name}: 200 calls by own time\n" + "\n".join(out.getvalue().splitlines()[6:45]),
                  flush=True)
        buf = handle = recv = None
        torch.cuda.synchronize()


if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29535")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    primitives()
    profile_calls()
    dist.destroy_process_group()
