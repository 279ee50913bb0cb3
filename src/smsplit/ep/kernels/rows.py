"""What a dispatch reads of its tokens (rows as 16-byte words, FP8 quantization in chunks, top-k, weights,
positions) and the sum of a combine, shared by the NVLink and copy-engine transports' kernels."""

import triton
import triton.language as tl

from smsplit import ptx
from smsplit.fp8 import e4m3_v2_words, e4m3_v4_words, quantize_e4m3_bf16_vector_pairs, quantize_e4m3_groups

from .common import column


@triton.jit
def sum_returned_rows(t, tmask, pos_ptr, R, rank, self_start, y_bf16, yw_ptr, cx, cw, slots, out_ptr, out_w_ptr, H, K,
                      HB: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr, TB: tl.constexpr,
                      HAS_WEIGHTS: tl.constexpr):
    """The sum of a combine, shared by both transports: for each token of ``t`` (``[TB]``, ``tmask``), add in
    fp32 the rows that came back from the ranks it went to (``pos[t, d] >= 0``), its own rank's from row
    ``self_start + pos[t, rank]`` of ``y``, rank d's from slot ``d * slots + pos[t, d]`` of the combine area
    ``cx`` (weights: ``yw``, ``cw``), and store it in bf16 (weights fp32) into ``out``. With two ranks (RP 2) the
    rows are added as packed bf16 pairs, which gives the same bits as the fp32 sum rounded to bf16."""
    cols = tl.arange(0, RP)
    h = tl.arange(0, HB)[None, :]
    hmask = h < H
    t64 = t.to(tl.int64)[:, None]
    pos = tl.load(pos_ptr + t64 * R + cols[None, :], mask=tmask[:, None] & (cols[None, :] < R), other=-1)
    if RP == 2:  # two ranks: at most two rows per token, added as packed bf16 pairs (`ptx.bf16x2_add_as_fp32`)
        WB: tl.constexpr = HB // 2 // ptx.ROW_PARTS  # (in parts where a Triton's ptxas would spill the whole rows)
        for part in tl.static_range(ptx.ROW_PARTS):
            w = part * WB + tl.arange(0, WB)[None, :]  # the int32 words of a row
            wmask = w < H // 2
            p_own = column(pos, cols, rank).to(tl.int64)[:, None]
            p_peer = column(pos, cols, 1 - rank).to(tl.int64)[:, None]
            own = tl.load(y_bf16.to(tl.pointer_type(tl.int32), bitcast=True) + (self_start + p_own) * (H // 2) + w,
                          mask=(p_own >= 0) & wmask, other=0)
            peer = tl.load(cx.to(tl.pointer_type(tl.int32), bitcast=True) + ((1 - rank) * slots + p_peer) * (H // 2) + w,
                           mask=(p_peer >= 0) & wmask, other=0, cache_modifier=".cg")
            tl.store(out_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + t64 * (H // 2) + w,
                     ptx.bf16x2_add_as_fp32(own, peer), mask=tmask[:, None] & wmask)
    else:
        acc = tl.zeros((TB, HB), dtype=tl.float32)
        for d in range(R):  # (not unrolled over RP with predicated loads: that is slower on Hopper)
            p = column(pos, cols, d).to(tl.int64)[:, None]
            ok = p >= 0
            if d == rank:
                acc += tl.load(y_bf16 + (self_start + p) * H + h, mask=ok & hmask, other=0.0).to(tl.float32)
            else:
                acc += tl.load(cx + (d * slots + p) * H + h, mask=ok & hmask, other=0.0,
                               cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + t64 * H + h, acc.to(tl.bfloat16), mask=tmask[:, None] & hmask)
    if HAS_WEIGHTS:
        sum_returned_weights(t, tmask, pos, R, rank, self_start, yw_ptr, cw, slots, out_w_ptr, K, KP, RP, TB)


@triton.jit
def sum_returned_weights(t, tmask, pos, R, rank, self_start, yw_ptr, cw, slots, out_w_ptr, K,
                         KP: tl.constexpr, RP: tl.constexpr, TB: tl.constexpr):
    """The weights' part of `sum_returned_rows` (``pos``: ``[TB, RP]``, the tokens' rows on each rank)."""
    cols = tl.arange(0, RP)
    k = tl.arange(0, KP)[None, :]
    kmask = k < K
    acc_w = tl.zeros((TB, KP), dtype=tl.float32)
    for d in range(R):
        p = column(pos, cols, d).to(tl.int64)[:, None]
        ok = p >= 0
        if d == rank:
            acc_w += tl.load(yw_ptr + (self_start + p) * K + k, mask=ok & kmask, other=0.0)
        else:
            acc_w += tl.load(cw + (d * slots + p) * K + k, mask=ok & kmask, other=0.0, cache_modifier=".cg")
    tl.store(out_w_ptr + t.to(tl.int64)[:, None] * K + k, acc_w, mask=tmask[:, None] & kmask)


@triton.jit
def load_tokens(t, tmask, x_ptr, scales_ptr, topk_ptr, weights_ptr, pos_ptr, H, K, R,
                X_BYTES: tl.constexpr, QUANTIZE: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr,
                HAS_WEIGHTS: tl.constexpr, VEC: tl.constexpr, GROUPS: tl.constexpr, KP: tl.constexpr,
                RP: tl.constexpr, TB: tl.constexpr, ROWS: tl.constexpr):
    """What a dispatch sends of tokens ``t`` (``[TB]``, ``tmask``), shared by both transports: each row as the four
    int32 words of its 16-byte vectors (``[TB, VEC]`` each, ``X_BYTES`` per element; with QUANTIZE, x is bf16 and is
    quantized here to e4m3 with one scale per 128 values, bit for bit `smsplit.fp8.quantize_1x128`), the scales
    ``[TB, GROUPS]``, top-k ids and weights ``[TB, KP]`` and the positions ``pos`` ``[TB, RP]``; what the flags
    leave out is a placeholder (not ROWS: the rows and their scales, which the caller quantizes in chunks)."""
    t64 = t.to(tl.int64)[:, None]
    n_groups = H // 128
    grp = tl.arange(0, GROUPS)[None, :]
    k = tl.arange(0, KP)[None, :]
    cols = tl.arange(0, RP)[None, :]
    scale = tl.zeros((TB, GROUPS), dtype=tl.float32)
    if not ROWS:
        w0 = tl.zeros((TB, VEC), dtype=tl.int32)
        w1, w2, w3 = w0, w0, w0
    elif QUANTIZE:
        g3 = tl.arange(0, GROUPS)[None, :, None]
        c3 = tl.arange(0, 128)[None, None, :]
        xf = tl.load(x_ptr + t64[:, :, None] * H + g3 * 128 + c3, mask=tmask[:, None, None] & (g3 < n_groups),
                     other=0.0).to(tl.float32)
        q, scale = quantize_e4m3_groups(xf, 2)
        w0, w1, w2, w3 = e4m3_v4_words(q, TB, GROUPS)  # 16-byte stores to computed addresses
    else:
        vec = tl.arange(0, VEC)[None, :]
        row_words = H * X_BYTES // 4
        w0, w1, w2, w3 = ptx.ld_global_nc_v4(x_ptr + t64 * row_words + 4 * vec, tmask[:, None] & (vec < row_words // 4))
        if HAS_SCALES:
            scale = tl.load(scales_ptr + t64 * n_groups + grp, mask=tmask[:, None] & (grp < n_groups))
    topk = tl.full((TB, KP), -1, dtype=tl.int64)
    if HAS_TOPK:
        topk = tl.load(topk_ptr + t64 * K + k, mask=tmask[:, None] & (k < K), other=-1)
    weights = tl.zeros((TB, KP), dtype=tl.float32)
    if HAS_WEIGHTS:
        weights = tl.load(weights_ptr + t64 * K + k, mask=tmask[:, None] & (k < K), other=0.0)
    pos = tl.load(pos_ptr + t64 * R + cols, mask=tmask[:, None] & (cols < R), other=-1)
    return w0, w1, w2, w3, scale, topk, weights, pos


@triton.jit
def load_chunk(x_ptr, t64, tmask, g0, H, QG: tl.constexpr, TB: tl.constexpr, WIDE: tl.constexpr = False):
    """Groups ``g0 .. g0 + QG - 1`` (128 values each) of rows ``t64`` (``[TB, 1]``) of a bf16 x, two 16-byte vectors
    per thread: the four int32 words of vector ``j`` of each group and of vector ``j + 8`` (eight blocks
    ``[TB, QG, 8]``; zeros past the row or for masked tokens), for `quantize_chunk`: each load of a warp reads whole
    128-byte runs (adjacent vectors per thread would use half of every 32-byte sector a load touches). A dispatch
    loads the next chunk before it quantizes this one, so that the loads' latency hides behind the arithmetic.
    Placeholders for other dtypes, which `quantize_chunk` loads itself. WIDE: vectors ``2 j`` and ``2 j + 1``
    instead (the thread's 16 values adjacent, for one 16-byte store of their e4m3 bytes: `chunk_vectors`), through
    L1 so that the second load of each sector is served there."""
    j3 = tl.arange(0, 8)[None, None, :]  # the group's 8 threads
    if x_ptr.dtype.element_ty == tl.bfloat16:
        g3 = g0 + tl.arange(0, QG)[None, :, None]
        ok = tmask[:, None, None] & (g3 < H // 128) & (j3 < 8)
        if WIDE:
            words = x_ptr.to(tl.pointer_type(tl.int32)) + t64[:, :, None] * (H // 2) + g3 * 64 + 8 * j3
            a0, a1, a2, a3 = ptx.ld_global_nc_l1_v4(words, ok)
            b0, b1, b2, b3 = ptx.ld_global_nc_l1_v4(words + 4, ok)
        else:
            words = x_ptr.to(tl.pointer_type(tl.int32)) + t64[:, :, None] * (H // 2) + g3 * 64 + 4 * j3
            a0, a1, a2, a3 = ptx.ld_global_nc_v4(words, ok)
            b0, b1, b2, b3 = ptx.ld_global_nc_v4(words + 32, ok)
    else:
        a0 = tl.zeros((TB, QG, 8), dtype=tl.int32)
        a1, a2, a3, b0, b1, b2, b3 = a0, a0, a0, a0, a0, a0, a0
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def quantize_chunk(x_ptr, t64, tmask, g0, H, a0, a1, a2, a3, b0, b1, b2, b3, QG: tl.constexpr, TB: tl.constexpr,
                   WIDE: tl.constexpr = False):
    """Groups ``g0 .. g0 + QG - 1`` (128 values each) of rows ``t64`` (``[TB, 1]``) of x quantized to e4m3, bit for
    bit `smsplit.fp8.quantize_1x128`: two pairs of int32 words, each pair 8 e4m3 bytes (``[TB, QG * 8]`` each,
    stored at the word offsets `chunk_halves` gives) and the scales ``[TB, QG]``. A bf16 x comes as `load_chunk`
    loaded it and is quantized on packed words, each thread the sixteen values of its two loads
    (`smsplit.fp8.quantize_e4m3_bf16_vector_pairs`: nothing moves between threads but the group maxima); other
    dtypes (fp32, fp16) are loaded here and quantized as fp32 values. WIDE: the words in `load_chunk`'s WIDE layout
    (each thread's 16 values adjacent)."""
    if x_ptr.dtype.element_ty == tl.bfloat16:
        q0, q1, q2, q3, scale = quantize_e4m3_bf16_vector_pairs(a0, a1, a2, a3, b0, b1, b2, b3)
        q0, q1 = tl.reshape(q0, (TB, QG * 8)), tl.reshape(q1, (TB, QG * 8))
        q2, q3 = tl.reshape(q2, (TB, QG * 8)), tl.reshape(q3, (TB, QG * 8))
    else:
        g3 = g0 + tl.arange(0, QG)[None, :, None]
        c3 = tl.arange(0, 128)[None, None, :]
        xf = tl.load(x_ptr + t64[:, :, None] * H + g3 * 128 + c3, mask=tmask[:, None, None] & (g3 < H // 128),
                     other=0.0).to(tl.float32)
        q, scale = quantize_e4m3_groups(xf, 2)
        q0, q1, q2, q3 = e4m3_halves(q, TB, QG, WIDE)
    return q0, q1, q2, q3, scale


@triton.jit
def e4m3_halves(q, TB: tl.constexpr, QG: tl.constexpr, WIDE: tl.constexpr = False):
    """e4m3 bytes ``q`` (``[TB, QG, 128]``) as `quantize_chunk` returns a bf16 x's: per thread ``j`` of a group the
    two words of values ``8 j ..`` and the two of values ``64 + 8 j ..`` (``[TB, QG * 8]`` each); WIDE: of values
    ``16 j ..`` and ``16 j + 8 ..``."""
    w0, w1 = e4m3_v2_words(q, TB, QG)  # 8-byte vector 16 g + h of the row: thread j takes h = j and j + 8
    if WIDE:  # (h = 2 j and 2 j + 1)
        a0, b0 = tl.split(tl.reshape(w0, (TB, QG, 8, 2)))
        a1, b1 = tl.split(tl.reshape(w1, (TB, QG, 8, 2)))
    else:
        a0, b0 = tl.split(tl.permute(tl.reshape(w0, (TB, QG, 2, 8)), (0, 1, 3, 2)))
        a1, b1 = tl.split(tl.permute(tl.reshape(w1, (TB, QG, 2, 8)), (0, 1, 3, 2)))
    return (tl.reshape(a0, (TB, QG * 8)), tl.reshape(a1, (TB, QG * 8)),
            tl.reshape(b0, (TB, QG * 8)), tl.reshape(b1, (TB, QG * 8)))


@triton.jit
def chunk_halves(g0, QG: tl.constexpr):
    """Word offsets, in a row of e4m3 bytes, of the two 8-byte halves `quantize_chunk` returns per thread
    (``[1, QG * 8]`` each): values ``8 j ..`` and ``64 + 8 j ..`` of group ``g0 + i`` for element ``8 i + j``."""
    f = tl.arange(0, QG * 8)[None, :]
    first = 32 * (g0 + f // 8) + 2 * (f % 8)
    return first, first + 16


@triton.jit
def chunk_vectors(g0, QG: tl.constexpr):
    """With `load_chunk`'s WIDE loads: the 16-byte vector, in a row of e4m3 bytes, of each thread's 16 values
    (``[1, QG * 8]``): vector ``8 (g0 + i) + j`` for element ``8 i + j``."""
    f = tl.arange(0, QG * 8)[None, :]
    return 8 * (g0 + f // 8) + f % 8


@triton.jit
def store_chunk_scales(dst_s, g0, scale, mask, n_groups, QG: tl.constexpr, TB: tl.constexpr):
    """Store the scales ``[TB, QG]`` of groups ``g0 ..`` that `quantize_chunk` returns at ``dst_s + g`` (``dst_s``:
    fp32 pointers ``[TB, 1]`` to the rows' first scales; ``mask`` ``[TB, 1]``), each by the first of its group's 8
    threads, in the layout the scales were computed in: a `tl.store` of the ``[TB, QG]`` block would move them
    through shared memory, with two barriers per chunk."""
    f = tl.arange(0, QG * 8)[None, :]
    g = g0 + f // 8
    s = tl.reshape(tl.broadcast_to(scale[:, :, None], (TB, QG, 8)), (TB, QG * 8))
    ptx.st_global_b32(dst_s + g, s, mask & (f % 8 == 0) & (g < n_groups))
