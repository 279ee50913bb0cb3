"""Session 35, one GPU: does CUDA's torch._grouped_mm take a weight-gradient call (2-D x 2-D, output [E, N, K]) or a
forward call when no group has a row (T = 0)? And smsplit.moe.grouped_mm's forward/backward with no tokens, with a
strided input and with an expanded gradient, against a loop of matmuls.

    PYTHONPATH=src python3 bench/device/session35_grouped_mm_probe.py
"""
import torch

from smsplit.moe.layer import GROUPED_MM_PATH, grouped_mm

dev = torch.device("cuda")
E, N, K = 4, 256, 128
for T in (0, 64):
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    g = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16)
    offs = torch.full((E,), T, dtype=torch.int32, device=dev)  # every row (if any) in the last group... cumulative
    offs[: E - 1] = torch.arange(1, E, device=dev, dtype=torch.int32) * (T // E)
    for what, call in (("forward", lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)),
                       ("weight", lambda: torch._grouped_mm(g.t(), x, offs=offs))):
        try:
            out = call()
            torch.cuda.synchronize()
            print(f"torch._grouped_mm {what} T={T}: ok, shape {tuple(out.shape)}, "
                  f"finite {bool(torch.isfinite(out.float()).all())}")
        except Exception as e:  # noqa: BLE001 - the probe's answer
            print(f"torch._grouped_mm {what} T={T}: {type(e).__name__}: {str(e)[:200]}")


def loop_ref(x, w, offs):
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(x[start:end].float() @ w[e].float().t())
        start = end
    return torch.cat(out)


for T, strided in ((0, False), (64, False), (64, True)):
    base = torch.randn(T, 2 * K, device=dev, dtype=torch.bfloat16)
    x = (base[:, ::2] if strided else base[:, :K].contiguous()).requires_grad_(True)
    w = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([T // 4, T // 2, 3 * T // 4, T], dtype=torch.int32, device=dev)
    out = grouped_mm(x, w, offs)
    out.sum().backward()  # an expanded gradient
    xr, wr = x.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    ref = loop_ref(xr, wr, offs)
    ref.sum().backward()
    ok = (torch.allclose(out.float(), ref, atol=0.5, rtol=2e-2) and torch.allclose(x.grad.float(), xr.grad, atol=0.5, rtol=2e-2)
          and torch.allclose(w.grad.float(), wr.grad, atol=0.5, rtol=2e-2))
    print(f"grouped_mm T={T} strided={strided}: out {tuple(out.shape)}, equal to the loop: {ok}")
print("GROUPED_MM_PATH", {k: v for k, v in GROUPED_MM_PATH.items()})
