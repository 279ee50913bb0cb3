"""The combine: each rank pushes every row it received back into its source's combine area (one slot per expert
rank and position among the rows that rank received from the source, so each source's rows go back as one block),
signals, waits, and sums the slots of each of its tokens in fp32 (`smsplit.ep.kernels.rows.sum_returned_rows`).

First it waits until every peer has summed the previous combine, so that two combines in a row keep their rows, and
when done it signals that its sum is done. `combine_copied_kernel`: copy engines return the rows in chunks and the
sum starts on a chunk as soon as it has landed.
"""

import triton
import triton.language as tl

from smsplit import ptx
from smsplit.trace import record_block

from .common import (COPIES_WORD, CTX_CHUNK_ENDS, CTX_COPIED, CTX_CW, CTX_CX, CTX_SIG, CTX_STATUS,
                     CTX_TIMEOUT, FAIL_WORD, FREE_SLOT, SHORT_SLOT, SUMMED_SLOT, failed_before, finish,
                     free_copy_stream, pick, signal_all, slot_of, wait_for_one, wait_for_ranks)
from .rows import sum_returned_rows, sum_returned_weights

WEIGHTS_BLOCK = tl.constexpr(2048)  # the fp32 top-k weights a program pushes per step
WEIGHTS_TOKENS = tl.constexpr(64)  # the tokens whose weights a program sums per step
# tokens a program sums per step (TB in the kernels): 8 with 2 ranks (the packed two-row sum; 2 ranks, 5 queued
# replays: 219.0 us at 8 against 250.1 at 4), else 4 (8 spill registers there)


