"""Run by test_fp8.py under TRITON_INTERPRET=1 (Triton's CPU interpreter): the dispatch's chunked quantization
(`smsplit.ep.nvlink.quantize_chunk`: 8-byte vectors of e4m3 bytes, vector 16 * g0 + j of a row) puts every byte
where the row's own quantized bytes are, for rows cut into chunks with a partial last one. The interpreter rounds
fp32 -> e4m3 its own way, so the bytes are compared with its own quantization; the scales with the reference."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from smsplit.ep.nvlink import quantize_chunk  # noqa: E402
from smsplit.fp8 import quantize_1x128, quantize_e4m3_groups  # noqa: E402


@triton.jit
def chunked_rows(x_ptr, w_ptr, q_ptr, s_ptr, T, H: tl.constexpr, TB: tl.constexpr, QG: tl.constexpr):
    t = tl.program_id(0) * TB + tl.arange(0, TB)
    t64 = t.to(tl.int64)[:, None]
    n_groups = H // 128
    for g0 in tl.static_range(0, H // 128, QG):
        w0, w1, scale = quantize_chunk(x_ptr, t64, t < T, g0, H, QG, TB)
        v = 16 * g0 + tl.arange(0, QG * 16)[None, :]
        m = (t < T)[:, None] & (v < H // 8)
        tl.store(w_ptr + t64 * (H // 4) + 2 * v, w0, mask=m)
        tl.store(w_ptr + t64 * (H // 4) + 2 * v + 1, w1, mask=m)
        g = g0 + tl.arange(0, QG)[None, :]
        tl.store(s_ptr + t64 * n_groups + g, scale, mask=(t < T)[:, None] & (g < n_groups))
        g3 = g0 + tl.arange(0, QG)[None, :, None]
        c3 = tl.arange(0, 128)[None, None, :]
        m3 = (t < T)[:, None, None] & (g3 < n_groups)
        xf = tl.load(x_ptr + t64[:, :, None] * H + g3 * 128 + c3, mask=m3, other=0.0).to(tl.float32)
        q, _ = quantize_e4m3_groups(xf, 2)
        tl.store(q_ptr + t64[:, :, None] * H + g3 * 128 + c3, q.to(tl.uint8, bitcast=True), mask=m3)


def main():
    failures = []
    for T, H, TB, QG in [(5, 7168, 4, 8), (3, 2048, 8, 8), (7, 384, 2, 4), (4, 1152, 4, 8)]:
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T + H)).to(torch.bfloat16)
        words = torch.full((T, H // 4), -1, dtype=torch.int32)
        q = torch.zeros(T, H, dtype=torch.uint8)
        scales = torch.full((T, H // 128), -1.0)
        chunked_rows[(triton.cdiv(T, TB),)](x, words, q, scales, T, H=H, TB=TB, QG=QG)
        if not torch.equal(words.view(torch.uint8), q):
            failures.append(f"bytes T={T} H={H} TB={TB} QG={QG}")
        if not torch.equal(scales, quantize_1x128(x)[1]):
            failures.append(f"scales T={T} H={H} TB={TB} QG={QG}")
    print("failures:", failures)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
