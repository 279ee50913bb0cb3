import re

import numpy as np
import pytest
import torch

import oracles
from smsplit import fp8

# Every finite e4m3 value (from the format's definition), for a brute-force nearest-value oracle independent of
# torch's cast.
_ALL_E4M3 = torch.tensor([oracles.e4m3_value(c) for c in range(256)], dtype=torch.float32)
_FINITE_E4M3 = torch.unique(_ALL_E4M3[torch.isfinite(_ALL_E4M3)])


def nearest_e4m3(values: torch.Tensor) -> torch.Tensor:
    """For each value, the set of e4m3 values at minimal distance (a tie gives two): returns (lo, hi)."""
    dist = (values.reshape(-1, 1) - _FINITE_E4M3.reshape(1, -1)).abs()
    best = dist.min(dim=1, keepdim=True).values
    is_best = dist == best
    lo = torch.where(is_best, _FINITE_E4M3, torch.inf).min(dim=1).values
    hi = torch.where(is_best, _FINITE_E4M3, -torch.inf).max(dim=1).values
    return lo.view(values.shape), hi.view(values.shape)


def loop_tile_amax(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.size(-1)).float()
    out = torch.empty(rows.size(0), rows.size(1) // 128)
    for r in range(rows.size(0)):
        for t in range(rows.size(1) // 128):
            out[r, t] = rows[r, t * 128:(t + 1) * 128].abs().max()
    return out.view(*x.shape[:-1], -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 256), (2, 3, 384), (1, 7168)])
