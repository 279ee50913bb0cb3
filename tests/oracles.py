"""Test-side references that share no code with smsplit: FP8 1x128 quantization and the dispatch layout.

The EP tests compare what `Buffer` sends against these, not against `smsplit.fp8.quantize_1x128` (which `Buffer`
itself calls: a wrong scale or rounding there would agree with itself) or `get_dispatch_layout`.

FP8 follows the documented convention (smsplit/fp8.py, DeepEP's ``per_token_cast_to_fp8``): per 128 values of a
row, ``amax`` clamped to at least 1e-4 (as float32), scale ``amax / 448`` and multiplier ``448 / amax``, each
rounded once to float32, the value ``x * multiplier`` rounded to float32 and then to the nearest e4m3 (ties to the
even code). Everything is computed in float64 with numpy, where each of these float32 results is exact before its
one rounding: a quotient or product of two float32 numbers in float64 rounded to float32 is the correctly rounded
float32 result. The e4m3 values come from the format's definition, not from a cast.
"""

from typing import List, Tuple

import numpy as np
import torch

E4M3_MAX = 448.0
AMAX_FLOOR = float(np.float32(1e-4))
BLOCK = 128


def e4m3_value(code: int) -> float:
    """The value of e4m3fn code ``code`` (0..255): sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities,
    NaN at codes 0x7F and 0xFF."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


# the non-negative finite codes 0x00..0x7E, ascending in value as in code
E4M3_POSITIVE = np.array([e4m3_value(c) for c in range(0x7F)], dtype=np.float64)


def round_to_e4m3_codes(values: np.ndarray) -> np.ndarray:
    """Each finite float64 value's nearest e4m3 code (uint8), ties to the even code, magnitudes past 448 to 448
    (where the float32 values a tile can hold lie), the sign kept (a negative value that rounds to 0 is -0)."""
    values = np.asarray(values, dtype=np.float64)
    if not np.isfinite(values).all():
        raise ValueError("round_to_e4m3_codes: the oracle takes finite values only")
    magnitude = np.minimum(np.abs(values), E4M3_MAX)
    hi = np.searchsorted(E4M3_POSITIVE, magnitude, side="left")  # first code >= magnitude
    hi = np.minimum(hi, len(E4M3_POSITIVE) - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = magnitude - E4M3_POSITIVE[lo], E4M3_POSITIVE[hi] - magnitude
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(take_hi, hi, lo).astype(np.uint8)
    return np.where(np.signbit(values), code | 0x80, code).astype(np.uint8)


def quantize_1x128(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The reference of `smsplit.fp8.quantize_1x128` (see the module's docstring): ``x`` `[..., hidden]` finite,
    bf16/fp16/fp32, any device -> (`[..., hidden]` float8_e4m3fn, `[..., hidden // 128]` float32), on the CPU."""
    values = x.detach().cpu().float().numpy().astype(np.float64)
    if values.shape[-1] % BLOCK:
        raise ValueError("quantize_1x128 (oracle): the last dimension must be a multiple of 128")
    tiles = values.reshape(*values.shape[:-1], values.shape[-1] // BLOCK, BLOCK)
    amax = np.maximum(np.abs(tiles).max(axis=-1, initial=0.0), AMAX_FLOOR)
    scales = (amax / E4M3_MAX).astype(np.float32)
    multiplier = (E4M3_MAX / amax).astype(np.float32).astype(np.float64)
    scaled = (tiles * multiplier[..., None]).astype(np.float32).astype(np.float64)
    codes = round_to_e4m3_codes(scaled).reshape(values.shape)
    return torch.from_numpy(codes).view(torch.float8_e4m3fn), torch.from_numpy(scales)


def dequantize_1x128(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x_fp8 * scale`` per tile, rounded to float32, then cast to ``dtype`` (as `smsplit.fp8.dequantize_1x128`
    documents), on the CPU; the e4m3 values read from their codes."""
    codes = x_fp8.detach().cpu().view(torch.uint8).numpy()
    table = np.array([e4m3_value(c) for c in range(256)], dtype=np.float64)
    values = table[codes]
    tiles = values.reshape(*values.shape[:-1], values.shape[-1] // BLOCK, BLOCK)
    scale = scales.detach().cpu().numpy().astype(np.float64)[..., None]
    out = (tiles * scale).astype(np.float32).reshape(values.shape)
    return torch.from_numpy(out).to(dtype)


def fake_quantize_1x128(x: torch.Tensor, dtype: torch.dtype = None) -> torch.Tensor:
    """``dequantize_1x128(*quantize_1x128(x))`` in ``dtype`` (default ``x``'s): what a receiver of ``x`` sent as FP8
    holds after dequantizing."""
    return dequantize_1x128(*quantize_1x128(x), dtype or x.dtype)


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> Tuple[List[int], List[int],
                                                                                         List[List[bool]]]:
    """`get_dispatch_layout` by Python loops: tokens per rank, tokens per expert (a token naming an expert twice
    counts once), and whether each token goes to each rank; ids outside [0, num_experts) choose nothing."""
    local = num_experts // num_ranks
    rows = [[int(e) for e in row if 0 <= int(e) < num_experts] for row in topk_idx.tolist()]
    in_rank = [[any(e // local == r for e in row) for r in range(num_ranks)] for row in rows]
    per_rank = [sum(row[r] for row in in_rank) for r in range(num_ranks)]
    per_expert = [sum(e in row for row in rows) for e in range(num_experts)]
    return per_rank, per_expert, in_rank


def new_group_in_order(members: List[int], **kwargs):
    """A gloo process group of the global ranks `members` whose group rank i is global rank ``members[i]`` where
    this torch can make one (``new_group(sort_ranks=False)``), else sorted (torch's default order). Collective over
    the whole world. Returns (group, the global rank of each group rank, as the test expects them)."""
    import inspect

    import torch.distributed as dist

    in_order = "sort_ranks" in inspect.signature(dist.new_group).parameters
    extra = {"sort_ranks": False} if in_order else {}
    group = dist.new_group(members, backend="gloo", **extra, **kwargs)
    return group, list(members) if in_order else sorted(members)