@triton.jit
def push_back(y_ptr, yw_ptr, layout_ptr, ctx_ptr, sig, d, rank, R, y_rows, max_tokens, skip, H, K,
              TB: tl.constexpr,
              HB: tl.constexpr):
    """Push the rows received from source d but its first ``skip`` (those the copy engines return) into slots
    ``[rank][i]`` of d's combine area, with 16-byte loads and stores, then all of its rows' weights (when
    ``yw_ptr``) as one flat range. A receive that overflowed ``y_rows`` (num_worst_tokens; status 4, which this
    rank's host raises) has rows past y's: none is read, and program 0 tells d (its SHORT_SLOT word)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    VEC: tl.constexpr = HB // 8  # 16-byte vectors of a bf16 row
    vec = tl.arange(0, VEC)[None, :]
    n_vec = H * 2 // 16
    received_from = tl.load(layout_ptr + R + d)
    received_to = tl.load(layout_ptr + R + d + 1)  # (word 2R is the total: the last source's end)
    start = tl.minimum(received_from, y_rows)
    end = tl.minimum(received_to, y_rows)
    base = tl.load(ctx_ptr + d)
    # d has rows past y's (seen by d after the signal that follows)
    if (pid == 0) & (received_to > tl.maximum(received_from, y_rows)):
        ptx.st_release_sys(slot_of(ctx_ptr, sig, d, SHORT_SLOT) + rank, 1)
    first_slot = rank * max_tokens - start
    off_cx = tl.load(ctx_ptr + CTX_CX)
    for r0 in range(start + skip + pid * TB, end, programs * TB):
        r = r0 + tl.arange(0, TB)
        push = (r < end)[:, None] & (vec < n_vec)
        r64 = r.to(tl.int64)[:, None]
        w0, w1, w2, w3 = ptx.ld_global_nc_v4(y_ptr + r64 * (n_vec * 4) + 4 * vec, push)
        dst = (base + off_cx + (first_slot + r64) * H * 2).to(tl.pointer_type(tl.int32))
        ptx.st_global_na_v4(dst + 4 * vec, w0, w1, w2, w3, push)
    if yw_ptr is not None:
        n_w = (end - start) * K
        src_w = yw_ptr + start.to(tl.int64) * K
        dst_w = (base + tl.load(ctx_ptr + CTX_CW) + (rank * max_tokens).to(tl.int64) * K * 4).to(
            tl.pointer_type(tl.float32))
        for f0 in range(pid * WEIGHTS_BLOCK, n_w, programs * WEIGHTS_BLOCK):
            f = f0 + tl.arange(0, WEIGHTS_BLOCK)
            tl.store(dst_w + f, tl.load(src_w + f, mask=f < n_w), mask=f < n_w)


@triton.jit
def sum_weights(pos_ptr, yw_ptr, cw_ptr, out_w_ptr, layout_ptr, T, y_rows, R, rank, max_tokens, K,
                KP: tl.constexpr, RP: tl.constexpr):
    """The weights' sums, in a pass of their own (all were pushed before the barrier; in the rows' loop they spilled
    registers): after the rows' in `combine_kernel`, before them in `combine_copied_kernel` (while the copies land).
    What it loads from the layout it loads itself: held from one pass to the other, it spills."""
    self_start = tl.load(layout_ptr + R + rank)
    t_sum = tl.where(tl.load(layout_ptr + 2 * R) > y_rows, 0, T)  # (see `combine_kernel`)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, RP)
    for t0 in range(pid * WEIGHTS_TOKENS, t_sum, programs * WEIGHTS_TOKENS):
        t = t0 + tl.arange(0, WEIGHTS_TOKENS)
        pos = tl.load(pos_ptr + t.to(tl.int64)[:, None] * R + cols[None, :],
                      mask=(t < T)[:, None] & (cols[None, :] < R), other=-1)
        sum_returned_weights(t, t < T, pos, R, rank, self_start, yw_ptr, cw_ptr, max_tokens, out_w_ptr, K, KP, RP,
                             WEIGHTS_TOKENS)


@triton.jit
def report_short(ctx_ptr, sig, rank, R, RP: tl.constexpr):
    """(The last program, after the signals, so that the peers waiting for them are not held up by this check.) A
    peer whose receive overflowed told this rank (SHORT_SLOT): some of its rows did not come back, status 10."""
    cols = tl.arange(0, RP)
    short = tl.load(slot_of(ctx_ptr, sig, rank, SHORT_SLOT) + cols, mask=cols < R, other=0, volatile=True)
    if tl.max(short, axis=0) > 0:
        status_ptr = tl.load(ctx_ptr + CTX_STATUS).to(tl.pointer_type(tl.int32))
        if tl.load(status_ptr, volatile=True) == 0:
            tl.store(status_ptr + 1, tl.argmax(short, axis=0))
            tl.store(status_ptr, 10)


@triton.jit(do_not_specialize=["trace_tag", "y_rows"])  # a new tag id or receive size must not recompile
def combine_kernel(y_ptr, yw_ptr, layout_ptr, pos_ptr, ctx_ptr, state_ptr, cx_ptr, cw_ptr, out_ptr, out_w_ptr,
                   T, H, K, rank, R, y_rows, max_tokens, HB: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr,
                   trace_ptr, trace_tag):
    """Push the i-th row received from each other rank (``y``, bf16 as int32 words, ``y_rows`` rows) back to slot
    [rank][i] of that source's combine area, then sum, for each of this rank's ``T`` tokens, its rows from the ranks
    it went to (fp32; its own rank's row straight from y) into out (bf16); with ``yw_ptr`` (fp32 top-k weights of
    the received rows) also their weights into ``out_w_ptr``. ``cx_ptr``, ``cw_ptr``: this rank's combine area
    (bf16 rows, fp32 weights; ``max_tokens`` slots per source) as typed, aligned pointers: the loads vectorize, and
    the sum holds no address it would have to load (loaded values cannot be recomputed: held, they spill)."""
    if trace_ptr is not None:
        t_start = ptx.globaltimer()
    TB: tl.constexpr = 8 if RP == 2 else 4
    expected = tl.load(state_ptr + 2, volatile=True)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if failed_before(state_ptr):
        return
    sig = tl.load(ctx_ptr + CTX_SIG)
    status_ptr = tl.load(ctx_ptr + CTX_STATUS).to(tl.pointer_type(tl.int32))
    timeout_ns = tl.load(ctx_ptr + CTX_TIMEOUT)
    # every peer has summed the previous combine (its programs' SUMMED_SLOT signals): its combine area is free to
    # overwrite (two combines in a row, no dispatch between)
    wait_for_ranks(slot_of(ctx_ptr, sig, rank, SUMMED_SLOT), 0, 1, R, rank, 1, expected, timeout_ns, status_ptr,
                   state_ptr + FAIL_WORD, 8)
    for d in range(R):
        if d != rank:
            push_back(y_ptr, yw_ptr, layout_ptr, ctx_ptr, sig, d, rank, R, y_rows, max_tokens, 0, H, K, TB, HB)
    signal_all(ctx_ptr, sig, 2, rank, R)
    wait_for_ranks(slot_of(ctx_ptr, sig, rank, 2), 0, 1, R, rank, 0, expected + programs, timeout_ns, status_ptr,
                   state_ptr + FAIL_WORD, 3)
    y_bf16 = y_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)  # (y comes as int32 words for the pushes)
    self_start = tl.load(layout_ptr + R + rank)
    # a receive that overflowed num_worst_tokens has rows past y's: this rank sums nothing (`push_back`): the loop
    # starts past T (its bound, T, a parameter: a loaded bound would be held through it)
    t_skip = tl.where(tl.load(layout_ptr + 2 * R) > y_rows, T, 0)
    for t0 in range(t_skip + pid * TB, T, programs * TB):
        t = t0 + tl.arange(0, TB)
        sum_returned_rows(t, t < T, pos_ptr, R, rank, self_start, y_bf16, yw_ptr, cx_ptr, cw_ptr, max_tokens, out_ptr,
                          out_w_ptr, H, K, HB, KP, RP, TB, False)
    if yw_ptr is not None:
        sum_weights(pos_ptr, yw_ptr, cw_ptr, out_w_ptr, layout_ptr, T, y_rows, R, rank, max_tokens, K, KP, RP)
    # (loaded again, not held through the sum: held, they spill)
    sig = tl.load(ctx_ptr + CTX_SIG)
    expected = tl.load(state_ptr + 2, volatile=True)  # (this launch's last program changes it once all are done)
    signal_all(ctx_ptr, sig, SUMMED_SLOT, rank, R)  # this program's reads of the combine area are done
    if finish(state_ptr, 2, expected, programs, programs, -1, COPIES_WORD + 1):
        report_short(ctx_ptr, sig, rank, R, RP)
    if trace_ptr is not None:
        record_block(trace_ptr, trace_tag, t_start)


@triton.jit(do_not_specialize=["trace_tag", "y_rows"])  # a new tag id or receive size must not recompile
def combine_copied_kernel(y_ptr, yw_ptr, layout_ptr, pos_ptr, ctx_ptr, state_ptr, cx_ptr, cw_ptr, chunk_ends_ptr,
                          out_ptr, out_w_ptr, T, H, K, rank, R, y_rows, max_tokens, HB: tl.constexpr,
                          KP: tl.constexpr, RP: tl.constexpr, CHUNKS: tl.constexpr, trace_ptr, trace_tag):
    """`combine_kernel` beside copy engines that return each source's first rows: ``chunk_ends_ptr`` (int32
    ``[R, CHUNKS]``) ends the rows copied back to each source in CHUNKS chunks (positions among the rows received
    from it); the kernel pushes the rows past the last end, and all weights. Program 0 tells each source its chunk
    ends, and the sum waits, per block of tokens, only for the chunks that hold the rows it adds (each chunk's
    copy-done flag), so it runs while the copy engines still move later chunks. A wait that fails, here or before,
    sets this rank's FREE_SLOT words, which its reset stream waits for; the last program sets the peers' once every
    program's reads are done."""
    if trace_ptr is not None:
        t_start = ptx.globaltimer()
    TB: tl.constexpr = 8 if RP == 2 else 4
    CP: tl.constexpr = 4 if CHUNKS <= 4 else 8  # (at most MAX_CHUNKS)
    expected = tl.load(state_ptr + 2, volatile=True)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    fail_ptr = state_ptr + FAIL_WORD
    if failed_before(state_ptr):
        if pid == 0:
            free_copy_stream(slot_of(ctx_ptr, tl.load(ctx_ptr + CTX_SIG), rank, FREE_SLOT), R)
        return
    sig = tl.load(ctx_ptr + CTX_SIG)
    status_ptr = tl.load(ctx_ptr + CTX_STATUS).to(tl.pointer_type(tl.int32))
    timeout_ns = tl.load(ctx_ptr + CTX_TIMEOUT)
    wait_for_ranks(slot_of(ctx_ptr, sig, rank, SUMMED_SLOT), 0, 1, R, rank, 1, expected, timeout_ns, status_ptr,
                   fail_ptr, 8)
    if (pid == 0) & (tl.load(fail_ptr, volatile=True) != 0):  # a wait failed
        free_copy_stream(slot_of(ctx_ptr, sig, rank, FREE_SLOT), R)
    cols = tl.arange(0, RP)
    cc = tl.arange(0, CP)
    self_start = tl.load(layout_ptr + R + rank)
    t_sum = tl.where(tl.load(layout_ptr + 2 * R) > y_rows, 0, T)
    off_chunk_ends = tl.load(ctx_ptr + CTX_CHUNK_ENDS)
    if pid == 0:  # each source learns where the chunks of the rows it gets back end
        for d in range(R):
            if d != rank:
                ends_there = (tl.load(ctx_ptr + d) + off_chunk_ends).to(tl.pointer_type(tl.int32)) + rank * CHUNKS
                tl.store(ends_there + cc, tl.load(chunk_ends_ptr + d * CHUNKS + cc, mask=cc < CHUNKS), mask=cc < CHUNKS)
    for d in range(R):
        if d != rank:
            push_back(y_ptr, yw_ptr, layout_ptr, ctx_ptr, sig, d, rank, R, y_rows, max_tokens,
                      tl.load(chunk_ends_ptr + d * CHUNKS + CHUNKS - 1), H, K, TB, HB)
    signal_all(ctx_ptr, sig, 2, rank, R)
    wait_for_ranks(slot_of(ctx_ptr, sig, rank, 2), 0, 1, R, rank, 0, expected + programs, timeout_ns, status_ptr,
                   fail_ptr, 3)
    copies_seen = tl.load(state_ptr + COPIES_WORD + 1, volatile=True) + 1
    ends_here = (tl.load(ctx_ptr + rank) + off_chunk_ends).to(tl.pointer_type(tl.int32))
    ends = tl.load(ends_here + cols[:, None] * CHUNKS + cc[None, :], mask=(cols[:, None] < R) & (cc[None, :] < CHUNKS),
                   other=2**30, volatile=True)  # [RP, CP] chunk ends per source
    copied_end = tl.max(tl.where(cc[None, :] == CHUNKS - 1, ends, -1), axis=1)  # [RP] rows copied per source
    landed = tl.full((RP,), -1, tl.int32)  # per source, the last chunk this program has seen arrive
    # chunk c's flag from source d: word (1 + c) * R + d of the copy-done flags
    flags = (tl.load(ctx_ptr + rank) + tl.load(ctx_ptr + CTX_COPIED)).to(tl.pointer_type(tl.int32)) + R
    y_bf16 = y_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)  # (y comes as int32 words for the pushes)
    if yw_ptr is not None:  # (while the copies land)
        sum_weights(pos_ptr, yw_ptr, cw_ptr, out_w_ptr, layout_ptr, T, y_rows, R, rank, max_tokens, K, KP, RP)
    for t0 in range(pid * TB, t_sum, programs * TB):
        t = t0 + tl.arange(0, TB)
        pos = tl.load(pos_ptr + t.to(tl.int64)[:, None] * R + cols[None, :],
                      mask=(t < T)[:, None] & (cols[None, :] < R), other=-1)
        # [RP] the last copied row each source returns for these tokens (rows past the copies were pushed by the
        # source's SMs before the barrier above: a block whose last row was pushed may still hold copied rows of the
        # last chunk)
        last = tl.max(tl.where(pos < copied_end[None, :], pos, -1), axis=0)
        need = tl.sum((ends <= last[:, None]).to(tl.int32), axis=1)  # its chunk
        need = tl.where((last >= 0) & (cols != rank), need, -1)
        if tl.max(need - landed, axis=0) > 0:
            for d in range(R):
                c = pick(need, cols, d)
                if c > pick(landed, cols, d):  # chunks land in order: chunk c's flag covers the earlier ones
                    wait_for_one(flags + c * R + d, copies_seen, d, timeout_ns, status_ptr, fail_ptr, 9)
            tl.debug_barrier()
            landed = tl.maximum(landed, need)
        sum_returned_rows(t, t < T, pos_ptr, R, rank, self_start, y_bf16, yw_ptr, cx_ptr, cw_ptr, max_tokens, out_ptr,
                          out_w_ptr, H, K, HB, KP, RP, TB, False)
    # every source's chain has ended (its last flag, sent to every rank): see FREE_SLOT
    for d in range(R):
        if (d != rank) & (pick(landed, cols, d) < CHUNKS - 1):
            wait_for_one(flags + (CHUNKS - 1) * R + d, copies_seen, d, timeout_ns, status_ptr, fail_ptr, 9)
    tl.debug_barrier()
    signal_all(ctx_ptr, sig, SUMMED_SLOT, rank, R)  # this program's reads of the combine area are done
    last = finish(state_ptr, 2, expected, programs, programs, copies_seen, COPIES_WORD + 1)
    if last:
        report_short(ctx_ptr, sig, rank, R, RP)
        # every program's reads are done: each source's copy stream may copy its next combine's rows
        for d in range(R):
            if d != rank:
                ptx.atom_add_release_sys(slot_of(ctx_ptr, sig, d, FREE_SLOT) + rank, 1)
    if trace_ptr is not None:
        record_block(trace_ptr, trace_tag, t_start)
