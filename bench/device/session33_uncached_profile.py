"""Session 33, one GPU, a one-rank NCCL group: where an eager *uncached* Buffer dispatch (layout arguments, no
handle) spends its host time: the call timed on the host (median of 30), then cProfile by cumulative and by own time.

    PYTHONPATH=src python3 bench/device/session33_uncached_profile.py [--no-profile]
"""
import cProfile
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

if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29536")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    dev = torch.device("cuda", 0)
    T, H, E, K = 4096, 7168, 256, 8
    x, topk, w, in_rank, g = routed_tokens(0, 1, dev, T, H, E, K)
    for backend in ("nvlink", "nvlink_copy_engine"):
        buf = Buffer(dist.group.WORLD, num_nvl_bytes=Buffer.get_buffer_size_hint(T, H, 1, K, backend=backend),
                     num_sms=20, backend=backend, timeout_s=60)
        per_rank, _, per_expert, in_rank_b, _ = buf.get_dispatch_layout(topk, E)

        def call():
            return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank_b,
                                num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w)
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        print(f"{backend} uncached dispatch: host {statistics.median(times) * 1e6:.1f} us a call (median of 30)",
              flush=True)
        for order in ("cumulative", "tottime") if "--no-profile" not in sys.argv else ():
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                call()
            torch.cuda.synchronize()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(order).print_stats(40)
            print(f"--- {backend}: 20 uncached dispatches by {order}\n" + "\n".join(out.getvalue().splitlines()[6:52]),
                  flush=True)
        buf = None
        torch.cuda.synchronize()
    dist.destroy_process_group()
