"""FP8 (e4m3) block quantization in DeepSeek-V3's layout.

Activations are quantized in 1x128 tiles (one fp32 scale per 128 consecutive values of a row), weights in
128x128 blocks. A scale is ``amax / 448`` (448 is e4m3's largest finite value), with ``amax`` clamped to at least
``AMAX_FLOOR`` so that an all-zero tile gets a finite, non-zero scale; ``x_fp8 * scale`` recovers ``x``.
This is the convention of DeepEP and DeepGEMM (``per_token_cast_to_fp8`` / ``per_block_cast_to_fp8``):
scales of a ``[tokens, hidden]`` activation have shape ``[tokens, hidden // 128]`` and dtype ``torch.float32``.
Inputs are meant to be finite: a tile holding a NaN gets a NaN scale, one holding an infinity an infinite scale, and
every value of such a tile dequantizes to NaN (in the torch reference and the Triton kernels alike).

``quantize_1x128`` and the other plain functions are the torch reference (any device);
``quantize_1x128_triton`` is the same computation as one Triton kernel, for CUDA tensors.
"""

from typing import Tuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_MAX = 448.0
BLOCK = 128
AMAX_FLOOR = 1e-4


def _check_output_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise ValueError(f"dtype: expected a floating-point dtype of 16 bits or more, got {dtype}")


def _check_1x128_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"x: expected a bfloat16/float16/float32 tensor, got {x.dtype}")
    if x.dim() < 1 or x.size(-1) % BLOCK != 0:
        raise ValueError(f"x: the last dimension must be a multiple of {BLOCK}, got shape {tuple(x.shape)}")


