"""The SM-push dispatch that quantizes BF16 rows to FP8 e4m3 on the way (one fp32 scale per 128 values, bit for bit
`smsplit.fp8.quantize_1x128`): each program quantizes ``QUANTIZE_TOKENS`` tokens a step, ``QUANTIZE_GROUPS`` groups of
128 values at a time, and pushes each chunk's e4m3 bytes and scales into every destination as it has them."""

import triton
import triton.language as tl

from smsplit import ptx
from smsplit.trace import record_block

from .common import CTX_SCALES, CTX_X, FINISHED_WORD, column, failed_before, pick
from .dispatch import end_dispatch, receive_offsets, start_dispatch, store_metadata
from .rows import chunk_vectors, load_chunk, load_tokens, quantize_chunk, store_chunk_scales

# tokens a program quantizes per step, and groups of 128 values quantized at a time (packed bf16 words, two 16-byte
# vectors per thread, the next chunk loaded while this one is quantized): FP8 dispatch at 20 SMs 149.6 us at 16, 8
# against 171.7 at 8, 8 and 162.6 at 32, 4 (docs/design-notes.md)
QUANTIZE_TOKENS = tl.constexpr(16)
QUANTIZE_GROUPS = tl.constexpr(8)


@triton.jit(do_not_specialize=["trace_tag"])  # a new tag id must not recompile
def dispatch_fp8_kernel(x_ptr, topk_ptr, weights_ptr, pos_ptr, layout_ptr, ctx_ptr, state_ptr,
                        T, H, K, rank, R, num_local_experts, num_worst,
                        GATE: tl.constexpr, GROUPS: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr,
                        trace_ptr, trace_tag):
    """`smsplit.ep.kernels.dispatch.dispatch_kernel` for a bf16 ``x`` received as e4m3 rows with fp32 scales:
    each program loads its tokens' metadata, stores it into every destination, then quantizes their rows in
    chunks (`quantize_chunk`; each thread loads 16 adjacent values, the second load of each sector served from L1)
    and stores each thread's 16 e4m3 bytes as one 16-byte vector, the scales beside them. GROUPS: the scales of a
    row as a power of two (the padding rows' scales; their 16-byte e4m3 vectors, VEC, follow from it).
    ``state_ptr`` and ``rank`` are parameters here, where the other dispatches load them from the context table:
    the quantize loop holds all 128 registers, and with them loaded ptxas's spills in it moved (Triton 3.6: 0 -> 2-4
    reloads a step; 3.9: 3 -> 6-8); as parameters the kernel compiles as it did before the table held them."""
    if trace_ptr is not None:
        t_start = ptx.globaltimer()
    expected = tl.load(state_ptr + 1, volatile=True)
    finished = tl.load(state_ptr + FINISHED_WORD, volatile=True)  # dispatches before this one
    if failed_before(state_ptr):
        return
    start_dispatch(ctx_ptr, state_ptr, rank, R, finished, GATE, False)
    VEC: tl.constexpr = GROUPS * 8  # (e4m3 rows)
    TB: tl.constexpr = QUANTIZE_TOKENS
    QG: tl.constexpr = QUANTIZE_GROUPS
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, RP)
    dest_start = tl.load(layout_ptr + cols, mask=cols < R, other=0).to(tl.int64)
    dest_base = tl.load(ctx_ptr + cols, mask=cols < R, other=0)
    row_bytes = H  # e4m3
    n_groups = H // 128
    for t0 in range(pid * TB, T, programs * TB):
        t = t0 + tl.arange(0, TB)
        _, _, _, _, _, topk, weights, pos = load_tokens(
            t, t < T, x_ptr, x_ptr, topk_ptr, weights_ptr, pos_ptr, H, K, R, 1, True, False,
            topk_ptr is not None, weights_ptr is not None, VEC, GROUPS, KP, RP, TB, False)
        # (the offsets loaded where they are used, not held in registers through the loops: held, they spill)
        offs = receive_offsets(ctx_ptr)
        for d in tl.static_range(RP):  # unrolled: d is a constant, the picks are selects
            p = column(pos, cols, d)
            row = pick(dest_start, cols, d) + p.to(tl.int64)[:, None]  # [TB, 1]
            store_metadata(offs, pick(dest_base, cols, d), row, (p >= 0)[:, None], t, d, None, topk, weights, K,
                           n_groups, num_local_experts, False, topk_ptr is not None, weights_ptr is not None, GROUPS,
                           KP)
        # the rows in chunks of QG groups: quantized, then stored with their scales
        t64 = t.to(tl.int64)[:, None]
        n0, n1, n2, n3, n4, n5, n6, n7 = load_chunk(x_ptr, t64, t < T, 0, H, QG, TB, True)
        for g0 in range(0, n_groups, QG):
            a0, a1, a2, a3, b0, b1, b2, b3 = n0, n1, n2, n3, n4, n5, n6, n7
            # the next chunk, in flight while this one is quantized
            n0, n1, n2, n3, n4, n5, n6, n7 = load_chunk(x_ptr, t64, t < T, g0 + QG, H, QG, TB, True)
            q0, q1, q2, q3, qscale = quantize_chunk(x_ptr, t64, t < T, g0, H, a0, a1, a2, a3, b0, b1, b2, b3,
                                                    QG, TB, True)
            v16 = chunk_vectors(g0, QG)  # each thread's 16-byte vector of the row
            off_x, off_scales = tl.load(ctx_ptr + CTX_X), tl.load(ctx_ptr + CTX_SCALES)
            for d in tl.static_range(RP):
                p = column(pos, cols, d)
                ok = (p >= 0)[:, None]
                row = pick(dest_start, cols, d) + p.to(tl.int64)[:, None]
                base = pick(dest_base, cols, d)
                dst = (base + off_x + row * row_bytes).to(tl.pointer_type(tl.int32))
                ptx.st_global_na_v4(dst + 4 * v16, q0, q1, q2, q3, ok & (v16 < row_bytes // 16))
                dst_s = (base + off_scales + row * n_groups * 4).to(tl.pointer_type(tl.float32))
                store_chunk_scales(dst_s, g0, qscale, ok, n_groups, QG, TB)
    end_dispatch(ctx_ptr, receive_offsets(ctx_ptr), state_ptr, layout_ptr, rank, R, K, row_bytes, n_groups,
                 num_worst, expected, finished, False, True, topk_ptr is not None, weights_ptr is not None, VEC,
                 GROUPS, KP, TB)
    if trace_ptr is not None:
        record_block(trace_ptr, trace_tag, t_start)
