"""Does copy-engine traffic over NVLink slow the SMs' combine sum? Two GPUs, DeepSeek-V3 shape (4096 tokens x 7168
bf16, 2 ranks).

In a `nvlink_copy_engine` combine the sum runs while the copy engines still move later chunks: this GPU's copy engine
reads the rows it sends back out of its memory and the peer's writes the rows that come back into it, each about
362 GB/s. `bench/combine_timeline.py` saw the sum take up to a third longer then than after the last chunk. Here the
sum kernels of `bench/combine_red.py` (the combine's own sum, 8 tokens per step as with 2 ranks, and the same in
explicit 16-byte vectors) are timed alone and while a copy-engine copy of 58.7 MB into the peer runs (every rank at
once, so rows also arrive), and, to tell the link from the memory, beside a copy of the same bytes within this GPU.
Sum: CUDA events around the kernel alone on its stream (`common.call_times_ms`), the copy queued just before on
another; median over replays, max over ranks.

    PYTHONPATH=src python3 bench/sum_beside_copy.py --programs 20 32
Writes bench/results/sum_beside_copy.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import call_times_ms, end_worker, join_nccl, max_over_ranks, run_and_write  # noqa: E402


def worker(rank, world, port, args, queue):
    dev = join_nccl(rank, world, port)
    import torch.distributed._symmetric_memory as symm_mem

    from combine_red import combine_sum_kernel, sum_kernel

    T, H = 4096, 7168
    g = torch.Generator(device="cpu").manual_seed(rank)
    keep = torch.rand(T, 2, generator=g) < 0.99
    pos = torch.stack([torch.cumsum(keep[:, c].int(), 0) - 1 for c in range(2)], 1)
    pos = torch.where(keep, pos, torch.full_like(pos, -1)).to(torch.int32).to(dev).contiguous()
    own = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    landed = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    po, pp = pos[:, 0].long(), pos[:, 1].long()
    ref = (torch.zeros(T, H, device=dev) + torch.where((po >= 0)[:, None], own[po.clamp(min=0)].float(), 0.0)
           + torch.where((pp >= 0)[:, None], landed[pp.clamp(min=0)].float(), 0.0)).to(torch.bfloat16)
    nbytes = T * H * 2
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=dev)
    handle = symm_mem.rendezvous(buf, dist.group.WORLD)
    peer_in = handle.get_buffer((rank + 1) % world, (nbytes,), torch.uint8, storage_offset=0)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).to(dev)
    local_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream(dev)
    VEC = triton.next_power_of_2(H // 8)
    sums = {"combine_sum": lambda P: combine_sum_kernel[(P,)](pos, own, landed, out, T, H, TB=8,
                                                             HB=triton.next_power_of_2(H), num_warps=16),
            "vector_sum": lambda P: sum_kernel[(P,)](pos, own.view(torch.int32), landed.view(torch.int32),
                                                     out.view(torch.int32), T, H, TB=2, VEC=VEC, num_warps=16)}
    beside = {"alone": None, "peer_copy": lambda: peer_in.copy_(src), "local_copy": lambda: local_dst.copy_(src)}
    rows = []
    for P in args.programs:
        for name, run in sums.items():
            out.view(torch.int16).fill_(-1)  # poison (bf16 NaN), then check
            run(P)
            torch.cuda.synchronize()
            equal = bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
            row = {"programs": P, "sum": name, "equal": equal}
            for what, copy in beside.items():
                def before(copy=copy):  # the GPUs idle and the ranks together, then the copy queued on its stream
                    torch.cuda.synchronize()
                    dist.barrier(device_ids=[rank])
                    if copy is not None:
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            copy()

                times = call_times_ms(lambda: run(P), warmup=args.warmup, repeat=args.reps, before=before)
                torch.cuda.synchronize()
                row[f"{what}_us"] = max_over_ranks(statistics.median(times), dev) * 1e3
            rows.append(row)
            if rank == 0:
                print(f"P={P} {name}: alone {row['alone_us']:.1f} us, beside a peer copy {row['peer_copy_us']:.1f}, "
                      f"beside a local copy {row['local_copy_us']:.1f}; equal {equal}", flush=True)
    end_worker(rank, queue, {"rows": rows})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, nargs="+", default=[20, 32])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    run_and_write("sum_beside_copy", worker, args,
                  "sum kernel time (events on its stream), max over ranks of "
                  "medians; copies started just before on a side stream")


if __name__ == "__main__":
    main()
