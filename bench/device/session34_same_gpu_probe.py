"""Session 34 probe (one H200), as run the second time: can two ranks share one GPU for the multi-rank GPU tests?
(The first run made the group with init_process_group("nccl", device_id=cuda:0) and an NCCL all_gather: NCCL
refused the duplicate GPU.) A cpu:gloo,cuda:nccl group and a gloo all_gather, torch symmetric memory rendezvous on
that group, a peer write through the mapped buffer, and a 2-rank
Buffer dispatch/combine on nvlink against the reference computed locally."""
import os, sys, time, traceback
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, port, q):
    out = []
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(0)
        t = time.time()
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world)
        x = torch.full((4,), rank + 1.0)
        ys = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(ys, x)
        out.append(f"gloo all_gather ok {[y[0].item() for y in ys]} {time.time()-t:.1f}s, backend {dist.get_backend()}")
        import torch.distributed._symmetric_memory as symm_mem
        g = dist.group.WORLD
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(g.group_name)
        buf = symm_mem.empty(1024, dtype=torch.int32, device="cuda")
        h = symm_mem.rendezvous(buf, g)
        peer = h.get_buffer(1 - rank, (1024,), torch.int32)
        peer.fill_(100 + rank)
        torch.cuda.synchronize(); dist.barrier(device_ids=None) if False else dist.all_gather(ys, x); torch.cuda.synchronize()
        out.append(f"symm_mem ok, mine {buf[0].item()} (expect {100 + 1 - rank})")
        sys.path.insert(0, "src")
        from smsplit.ep import Buffer
        import smsplit.ep.buffer as B
        B.dist.get_backend = lambda group=None: "nccl"
        for backend in ("nvlink", "nvlink_copy_engine", "copy_engine"):
            t = time.time()
            b = Buffer(g, num_nvl_bytes=Buffer.get_buffer_size_hint(256, 1024, 2, 4, backend=backend),
                       num_sms=8, backend=backend, timeout_s=30)
            torch.manual_seed(rank)
            x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
            idx = torch.randint(0, 8, (256, 4), device="cuda")
            w = torch.rand(256, 4, device="cuda")
            lay = b.get_dispatch_layout(idx, 8)
            rx, ridx, rw, counts, handle, ev = b.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=lay[0],
                                                          is_token_in_rank=lay[3], num_tokens_per_expert=lay[2])
            cx, cw, ev = b.combine(rx, handle)
            torch.cuda.synchronize()
            ranks_hit = torch.stack([(idx // 4 == r).any(1) for r in range(2)], 1).sum(1, keepdim=True)
            err = (cx.float() - x.float() * ranks_hit).abs().max().item()
            out.append(f"{backend}: dispatch+combine ok, received {rx.shape[0]} rows, combine err {err:.3g}, {time.time()-t:.1f}s")
            del b
    except Exception:
        out.append("FAILED " + traceback.format_exc()[-1500:])
    q.put((rank, out))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, 2, 29611, q)) for r in range(2)]
    for p in ps: p.start()
    for _ in ps:
        r, out = q.get(timeout=240)
        print(f"rank {r}:"); [print("  ", line) for line in out]
    for p in ps: p.join(30)
