"""Session 34, one GPU, a one-rank NCCL group: an eager *uncached* Buffer dispatch (layout arguments, no handle) of
the DeepSeek-V3 shape, its host time split by phase. Each phase is a Buffer / transport function wrapped with a
timer (inclusive times, medians over the calls); two modes: "idle" (the GPU synchronized before each call, not
timed: the host's own work and the waits for this call's kernels) and "queued" (calls back to back, as a training
loop makes them: the first host read of each call also waits for the previous call's kernels).

    PYTHONPATH=src python3 bench/device/session34_uncached_phases.py [--backends nvlink nvlink_copy_engine] [--calls 30]
"""
import argparse
import collections
import functools
import inspect
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, "bench")
from common import routed_tokens  # noqa: E402

import smsplit.ep.buffer as buffer_module  # noqa: E402
import smsplit.ep.nvlink as nvlink_module  # noqa: E402
import smsplit.ep.reference as reference_module  # noqa: E402
from smsplit.ep import Buffer  # noqa: E402

spent = collections.defaultdict(float)


def timed(owner, name, label=None):
    original = getattr(owner, name)
    label = label or f"{owner.__name__}.{name}"

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - t0
    static = inspect.isclass(owner) and isinstance(inspect.getattr_static(owner, name), staticmethod)
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


PHASES = [(buffer_module.Buffer, "_check_dispatch"), (buffer_module.Buffer, "_layout_on_host"),
          (buffer_module.Buffer, "_exchange"), (reference_module.ReferenceTransport, "exchange_headers"),
          (buffer_module.Buffer, "_dispatch_nvlink"), (nvlink_module.NvlinkTransport, "dispatch"),
          (nvlink_module.NvlinkTransport, "plan"), (buffer_module.Buffer, "_received"),
          (buffer_module.Buffer, "_header"), (buffer_module.Buffer, "_fill_header")]
FUNCTIONS = [(nvlink_module, "token_positions"), (buffer_module, "rank_prefix_matrix_from_counts"),
             (buffer_module, "check_dispatch_layout"), (nvlink_module, "launch_notify")]

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="+", default=["nvlink", "nvlink_copy_engine"])
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    for owner, name in PHASES:
        timed(owner, name)
    for module, name in FUNCTIONS:
        if hasattr(module, name):
            timed(module, name, f"{module.__name__.split('.')[-1]}.{name}")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29537")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    dev = torch.device("cuda", 0)
    T, H, E, K = 4096, 7168, 256, 8
    x, topk, w, in_rank, g = routed_tokens(0, 1, dev, T, H, E, K)
    for backend in args.backends:
        buf = Buffer(dist.group.WORLD, num_nvl_bytes=Buffer.get_buffer_size_hint(T, H, 1, K, backend=backend),
                     num_sms=20, backend=backend, timeout_s=60)
        per_rank, _, per_expert, in_rank_b, _ = buf.get_dispatch_layout(topk, E)

        def call():
            return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank_b,
                                num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w)
        for _ in range(5):
            call()
        for mode in ("idle", "queued"):
            torch.cuda.synchronize()
            rows = collections.defaultdict(list)
            for _ in range(args.calls):
                if mode == "idle":
                    torch.cuda.synchronize()
                spent.clear()
                t0 = time.perf_counter()
                call()
                rows["whole call"].append(time.perf_counter() - t0)
                for label, seconds in spent.items():
                    rows[label].append(seconds)
            torch.cuda.synchronize()
            line = ", ".join(f"{label} {statistics.median(v) * 1e6:.1f}" for label, v in
                             sorted(rows.items(), key=lambda kv: -statistics.median(kv[1])))
            print(f"{backend} uncached dispatch, {mode}: us a call (medians of {args.calls}): {line}", flush=True)
        buf = None
        torch.cuda.synchronize()
    dist.destroy_process_group()