def test_quantize_1x128_scales_and_rounding(dtype, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * torch.logspace(-3, 3, shape[-1])).to(dtype)
    x_fp8, scales = fp8.quantize_1x128(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (*shape[:-1], shape[-1] // 128)

    amax = loop_tile_amax(x).clamp(min=1e-4).double()
    # scale = amax / 448 and the multiplier 448 / amax, each correctly rounded to fp32 (computed in
    # float64, then rounded: independent of how torch lowers a division)
    torch.testing.assert_close(scales, (amax / 448.0).float(), rtol=0, atol=0)

    # Each code must be the e4m3 value nearest to x / scale (either neighbour on an exact tie).
    scaled = x.float() * (448.0 / amax).float().repeat_interleave(128, dim=-1)
    lo, hi = nearest_e4m3(scaled)
    got = x_fp8.float()
    assert bool(((got == lo) | (got == hi)).all())
    # The tile maximum maps to +-448 exactly.
    assert bool((x_fp8.float().abs().unflatten(-1, (-1, 128)).amax(-1) == 448.0).all())


def test_the_oracles_e4m3_values_and_rounding_are_torchs():
    """tests/oracles.py's table and rounding (which the EP tests compare `Buffer`'s FP8 against) agree with torch's
    float8_e4m3fn on every code and on every midpoint between neighbours (ties to even)."""
    cast = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()
    table = np.array([oracles.e4m3_value(c) for c in range(256)])
    assert np.array_equal(cast, table, equal_nan=True)
    positive = oracles.E4M3_POSITIVE
    probes = np.concatenate([positive, (positive[1:] + positive[:-1]) / 2, np.nextafter(positive, 0),
                             np.nextafter(positive, np.inf)[:-1]])
    probes = np.concatenate([probes, -probes]).astype(np.float32)
    torch_codes = torch.from_numpy(probes).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(oracles.round_to_e4m3_codes(probes.astype(np.float64)), torch_codes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_quantize_1x128_is_the_oracle_bit_for_bit(dtype):
    """Codes and scales equal tests/oracles.py's float64 reference exactly (a scale `amax * (1 / 448)` or values
    `x / scale` differ from it in the last bit often enough to show over 300 x 1024 values)."""
    torch.manual_seed(3)
    x = (torch.randn(300, 1024) * torch.logspace(-5, 3, 1024)).to(dtype)
    x[0, :128] = 0
    x_fp8, scales = fp8.quantize_1x128(x)
    ref_fp8, ref_scales = oracles.quantize_1x128(x)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(x_fp8.view(torch.uint8), ref_fp8.view(torch.uint8))
    assert torch.equal(fp8.dequantize_1x128(x_fp8, scales, dtype), oracles.dequantize_1x128(ref_fp8, ref_scales, dtype))


def test_dequantize_1x128_round_trip_error_bound():
    torch.manual_seed(1)
    x = torch.randn(9, 1024, dtype=torch.bfloat16) * 5
    x_fp8, scales = fp8.quantize_1x128(x)
    back = fp8.dequantize_1x128(x_fp8, scales, dtype=torch.float32)
    # e4m3 has 3 mantissa bits: half an ulp is 2^-4 relative; subnormals (below 2^-6) have step 2^-9 * scale.
    step = scales.repeat_interleave(128, dim=-1)
    bound = x.float().abs() * 2 ** -4 + step * 2 ** -9
    assert bool(((back - x.float()).abs() <= bound).all())
    assert fp8.dequantize_1x128(x_fp8, scales).dtype == torch.bfloat16


def test_zero_tile_has_finite_scale():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    x[1, 128:] = 1.0
    x_fp8, scales = fp8.quantize_1x128(x)
    assert bool(torch.isfinite(scales).all()) and bool((scales > 0).all())
    assert bool((x_fp8.float()[0] == 0).all())
    assert scales[1, 1].item() == pytest.approx(1.0 / 448.0)
    assert bool((fp8.dequantize_1x128(x_fp8, scales)[1] == x[1]).all())


def test_a_non_finite_value_makes_its_tile_nan_and_no_other():
    # (documented in quantize_1x128 and Buffer.dispatch's fp8: the tile's scale is inf or NaN)
    x = torch.randn(2, 384, dtype=torch.bfloat16)
    x[0, 3], x[1, 300] = float("inf"), float("nan")
    x_fp8, scales = fp8.quantize_1x128(x)
    back = fp8.dequantize_1x128(x_fp8, scales)
    nan_tiles = back.float().isnan().unflatten(-1, (3, 128)).all(-1)
    assert nan_tiles.tolist() == [[True, False, False], [False, False, True]]
    assert torch.isfinite(back[0, 128:]).all() and torch.isfinite(back[1, :256]).all()


def test_1x128_argument_errors():
    with pytest.raises(ValueError, match="x:"):
        fp8.quantize_1x128(torch.randn(4, 100))
    with pytest.raises(ValueError, match="x:"):
        fp8.quantize_1x128(torch.randint(0, 3, (4, 128)))
    x_fp8, scales = fp8.quantize_1x128(torch.randn(4, 256))
    with pytest.raises(ValueError, match="scales:"):
        fp8.dequantize_1x128(x_fp8, scales[:, :1])
    with pytest.raises(ValueError, match="x_fp8:"):
        fp8.dequantize_1x128(x_fp8.float(), scales)


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (1, 129)])
def test_quantize_128x128(shape):
    torch.manual_seed(2)
    w = torch.randn(shape, dtype=torch.bfloat16) * 0.02
    w[:64, :64] *= 1000  # one block with a much larger range than its neighbours
    w_fp8, scales = fp8.quantize_128x128(w)
    m, n = shape
    assert w_fp8.shape == w.shape and scales.shape == (-(-m // 128), -(-n // 128))
    for i in range(scales.size(0)):
        for j in range(scales.size(1)):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            amax = block.abs().max().clamp(min=1e-4)
            assert scales[i, j].item() == (amax / 448.0).item()
            lo, hi = nearest_e4m3(block * (448.0 / amax))
            got = w_fp8[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            assert bool(((got == lo) | (got == hi)).all())
    back = fp8.dequantize_128x128(w_fp8, scales, dtype=torch.float32)
    step = scales.repeat_interleave(128, 0)[:m].repeat_interleave(128, 1)[:, :n]
    assert bool(((back - w.float()).abs() <= w.float().abs() * 2 ** -4 + step * 2 ** -9).all())


def test_128x128_argument_errors():
    with pytest.raises(ValueError, match="w:"):
        fp8.quantize_128x128(torch.randn(2, 3, 4))
    w_fp8, scales = fp8.quantize_128x128(torch.randn(130, 10))
    with pytest.raises(ValueError, match="scales:"):
        fp8.dequantize_128x128(w_fp8, scales[:1])


@pytest.mark.compile
@pytest.mark.parametrize("in_type", ["*bf16", "*fp32"])
def test_triton_kernel_compiles_for_sm90(in_type):
    triton = pytest.importorskip("triton")
    source = triton.compiler.ASTSource(
        fn=fp8.quantize_1x128_kernel,
        signature={"x_ptr": in_type, "x_fp8_ptr": "*fp8e4nv", "scales_ptr": "*fp32", "num_rows": "i32",
                   "hidden": "i32", "BLOCK_ROWS": "constexpr", "TILE": "constexpr"},
        constexprs={"BLOCK_ROWS": fp8.QUANTIZE_BLOCK_ROWS, "TILE": 128})
    kernel = triton.compile(source, target=triton.backends.compiler.GPUTarget("cuda", 90, 32))
    ptx = kernel.asm["ptx"]
    assert ".target sm_90" in ptx
    assert re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)
    assert len(kernel.asm["cubin"]) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 128), (33, 7168), (4, 5, 2048), (0, 256)])
