"""One GPU, a one-rank NCCL group: where an eager cached call's host time goes (no profiler; medians of 50 calls,
each timed on the host only): the Buffer call, the transport call it makes, and a Triton launch of a kernel with
as many arguments as the dispatch kernel.

    PYTHONPATH=src python3 bench/device/session32_host_probe.py
"""
import inspect
import os
import sys
import time

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, "bench")
from common import routed_tokens  # noqa: E402

from smsplit.ep import Buffer  # noqa: E402
from smsplit.ep import nvlink  # noqa: E402


@triton.jit
def many_args_kernel(p0, p1, p2, p3, p4, p5, p6, p7, i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13,
                     i14, i15, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(p0 + offs, tl.load(p1 + offs) + i0)


def host_us(fn, n=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) % 10 == 0:
            torch.cuda.synchronize()  # (keep the queue short: the host, not a full queue, is timed)
    times.sort()
    return times[n // 2] * 1e6


os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
dev = torch.device("cuda", 0)
T, H, E, K = 4096, 7168, 256, 8
x, topk, w, in_rank, g = routed_tokens(0, 1, dev, T, H, E, K)
bufs = [torch.zeros(1024, device=dev) for _ in range(8)]
print(f"triton launch, 8 pointers + 16 ints: {host_us(lambda: many_args_kernel[(1,)](*bufs, *range(16), BLOCK=128)):.1f} us")
print("dispatch kernel arguments:", len(inspect.signature(nvlink.dispatch_kernel.fn).parameters)
      if hasattr(nvlink, "dispatch_kernel") else "?")
for backend in ("nvlink", "nvlink_copy_engine"):
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=Buffer.get_buffer_size_hint(T, H, 1, K, backend=backend),
                 num_sms=20, backend=backend, timeout_s=60)
    per_rank, _, per_expert, in_rank_b, _ = buf.get_dispatch_layout(topk, E)
    recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank_b,
                                            num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w)
    tr, lay = handle.nvlink_transport, handle.nvlink_layout
    rows = recv[:handle.num_recv_tokens]
    figures = {
        "Buffer.dispatch cached": host_us(lambda: buf.dispatch(x, handle=handle)),
        "transport.dispatch cached": host_us(lambda: tr.dispatch(x, None, None, None, in_rank_b, E, cached=lay)),
        "Buffer.combine": host_us(lambda: buf.combine(recv, handle)),
        "transport.combine": host_us(lambda: tr.combine(rows, None, lay)),
        "Buffer header exchange": host_us(lambda: buf._exchange(2, "probe", buf._header(2), None)),
    }
    print(backend + ": " + ", ".join(f"{k} {v:.1f} us" for k, v in figures.items()), flush=True)
    buf = handle = tr = lay = recv = rows = None
    torch.cuda.synchronize()
dist.destroy_process_group()


def split_probe():
    """Host time of each part of an eager cached Buffer dispatch / combine (methods wrapped with timers)."""
    import collections

    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    spent = collections.defaultdict(float)

    def timed(obj, name):
        real = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        setattr(obj, name, wrapper)

    for backend in ("nvlink", "nvlink_copy_engine"):
        buf = Buffer(dist.group.WORLD, num_nvl_bytes=Buffer.get_buffer_size_hint(T, H, 1, K, backend=backend),
                     num_sms=20, backend=backend, timeout_s=60)
        per_rank, _, per_expert, in_rank_b, _ = buf.get_dispatch_layout(topk, E)
        recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank_b,
                                                num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w)
        tr = handle.nvlink_transport
        for name in ("_wait_previous", "_header", "_check_dispatch", "_exchange", "_dispatch_nvlink", "_received",
                     "_finish_event", "_check_combine", "_combine_nvlink", "_call_sms"):
            timed(buf, name)
        for name in ("dispatch", "combine", "raise_if_failed"):
            timed(tr, name)
        for what, fn in (("dispatch", lambda: buf.dispatch(x, handle=handle)), ("combine", lambda: buf.combine(recv, handle))):
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            spent.clear()
            total = 0.0
            for i in range(50):
                t0 = time.perf_counter()
                fn()
                total += time.perf_counter() - t0
                if i % 10 == 9:
                    torch.cuda.synchronize()
            print(f"{backend} {what}: {total / 50 * 1e6:.1f} us a call; " + ", ".join(
                f"{k} {v / 50 * 1e6:.1f}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1])), flush=True)
        buf = handle = tr = recv = None
        torch.cuda.synchronize()
    dist.destroy_process_group()


split_probe()
