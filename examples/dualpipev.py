"""Train a small model with the DualPipeV schedule and check every step against the same model trained without a
pipeline.

    python examples/dualpipev.py                  # 2 gloo processes on the CPU: 4 stages
    python examples/dualpipev.py --ranks 3        # 6 stages
    python examples/dualpipev.py --device cuda    # one process per GPU, NCCL
    torchrun --nproc-per-node 2 examples/dualpipev.py

Every rank builds the same 2R stages from one seed and keeps two of them: rank r holds stages r and 2R-1-r (the V).
Rank 0 feeds the micro-batches and computes the loss. Every rank also trains an unpipelined copy of the whole
model on the same batches and compares its own stages' weights after each step. Prints one line per rank; exits
with status 1 if any rank's weights differ.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from smsplit.launch import free_port
from smsplit.pipeline import DualPipeV, Linear


def make_stages(num_stages: int, width: int):
    torch.manual_seed(0)
    return [nn.Sequential(Linear(width, width), nn.GELU()) for _ in range(num_stages)]


def say(line: str) -> None:
    """One write per line: the ranks share the terminal (or pipe), and `print` writes the text and its newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main_rank(args) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    stages = [s.to(device) for s in make_stages(2 * world, args.width)]
    reference = nn.Sequential(*[s.to(device) for s in make_stages(2 * world, args.width)])  # the same weights
    mine = (stages[rank], stages[2 * world - 1 - rank])
    pipe = DualPipeV(mine, timeout_s=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=args.lr)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=args.lr)
    chunks = args.chunks or 2 * world

    def criterion(out, target):
        return nn.functional.mse_loss(out, target) / chunks  # summed over micro-batches: the batch's mean

    worst = 0.0
    for step in range(args.steps):
        g = torch.Generator().manual_seed(100 + step)  # the same batch on every rank
        x = torch.randn(args.batch, args.width, generator=g).to(device)
        y = torch.randn(args.batch, args.width, generator=g).to(device)
        opt.zero_grad()
        if rank == 0:
            loss, _ = pipe.step(x, num_chunks=chunks, labels=(y,), criterion=criterion)
            loss = loss.sum().item()
        else:
            pipe.step(num_chunks=chunks)
        opt.step()

        opt_ref.zero_grad()
        loss_ref = sum(criterion(reference(xc), yc) for xc, yc in zip(x.chunk(chunks), y.chunk(chunks)))
        loss_ref.backward()
        opt_ref.step()
        for i in (rank, 2 * world - 1 - rank):
            for p, p_ref in zip(stages[i].parameters(), reference[i].parameters()):
                worst = max(worst, (p - p_ref).abs().max().item())
        if rank == 0:
            say(f"step {step}: loss {loss:.5f} (without the pipeline {loss_ref.item():.5f})")
    ok = worst <= args.tolerance
    say(f"rank {rank}/{world}: stages {rank} and {2 * world - 1 - rank}, largest weight difference from the "
          f"unpipelined model after {args.steps} steps {worst:.1e}" + (" OK" if ok else " MISMATCH"))
    return ok


def run_rank(args, local_rank: int, **init) -> None:
    """Join the process group (``init``: `init_process_group`'s keywords beside the backend), run this rank, leave;
    exit status 1 if its check failed."""
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", **init)
    try:
        ok = main_rank(args)
    finally:
        dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


def spawned(rank: int, world: int, port: int, args) -> None:
    run_rank(args, rank, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--ranks", type=int, default=2, help="processes to start (ignored under torchrun)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=0, help="micro-batches per step (default: 2 x ranks)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args()
    if min(args.ranks, args.steps, args.batch, args.width) < 1 or args.chunks < 0:
        parser.error("--ranks, --steps, --batch and --width must be at least 1, --chunks at least 0")
    world = int(os.environ.get("WORLD_SIZE", args.ranks))
    if args.chunks and args.chunks < 2 * world:
        parser.error(f"--chunks {args.chunks}: DualPipeV with {world} ranks needs at least 2 x ranks = {2 * world}")
    chunks = args.chunks or 2 * world
    if args.batch % chunks:
        parser.error(f"--batch {args.batch}: must split into {chunks} micro-batches of equal size (--chunks)")
    if "RANK" in os.environ:  # started by torchrun
        run_rank(args, int(os.environ["LOCAL_RANK"]))
        return
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        parser.error(f"--ranks {args.ranks} needs as many GPUs; this machine has {torch.cuda.device_count()}")
    try:
        mp.spawn(spawned, args=(args.ranks, free_port(), args), nprocs=args.ranks)
    except mp.ProcessExitedException as e:
        raise SystemExit(f"rank {e.error_index} failed (exit code {e.exit_code})")


if __name__ == "__main__":
    main()
