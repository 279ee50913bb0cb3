"""The copy-engine transport's SM kernels alone on one GPU (no peer, flags preset): pack and reduce time for
several chunk counts and program counts, next to a plain SM copy of the same bytes (diagnosis).

    python3 bench/ep_kernels.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from smsplit.copy import sm_copy
from smsplit.ep import copy_engine as ce
from smsplit.ep.nvlink import _pow2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_ms  # noqa: E402


def median_us(fn, reps=20):
    return time_ms(fn, warmup=3, repeat=reps)["median_ms"] * 1e3


def main():
    dev = torch.device("cuda", 0)
    T, H, K, R, M = 4096, 7168, 8, 2, 4096
    G = H // 128
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    topk = torch.randint(0, 256, (T, K), generator=g).to(dev)
    in_rank = torch.rand(T, R, generator=g).to(dev) < 0.99
    pos = torch.where(in_rank, torch.cumsum(in_rank.int(), 0, dtype=torch.int32) - 1, -1).contiguous()
    offsets, total = {}, 0
    for name, size in ce._region_bytes(R, M, H, K, 8).items():
        offsets[name] = total
        total += (size + 255) // 256 * 256
    buf = torch.zeros(total, dtype=torch.uint8, device=dev)
    bases = torch.tensor([buf.data_ptr()] * R, dtype=torch.int64, device=dev)
    done = torch.zeros(16, dtype=torch.int32, device=dev)
    status = torch.zeros(4, dtype=torch.int32, pin_memory=True)
    rows = int(in_rank.sum())
    recv_x = torch.empty(2 * T, H, dtype=torch.bfloat16, device=dev)
    recv_src = torch.empty(2 * T, dtype=torch.int32, device=dev)
    recv_topk = torch.empty(2 * T, K, dtype=torch.int64, device=dev)
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    y = torch.randn(2 * T, H, generator=g).to(dev, torch.bfloat16)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    buf[offsets["combine_ready"]:offsets["combine_ready"] + R * 64 * 4].view(torch.int32).fill_(1 << 30)
    tmp = torch.empty_like(x)
    print(f"{rows} rows per destination; bytes of x {x.numel() * 2 / 1e6:.1f} MB", flush=True)
    for P in (20, 32):
        print(f"P={P}: sm_copy x {median_us(lambda: sm_copy(tmp, x, P)):.1f} us; "
              f"4096x16 {median_us(lambda: sm_copy(tmp, x, P, block=4096, num_warps=16)):.1f} us", flush=True)
        for NC in (1, 4, 8):
            chunk = -(-T // NC)
            for warps, TB in ((8, 4), (16, 4), (8, 2)):
                def pack():
                    ce.pack_kernel[(P,)](
                        x.view(torch.uint8).view(torch.int32), dummy, topk, dummy, pos, bases, done, buf, recv_x,
                        dummy, recv_topk, dummy, recv_src, T, H, K, R, 0, M, NC, chunk, 0, 128, 1,
                        offsets["sx"], offsets["ss"], offsets["stopk"], offsets["sw"], offsets["ssrc"],
                        offsets["ready"], X_BYTES=2, QUANTIZE=False, HAS_SCALES=False, HAS_TOPK=True,
                        HAS_WEIGHTS=False, VEC=_pow2(H * 2 // 16), GROUPS=_pow2(G), KP=_pow2(K), RP=2, TB=TB,
                        TRACE=False, trace_ptr=recv_src, trace_tag=0, num_warps=warps)
                print(f"  pack NC={NC} warps={warps} TB={TB}: {median_us(pack):.1f} us", flush=True)
            for warps, TB in ((16, 2), (8, 2), (16, 4)):
                def reduce():
                    ce.reduce_kernel[(P,)](
                        y, out, pos, bases, done[15:], status.data_ptr(), done[14:], buf, out, out, T, H, 1, R, 0, M, NC,
                        chunk, 0, 1, offsets["cx"], offsets["cw"], offsets["combine_ready"],
                        offsets["combine_ack"] + 64, int(1e9), HB=_pow2(H), KP=1, RP=2, TB=TB, HAS_WEIGHTS=False,
                        TRACE=False, trace_ptr=out, trace_tag=0, num_warps=warps)
                print(f"  reduce NC={NC} warps={warps} TB={TB}: {median_us(reduce):.1f} us  status {status.tolist()}",
                      flush=True)


if __name__ == "__main__":
    main()
