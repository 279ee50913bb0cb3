"""A mixture-of-experts layer over expert parallelism with `smsplit.ep.Buffer`, checked against the same layer
computed densely on each rank.

    python examples/ep_moe_layer.py                          # 2 gloo processes on the CPU (reference backend)
    python examples/ep_moe_layer.py --ranks 4
    python examples/ep_moe_layer.py --device cuda --backend nvlink    # one process per GPU, NCCL
    torchrun --nproc-per-node 2 examples/ep_moe_layer.py     # the same under torchrun

Every rank routes its own tokens to the top-k of `--experts` experts, dispatches them (FP8 e4m3 on the wire,
dequantized on receive), runs the experts it holds on what it received, combines the weighted outputs back to the
tokens' ranks and takes gradients through the whole layer. Each rank then computes its tokens' outputs and
gradients without communication (every expert's weights are drawn from one seed, so every rank can) and compares.
Prints one line per rank; exits with status 1 if any rank's results differ.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from smsplit.ep import Buffer
from smsplit.launch import free_port
from smsplit.fp8 import dequantize_1x128, quantize_1x128


def experts_and_gate(num_experts: int, hidden: int, device) -> tuple:
    """Every expert's weights `[E, H, H]` and the router's `[H, E]`, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(num_experts, hidden, hidden, generator=g) / hidden ** 0.5
    gate = torch.randn(hidden, num_experts, generator=g) / hidden ** 0.5
    return w.to(device), gate.to(device)


def route(x: torch.Tensor, gate: torch.Tensor, topk: int):
    """Top-k experts of each token and their softmax weights (renormalized over the k), differentiable in `gate`."""
    scores = (x.float() @ gate).softmax(dim=-1)
    weights, idx = scores.topk(topk, dim=-1)
    return idx, weights / weights.sum(dim=-1, keepdim=True)


def run_local_experts(recv_x, recv_topk_idx, recv_topk_weights, local_w):
    """Sum over this rank's experts of weight * (x @ W_e) for each received token, in fp32, cast to x's dtype."""
    # zeros that depend on every input, also when no token came here: each rank's dispatch and combine then take
    # part in the backward, which is collective (docs/ep.md, "Autograd")
    out = recv_x.float() * 0 + (local_w.sum() + recv_topk_weights.sum()) * 0
    for e in range(local_w.size(0)):
        rows, slot = (recv_topk_idx == e).nonzero(as_tuple=True)
        if rows.numel():
            y = recv_x[rows].float() @ local_w[e]
            out = out.index_add(0, rows, y * recv_topk_weights[rows, slot, None])
    return out.to(recv_x.dtype)


def moe_layer(buffer: Buffer, x, gate, local_w, num_experts: int, topk: int):
    topk_idx, topk_weights = route(x, gate, topk)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_weights, _, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights, fp8=True, dequantize=True)
    expert_out = run_local_experts(recv_x, recv_idx, recv_weights, local_w)
    combined, _, _ = buffer.combine(expert_out, handle)
    return combined


def dense_layer(x, gate, w, topk: int):
    """The same layer on one rank's tokens, without communication. The FP8 round trip of the dispatch is applied
    to the values and passed straight through in backward (as the dispatch's backward, a BF16 combine, does)."""
    x_wire = x + (dequantize_1x128(*quantize_1x128(x.detach()), dtype=x.dtype) - x).detach()
    topk_idx, topk_weights = route(x, gate, topk)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(topk):
        out = out + (x_wire.float().unsqueeze(1) @ w[topk_idx[:, k]]).squeeze(1) * topk_weights[:, k, None]
    return out.to(x.dtype)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()


def say(line: str) -> None:
    """One write per line: the ranks share the terminal (or pipe), and `print` writes the text and its newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main_rank(args) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must be a multiple of the {world} ranks")
    w, gate = experts_and_gate(args.experts, args.hidden, device)
    num_local = args.experts // world
    local_w = w[rank * num_local:(rank + 1) * num_local].clone().requires_grad_()
    gate = gate.requires_grad_()

    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(device, torch.bfloat16).requires_grad_()
    upstream = torch.randn(args.tokens, args.hidden, generator=g).to(device, torch.bfloat16)

    size = Buffer.get_buffer_size_hint(args.tokens, args.hidden, world, args.topk, fp8=True, backend=args.backend)
    buffer = Buffer(dist.group.WORLD, num_nvl_bytes=size, backend=args.backend)
    out = moe_layer(buffer, x, gate, local_w, args.experts, args.topk)
    out.backward(upstream)

    x_ref = x.detach().clone().requires_grad_()
    gate_ref = gate.detach().clone().requires_grad_()
    w_ref = w.clone().requires_grad_()
    out_ref = dense_layer(x_ref, gate_ref, w_ref, args.topk)
    out_ref.backward(upstream)

    # bf16 outputs and gradients (the combine casts its fp32 sums, the expert outputs travel in bf16); the router's
    # gradient comes from this rank's tokens only (their weights travel with them and back)
    errors = {"output": relative_error(out, out_ref), "x.grad": relative_error(x.grad, x_ref.grad),
              "gate.grad": relative_error(gate.grad, gate_ref.grad)}
    # an expert's weight gradient comes from every rank's tokens routed to it: the sum of the dense layers' gradients
    dist.all_reduce(w_ref.grad)
    errors["expert w.grad"] = relative_error(local_w.grad, w_ref.grad[rank * num_local:(rank + 1) * num_local])
    ok = all(e < args.tolerance for e in errors.values())
    say(f"rank {rank}/{world} ({buffer.backend} backend, {device}): "
          + ", ".join(f"{k} max error {v:.1e}" for k, v in errors.items())
          + (" OK" if ok else f" MISMATCH (tolerance {args.tolerance})"))
    buffer.destroy()
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
    parser.add_argument("--backend", default="auto",
                        choices=["auto", "reference", "nvlink", "nvlink_copy_engine", "copy_engine"])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=256, help="a multiple of 128 (FP8 scales one per 128 values)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=1.5e-2, help="largest error relative to the largest value")
    args = parser.parse_args()
    if args.device == "cpu" and args.backend not in ("auto", "reference"):
        parser.error(f"--backend {args.backend} needs --device cuda")
    if args.ranks < 1 or args.tokens < 1 or args.experts < 1:
        parser.error("--ranks, --tokens and --experts must be at least 1")
    if args.hidden < 128 or args.hidden % 128:
        parser.error(f"--hidden {args.hidden}: a multiple of 128 (FP8 scales one per 128 values)")
    if not 1 <= args.topk <= args.experts:
        parser.error(f"--topk {args.topk}: between 1 and --experts ({args.experts})")
    if "RANK" not in os.environ and args.experts % args.ranks:
        parser.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
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