def test_triton_matches_reference_on_gpu(dtype, shape):
    torch.manual_seed(3)
    x = (torch.randn(shape, device="cuda") * 10).to(dtype)
    if x.numel():
        x.view(-1, shape[-1])[0, :128] = 0
    x_fp8, scales = fp8.quantize_1x128_triton(x)
    ref_fp8, ref_scales = fp8.quantize_1x128(x)
    assert torch.equal(x_fp8.view(torch.uint8), ref_fp8.view(torch.uint8))
    assert torch.equal(scales, ref_scales)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_reference_on_special_values_on_gpu(dtype):
    x = _special_rows(2048, "cuda").to(dtype)
    x_fp8, scales = fp8.quantize_1x128_triton(x)
    ref_fp8, ref_scales = fp8.quantize_1x128(x)
    assert torch.equal(x_fp8.view(torch.uint8), ref_fp8.view(torch.uint8))
    assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32))


_WORDS_SCRIPT = r"""
import torch, triton, triton.language as tl
from smsplit.fp8 import e4m3_v4_words

@triton.jit
def pack(q_ptr, out_ptr, ROWS: tl.constexpr, GROUPS: tl.constexpr):
    r = tl.arange(0, ROWS)[:, None, None]
    g = tl.arange(0, GROUPS)[None, :, None]
    c = tl.arange(0, 128)[None, None, :]
    w0, w1, w2, w3 = e4m3_v4_words(tl.load(q_ptr + (r * GROUPS + g) * 128 + c), ROWS, GROUPS)
    at = out_ptr + tl.arange(0, ROWS)[:, None] * GROUPS * 32 + 4 * tl.arange(0, GROUPS * 8)[None, :]
    tl.store(at, w0)
    tl.store(at + 1, w1)
    tl.store(at + 2, w2)
    tl.store(at + 3, w3)

torch.manual_seed(0)
q = torch.randint(0, 256, (4, 4 * 128), dtype=torch.uint8)
out = torch.full((4, 4 * 32), -1, dtype=torch.int32)
pack[(1,)](q.view(torch.float8_e4m3fn), out, ROWS=4, GROUPS=4)
print("EQUAL" if torch.equal(out, q.view(torch.int32)) else "DIFFERENT")
"""


