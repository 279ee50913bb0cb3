"""One GPU, one-rank NCCL group: host time of eager cached Buffer calls per backend (no profiler), and a cProfile by
cumulative time for each backend's cached dispatch + combine."""
import cProfile, io, os, pstats, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, "bench")  # run from the repository root: PYTHONPATH=src python3 bench/device/session32_eager_probe.py
from common import routed_tokens
from smsplit.ep import Buffer

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
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
    for name, fn in (("dispatch", lambda: buf.dispatch(x, handle=handle)), ("combine", lambda: buf.combine(recv, handle))):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        host = []
        t_all = time.perf_counter()
        for _ in range(20):
            t0 = time.perf_counter(); fn(); host.append(time.perf_counter() - t0)
        t_host_end = time.perf_counter()
        torch.cuda.synchronize()
        t_gpu_end = time.perf_counter()
        host.sort()
        print(f"{backend} {name}: host per call median {host[10]*1e6:.0f} us (min {host[0]*1e6:.0f}, max {host[-1]*1e6:.0f}); "
              f"20 calls host {1e6*(t_host_end-t_all)/20:.0f} us/call, until GPU done {1e6*(t_gpu_end-t_all)/20:.0f} us/call", flush=True)
    prof = cProfile.Profile(); prof.enable()
    for _ in range(10):
        r, *_ = buf.dispatch(x, handle=handle); buf.combine(r, handle)
    torch.cuda.synchronize(); prof.disable()
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(28)
    print(f"--- {backend}: 10 cached dispatch + combine, by cumulative time\n" + "\n".join(s.getvalue().splitlines()[:45]), flush=True)
    buf = handle = recv = None
    torch.cuda.synchronize()
dist.destroy_process_group()
