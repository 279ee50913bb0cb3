"""The dispatch beside copy engines (``bulk="copy_engine"``): one copy per peer moves rows ``0 .. m-1`` of x into
rows ``0 .. m-1`` of this rank's rows there (`smsplit.ep.nvlink_plan.prefix_plan`); this kernel pushes the other
rows, every row's metadata, and, once this rank's copies have landed, the rows that fill the copied prefixes' holes."""

import triton
import triton.language as tl

from smsplit import ptx
from smsplit.trace import record_block

from .common import (COPIES_WORD, CTX_COPIED, CTX_SIG, CTX_STATUS, CTX_TIMEOUT, FAIL_WORD, X_FREE_SLOT, column,
                     failed_before, free_copy_stream, pick, slot_of, wait_for_one)
from .dispatch import TOKENS_PER_STEP, begin_dispatch, end_dispatch, push_tokens, receive_offsets, start_dispatch


@triton.jit
def fill_holes(x_ptr, pos_ptr, H, R, copied, fill_from, fill_to, dest_start, dest_base, off_x, row_bytes,
               VEC: tl.constexpr, RP: tl.constexpr, TB: tl.constexpr):
    """Store the rows of tokens ``fill_from <= t < fill_to`` that fill holes of a copied prefix: token
    ``t >= copied[d]`` on a row ``p < copied[d]`` of peer d, whose copy has put another token's row there."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, RP)
    vec = tl.arange(0, VEC)[None, :]
    for t0 in range(fill_from + pid * TB, fill_to, programs * TB):
        t = t0 + tl.arange(0, TB)
        tmask = t < fill_to
        t64 = t.to(tl.int64)[:, None]
        w0, w1, w2, w3 = ptx.ld_global_nc_v4(x_ptr + t64 * (row_bytes // 4) + 4 * vec,
                                             tmask[:, None] & (vec < row_bytes // 16))
        pos = tl.load(pos_ptr + t64 * R + cols[None, :], mask=tmask[:, None] & (cols[None, :] < R), other=-1)
        for d in tl.static_range(RP):
            p = column(pos, cols, d)
            m = pick(copied, cols, d)
            hole = ((p >= 0) & (p < m) & (t >= m))[:, None]
            row = pick(dest_start, cols, d) + p.to(tl.int64)[:, None]
            dst = (pick(dest_base, cols, d) + off_x + row * row_bytes).to(tl.pointer_type(tl.int32))
            ptx.st_global_na_v4(dst + 4 * vec, w0, w1, w2, w3, hole & (vec < row_bytes // 16))


@triton.jit(do_not_specialize=["trace_tag"])  # a new tag id must not recompile
def dispatch_copied_kernel(x_ptr, scales_ptr, topk_ptr, weights_ptr, pos_ptr, layout_ptr, ctx_ptr, plan_ptr,
                           T, H, K, R, num_local_experts, num_worst,
                           GATE: tl.constexpr, GROUPS: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr,
                           trace_ptr, trace_tag):
    """`smsplit.ep.kernels.dispatch.dispatch_kernel` beside this rank's copies: ``plan_ptr`` (int32 ``[R + 2]``)
    holds ``copied[d]``, the rows the copy engines move to each rank d (0: the kernel pushes them all), then
    ``fill_from, fill_to``: the tokens that fill holes (both T: none). The kernel stores no row at a position below
    ``copied[d]``; after its tokens it waits (bounded) for this rank's copies to land on each peer it copied to and
    fills the holes, then ends as every dispatch does, also waiting for every peer's copies to land here. A wait
    that fails, here or before, sets this rank's X_FREE_SLOT words, which its reset stream waits for."""
    if trace_ptr is not None:
        t_start = ptx.globaltimer()
    state_ptr, rank, expected, finished = begin_dispatch(ctx_ptr)
    pid = tl.program_id(0)
    if failed_before(state_ptr):
        if pid == 0:
            free_copy_stream(slot_of(ctx_ptr, tl.load(ctx_ptr + CTX_SIG), rank, X_FREE_SLOT), R)
        return
    start_dispatch(ctx_ptr, state_ptr, rank, R, finished, GATE, True)
    HAS_SCALES: tl.constexpr = scales_ptr is not None  # FP8 rows
    X_BYTES: tl.constexpr = 1 if HAS_SCALES else 2
    VEC: tl.constexpr = GROUPS * 8 * X_BYTES  # (as `smsplit.ep.kernels.dispatch.dispatch_kernel`)
    cols = tl.arange(0, RP)
    dest_start = tl.load(layout_ptr + cols, mask=cols < R, other=0).to(tl.int64)
    dest_base = tl.load(ctx_ptr + cols, mask=cols < R, other=0)
    copied = tl.load(plan_ptr + cols, mask=cols < R, other=0)
    offs = receive_offsets(ctx_ptr)
    push_tokens(x_ptr, scales_ptr, topk_ptr, weights_ptr, pos_ptr, T, H, K, R, dest_start, dest_base, copied, offs,
                num_local_experts, X_BYTES, VEC, GROUPS, KP, RP)
    off_x = offs[0]
    row_bytes = H * X_BYTES
    n_groups = H // 128
    fill_from = tl.load(plan_ptr + R)
    if fill_from < T:  # the holes in the copied rows, once the copies have landed
        status_ptr = tl.load(ctx_ptr + CTX_STATUS).to(tl.pointer_type(tl.int32))
        copies_target = tl.load(state_ptr + COPIES_WORD, volatile=True) + 1
        for d in range(R):
            if pick(copied, cols, d) > 0:
                flag = (tl.load(ctx_ptr + d) + tl.load(ctx_ptr + CTX_COPIED)).to(tl.pointer_type(tl.int32)) + rank
                wait_for_one(flag, copies_target, d, tl.load(ctx_ptr + CTX_TIMEOUT), status_ptr,
                             state_ptr + FAIL_WORD, 6)
        tl.debug_barrier()
        fill_holes(x_ptr, pos_ptr, H, R, copied, fill_from, tl.load(plan_ptr + R + 1), dest_start, dest_base, off_x,
                   row_bytes, VEC, RP, TOKENS_PER_STEP)
    end_dispatch(ctx_ptr, offs, state_ptr, layout_ptr, rank, R, K, row_bytes, n_groups, num_worst, expected, finished,
                 True, HAS_SCALES, topk_ptr is not None, weights_ptr is not None, VEC, GROUPS, KP, TOKENS_PER_STEP)
    if (pid == 0) & (tl.load(state_ptr + FAIL_WORD, volatile=True) != 0):  # a wait failed
        free_copy_stream(slot_of(ctx_ptr, tl.load(ctx_ptr + CTX_SIG), rank, X_FREE_SLOT), R)
    if trace_ptr is not None:
        record_block(trace_ptr, trace_tag, t_start)