@pytest.mark.compile
def test_e4m3_v4_words_are_the_bytes_of_each_vector():
    """Run the packing helper in Triton's interpreter (CPU) against torch's view of the same bytes as int32."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _WORDS_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("EQUAL"), done.stdout


def _special_rows(hidden, device):
    """bf16 rows with random values and, in their first groups, what a quantizer gets wrong: a NaN, an inf, all
    zeros, values below the amax floor, bf16 subnormals, the largest bf16, negative zeros, one large outlier."""
    torch.manual_seed(11)
    x = (torch.randn(9, hidden, device=device) * torch.logspace(-4, 4, 9, device=device)[:, None]).to(torch.bfloat16)
    specials = [float("nan"), float("inf"), 0.0, 3e-5, 1e-39, 3.38e38, -0.0, -6e4]
    for i, value in enumerate(specials):
        g = i % (hidden // 128)
        group = x[i, 128 * g:128 * (g + 1)]
        if value in (0.0, 3e-5, 1e-39, -0.0):
            group.fill_(value)
        else:
            group[5] = value
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,tokens_per_step,groups_per_step,dtype", [
    (7168, 8, 16, torch.bfloat16), (7168, 4, 8, torch.bfloat16), (2048, 16, 8, torch.bfloat16),
    (384, 2, 4, torch.bfloat16), (2048, 8, 8, torch.float32), (384, 4, 4, torch.float16)])
def test_dispatch_chunked_quantization_is_the_reference_bit_for_bit(hidden, tokens_per_step, groups_per_step, dtype):
    """`smsplit.ep.kernels.rows.quantize_chunk` (packed words, inline PTX), as the dispatch runs it, chunk by chunk with
    a masked last chunk and masked tokens, against `quantize_1x128`: every byte and every scale."""
    import triton
    import triton.language as tl

    from smsplit import ptx
    from smsplit.ep.kernels.rows import chunk_halves, load_chunk, quantize_chunk, store_chunk_scales

    @triton.jit
    def chunked_rows(x_ptr, q_ptr, s_ptr, T, H: tl.constexpr, TB: tl.constexpr, QG: tl.constexpr):
        t = tl.program_id(0) * TB + tl.arange(0, TB)
        t64 = t.to(tl.int64)[:, None]
        for g0 in range(0, H // 128, QG):
            a0, a1, a2, a3, b0, b1, b2, b3 = load_chunk(x_ptr, t64, t < T, g0, H, QG, TB)
            q0, q1, q2, q3, scale = quantize_chunk(x_ptr, t64, t < T, g0, H, a0, a1, a2, a3, b0, b1, b2, b3, QG, TB)
            lo, hi = chunk_halves(g0, QG)
            ptx.st_global_na_v2(q_ptr + t64 * (H // 4) + lo, q0, q1, (t < T)[:, None] & (lo < H // 4))
            ptx.st_global_na_v2(q_ptr + t64 * (H // 4) + hi, q2, q3, (t < T)[:, None] & (hi < H // 4))
            store_chunk_scales(s_ptr + t64 * (H // 128), g0, scale, (t < T)[:, None], H // 128, QG, TB)

    x = _special_rows(hidden, "cuda").to(dtype)  # fp32 and fp16 x: quantized as fp32 values
    words = torch.full((x.size(0) + 1, hidden // 4), -1, dtype=torch.int32, device="cuda")  # one row past the end
    scales = torch.full((x.size(0) + 1, hidden // 128), -1.0, device="cuda")
    chunked_rows[(triton.cdiv(x.size(0), tokens_per_step),)](x, words, scales, x.size(0), H=hidden,
                                                               TB=tokens_per_step, QG=groups_per_step, num_warps=16)
    ref_fp8, ref_scales = fp8.quantize_1x128(x)
    assert torch.equal(words[:-1].view(torch.uint8), ref_fp8.view(torch.uint8))
    assert torch.equal(scales[:-1].view(torch.int32), ref_scales.view(torch.int32))  # NaN scales too, bit for bit
    assert (words[-1] == -1).all() and (scales[-1] == -1).all()


def test_only_the_documented_dtypes_go_in_and_out():
    from smsplit.fp8 import dequantize_1x128, quantize_1x128

    for dtype in (torch.float64, torch.float8_e5m2, torch.int32):
        with pytest.raises(ValueError, match="x: expected a bfloat16/float16/float32"):
            quantize_1x128(torch.zeros(2, 128).to(dtype))
    q, s = quantize_1x128(torch.randn(2, 128))
    for bad in (torch.int32, torch.float8_e4m3fn, "bfloat16"):
        with pytest.raises(ValueError, match="dtype: expected a floating-point dtype"):
            dequantize_1x128(q, s, bad)
    with pytest.raises(ValueError, match="scales: expected a torch.Tensor"):
        dequantize_1x128(q, s.tolist())
    assert dequantize_1x128(q, s, torch.float64).dtype == torch.float64


def test_a_non_finite_value_spoils_only_its_own_tile():
    from smsplit.fp8 import dequantize_1x128, quantize_1x128

    x = torch.randn(2, 256)
    x[0, 5], x[1, 200] = float("inf"), float("nan")
    q, s = quantize_1x128(x)
    assert torch.isinf(s[0, 0]) and torch.isnan(s[1, 1]) and torch.isfinite(s[0, 1]) and torch.isfinite(s[1, 0])
    back = dequantize_1x128(q, s, torch.float32)
    assert torch.isnan(back[0, :128]).all() and torch.isnan(back[1, 128:]).all()
    assert torch.isfinite(back[0, 128:]).all() and torch.isfinite(back[1, :128]).all()


def test_the_triton_quantizer_refuses_a_cpu_tensor_and_quantize_activations_a_list():
    from smsplit.fp8 import quantize_1x128_triton, quantize_activations

    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        quantize_1x128_triton(torch.randn(2, 128))
    with pytest.raises(ValueError, match="x: expected a torch.Tensor"):
        quantize_activations([[0.0] * 128])


def test_dequantize_128x128_checks_its_arguments_like_dequantize_1x128():
    from smsplit.fp8 import dequantize_128x128, quantize_128x128

    q, s = quantize_128x128(torch.randn(130, 200) * 100)
    for bad in (torch.int32, torch.float8_e4m3fn, "bfloat16"):  # int32 used to truncate silently
        with pytest.raises(ValueError, match="dtype: expected a floating-point dtype"):
            dequantize_128x128(q, s, bad)
    with pytest.raises(ValueError, match="scales: expected a torch.Tensor"):
        dequantize_128x128(q, s.tolist())
    with pytest.raises(ValueError, match="w_fp8: expected a 2-D"):
        dequantize_128x128(q.tolist(), s)
    assert dequantize_128x128(q, s, torch.float64).dtype == torch.float64


@pytest.mark.gpu
@pytest.mark.multigpu
def test_the_triton_quantizer_runs_on_its_tensors_device_not_the_current_one():
    from smsplit.fp8 import quantize_1x128, quantize_1x128_triton

    x = torch.randn(64, 512, device="cuda:1", dtype=torch.bfloat16)
    with torch.cuda.device(0):
        q, s = quantize_1x128_triton(x)
    torch.cuda.synchronize(1)
    ref_q, ref_s = quantize_1x128(x)
    assert q.device == x.device and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(s, ref_s)