def quantize_1x128(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """
    Quantize activations to e4m3 with one fp32 scale per 128 consecutive values of the last dimension.

    Arguments:
        x: `[..., hidden]` floating-point tensor, `hidden` a multiple of 128.

    Returns:
        x_fp8: `[..., hidden]` with `torch.float8_e4m3fn`.
        scales: `[..., hidden // 128]` with `torch.float32`; `x ~= x_fp8.float() * scales` repeated over each tile.

    A tile (128 values) holding inf or NaN gets an inf or NaN scale: all of its values dequantize to NaN.
    """
    _check_1x128_input(x)
    tiles = x.float().unflatten(-1, (x.size(-1) // BLOCK, BLOCK))
    amax = tiles.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR)
    # tensor / tensor divisions: IEEE-rounded on every device (torch turns `scalar / t` into
    # `t.reciprocal() * scalar` and `t / scalar` into a multiplication), so the Triton kernels can
    # reproduce this bit for bit
    fp8_max = torch.full_like(amax, FP8_MAX)
    x_fp8 = (tiles * torch.div(fp8_max, amax)).to(FP8_DTYPE).flatten(-2)
    return x_fp8, torch.div(amax, fp8_max).squeeze(-1)


def dequantize_1x128(x_fp8: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """
    Undo `quantize_1x128`.

    Arguments:
        x_fp8: `[..., hidden]` with `torch.float8_e4m3fn`.
        scales: `[..., hidden // 128]` with `torch.float32`.
        dtype: the dtype of the result (bfloat16, float16, float32 or float64).

    Returns:
        x: `[..., hidden]` with `dtype`, computed in fp32 as `x_fp8 * scale` and then cast.
    """
    if not isinstance(x_fp8, torch.Tensor) or x_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"x_fp8: expected a {FP8_DTYPE} tensor, got {getattr(x_fp8, 'dtype', type(x_fp8).__name__)}")
    if not isinstance(scales, torch.Tensor):
        raise ValueError(f"scales: expected a torch.Tensor, got {type(scales).__name__}")
    _check_output_dtype(dtype)
    if x_fp8.dim() < 1 or x_fp8.size(-1) % BLOCK != 0:
        raise ValueError(f"x_fp8: the last dimension must be a multiple of {BLOCK}, got {tuple(x_fp8.shape)}")
    expected = (*x_fp8.shape[:-1], x_fp8.size(-1) // BLOCK)
    if scales.dtype != torch.float32 or tuple(scales.shape) != expected:
        raise ValueError(f"scales: expected float32 of shape {expected}, got {scales.dtype} {tuple(scales.shape)}")
    tiles = x_fp8.float().unflatten(-1, (x_fp8.size(-1) // BLOCK, BLOCK))
    return (tiles * scales.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_128x128(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """
    Quantize a weight matrix to e4m3 with one fp32 scale per 128x128 block.

    Arguments:
        w: `[m, n]` floating-point tensor; `m` and `n` need not be multiples of 128 (edge blocks are partial).

    Returns:
        w_fp8: `[m, n]` with `torch.float8_e4m3fn`.
        scales: `[ceil(m / 128), ceil(n / 128)]` with `torch.float32`.
    """
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"w: expected a 2-D tensor, got {getattr(w, 'shape', type(w).__name__)}")
    if not w.is_floating_point() or w.dtype == FP8_DTYPE:
        raise ValueError(f"w: expected a bfloat16/float16/float32 tensor, got {w.dtype}")
    m, n = w.shape
    mb, nb = -(-m // BLOCK), -(-n // BLOCK)
    padded = torch.zeros(mb * BLOCK, nb * BLOCK, dtype=torch.float32, device=w.device)
    padded[:m, :n] = w.float()
    blocks = padded.view(mb, BLOCK, nb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR)
    w_fp8 = (blocks * (FP8_MAX / amax)).to(FP8_DTYPE).view(mb * BLOCK, nb * BLOCK)[:m, :n].contiguous()
    return w_fp8, (amax / FP8_MAX).view(mb, nb)


def dequantize_128x128(w_fp8: torch.Tensor, scales: torch.Tensor,
                       dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """
    Undo `quantize_128x128`.

    Arguments:
        w_fp8: `[m, n]` with `torch.float8_e4m3fn`.
        scales: `[ceil(m / 128), ceil(n / 128)]` with `torch.float32`.
        dtype: the dtype of the result (bfloat16, float16, float32 or float64).

    Returns:
        w: `[m, n]` with `dtype`.
    """
    if not isinstance(w_fp8, torch.Tensor) or w_fp8.dtype != FP8_DTYPE or w_fp8.dim() != 2:
        raise ValueError(f"w_fp8: expected a 2-D {FP8_DTYPE} tensor, got "
                         f"{getattr(w_fp8, 'dtype', type(w_fp8).__name__)} {tuple(getattr(w_fp8, 'shape', ()))}")
    if not isinstance(scales, torch.Tensor):
        raise ValueError(f"scales: expected a torch.Tensor, got {type(scales).__name__}")
    _check_output_dtype(dtype)
    m, n = w_fp8.shape
    expected = (-(-m // BLOCK), -(-n // BLOCK))
    if scales.dtype != torch.float32 or tuple(scales.shape) != expected:
        raise ValueError(f"scales: expected float32 of shape {expected}, got {scales.dtype} {tuple(scales.shape)}")
    full_scales = scales.repeat_interleave(BLOCK, 0)[:m].repeat_interleave(BLOCK, 1)[:, :n]
    return (w_fp8.float() * full_scales).to(dtype)


try:
    import triton
    import triton.language as tl

    from smsplit import ptx
except ImportError:  # CPU-only installs without Triton use the torch reference everywhere
    triton = None

if triton is not None:
    @triton.jit
    def _max_keeping_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _e4m3_scales(amax):
        """The multiplier (448 / amax) and the scale (amax / 448) of groups whose largest magnitude is ``amax``
        (fp32): amax floored at 1e-4 (a NaN kept), IEEE divisions (Triton's `/` on fp32 is approximate)."""
        amax = tl.maximum(amax, 1e-4, propagate_nan=tl.PropagateNan.ALL)
        fp8_max = tl.full(amax.shape, 448.0, tl.float32)
        return tl.math.div_rn(fp8_max, amax), tl.math.div_rn(amax, fp8_max)

    @triton.jit
    def quantize_e4m3_groups(x, axis: tl.constexpr):
        """FP8 e4m3 values and fp32 scales of fp32 ``x``, one scale per slice along ``axis`` (`_e4m3_scales`: a
        group holding a NaN gets a NaN scale), bit-identical to the torch reference `quantize_1x128`; for every
        kernel that quantizes fp32 values (this module's, and the EP dispatch for non-bf16 x).
        `quantize_e4m3_bf16_vector_pairs` is the same on packed bf16."""
        inv, scale = _e4m3_scales(tl.reduce(tl.abs(x), axis, _max_keeping_nan))
        return (x * tl.expand_dims(inv, axis)).to(tl.float8e4nv), scale

    @triton.jit
    def e4m3_v4_words(q, ROWS: tl.constexpr, GROUPS: tl.constexpr):
        """The bytes of e4m3 ``q`` (``[ROWS, GROUPS, 128]``) as the four int32 words of each 16-byte vector:
        ``(w0, w1, w2, w3)``, each ``[ROWS, GROUPS * 8]``, vector ``v`` of a row holding bytes ``16 v .. 16 v + 15``
        (little-endian words), ready for one 16-byte store per vector (``smsplit.ptx.st_global_na_v4``) where a
        store of fp8 elements through a computed address would be one byte at a time."""
        v0, v1 = e4m3_v2_words(q, ROWS, GROUPS)  # 8-byte vectors 2 v and 2 v + 1 make vector v
        w0, w2 = tl.split(tl.reshape(v0, (ROWS, GROUPS * 8, 2)))
        w1, w3 = tl.split(tl.reshape(v1, (ROWS, GROUPS * 8, 2)))
        return w0, w1, w2, w3

    @triton.jit
    def e4m3_v2_words(q, ROWS: tl.constexpr, GROUPS: tl.constexpr):
        """The bytes of e4m3 ``q`` (``[ROWS, GROUPS, 128]``) as the two int32 words of each 8-byte vector:
        ``(w0, w1)``, each ``[ROWS, GROUPS * 16]``, vector ``v`` of a row holding bytes ``8 v .. 8 v + 7``."""
        b = tl.reshape(q.to(tl.uint8, bitcast=True).to(tl.int32), (ROWS, GROUPS * 16, 2, 2, 2))
        even, odd = tl.split(b)  # byte 0/2 of each word, byte 1/3
        b0, b2 = tl.split(even)
        b1, b3 = tl.split(odd)
        words = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)  # [ROWS, V, 2]
        w0, w1 = tl.split(words)
        return w0, w1

    @triton.jit
    def quantize_e4m3_bf16_vector_pairs(a0, a1, a2, a3, b0, b1, b2, b3):
        """`quantize_e4m3_groups` for bf16 values as 16-byte loads hold them, two vectors of a group per thread:
        ``a0..a3`` and ``b0..b3`` (``[ROWS, GROUPS, 8]`` each, two values per word; the 8 threads of a group hold
        its 16 vectors, in any order), quantized on packed words (`smsplit.ptx.bf16x8_absmax_bits`,
        `smsplit.ptx.e4m3x4_from_bf16x4`) with the same math, bit for bit. Two vectors per thread, not one: half
        the threads meet in each group's maximum (3 shuffle steps instead of 4, one division per 16 values instead
        of 8). Returns the four int32 words of the thread's 16 e4m3 values (``[ROWS, GROUPS, 8]`` each: two from
        ``a``'s 8 values, then two from ``b``'s, bytes in the values' order) and the scales (``[ROWS, GROUPS]``).
        A NaN in a group makes its scale NaN, as in the torch reference."""
        bits = tl.maximum(ptx.bf16x8_absmax_bits(a0, a1, a2, a3), ptx.bf16x8_absmax_bits(b0, b1, b2, b3))
        inv, scale = _e4m3_scales(tl.max(bits, axis=2).to(tl.float32, bitcast=True))
        inv = inv[:, :, None]
        return (ptx.e4m3x4_from_bf16x4(a0, a1, inv), ptx.e4m3x4_from_bf16x4(a2, a3, inv),
                ptx.e4m3x4_from_bf16x4(b0, b1, inv), ptx.e4m3x4_from_bf16x4(b2, b3, inv), scale)

    @triton.jit
    def quantize_1x128_kernel(x_ptr, x_fp8_ptr, scales_ptr, num_rows, hidden,
                              BLOCK_ROWS: tl.constexpr, TILE: tl.constexpr):
        # Program (i, j) quantizes tile column j of rows [i * BLOCK_ROWS, (i + 1) * BLOCK_ROWS).
        row_block = tl.program_id(0)
        tile = tl.program_id(1)
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tile * TILE + tl.arange(0, TILE)
        row_ok = rows < num_rows
        offsets = rows.to(tl.int64)[:, None] * hidden + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=row_ok[:, None], other=0.0).to(tl.float32)
        x_fp8, scale = quantize_e4m3_groups(x, 1)
        tl.store(x_fp8_ptr + offsets, x_fp8, mask=row_ok[:, None])
        tl.store(scales_ptr + rows.to(tl.int64) * (hidden // TILE) + tile, scale, mask=row_ok)


QUANTIZE_BLOCK_ROWS = 16


def quantize_1x128_triton(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """
    `quantize_1x128` as one Triton kernel launch (CUDA tensors; needs a GPU with FP8 support, sm_89+).

    Arguments:
        x: `[..., hidden]` bfloat16/float16/float32 CUDA tensor, `hidden` a multiple of 128.

    Returns:
        x_fp8, scales: as `quantize_1x128`.
    """
    if triton is None:
        raise RuntimeError("quantize_1x128_triton needs Triton; use quantize_1x128")
    _check_1x128_input(x)
    if not x.is_cuda:
        raise ValueError(f"x: quantize_1x128_triton runs on CUDA tensors, got one on {x.device} (use quantize_1x128)")
    x2d = x.reshape(-1, x.size(-1)).contiguous()
    num_rows, hidden = x2d.shape
    x_fp8 = torch.empty(x2d.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(num_rows, hidden // BLOCK, dtype=torch.float32, device=x.device)
    if num_rows > 0:
        grid = (triton.cdiv(num_rows, QUANTIZE_BLOCK_ROWS), hidden // BLOCK)
        with torch.cuda.device(x.device):  # Triton launches on the current device, which may not be x's
            quantize_1x128_kernel[grid](x2d, x_fp8, scales, num_rows, hidden,
                                        BLOCK_ROWS=QUANTIZE_BLOCK_ROWS, TILE=BLOCK)
    return x_fp8.view(x.shape), scales.view(*x.shape[:-1], hidden // BLOCK)


def quantize_activations(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """`quantize_1x128_triton` for CUDA tensors, `quantize_1x128` elsewhere."""
    _check_1x128_input(x)
    if x.is_cuda and triton is not None:
        return quantize_1x128_triton(x)
    return quantize_1x128(x)
