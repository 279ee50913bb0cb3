"""The combine: each rank pushes every row it received back into its source's combine area (one slot per expert
rank and position among the rows that rank received from the source, so each source's rows go back as one block),
signals, waits, and sums the slots of each of its tokens in fp32 (`smsplit.ep.kernels.rows.sum_returned_rows`).

First it waits until every peer has summed the previous combine, so that two combines in a row keep their rows, and
when done it signals that its sum is done. Two kernels, sharing the steps below: `combine_kernel`, where SMs push
every row, and `combine_copied_kernel`, beside copy engines that return the rows in chunks (its sum starts on a chunk
as soon as it has landed).

Registers: the sum holds nearly all 128 registers of a thread at 16 warps, where ptxas's allocation is on an edge (a
small change in what is loaded where moves spills from one Triton version's ptxas to another's). What the sum reads
(this rank, the tokens, the slots per source, H, the combine area's typed pointer) are kernel parameters, which stay
in the constant bank; the transport's other constants (region offsets, timeout, status and state words) are loaded
from the context table before the sum, after it, or in its rare waits, so that none holds a register through it, and
the copied combine reads its copy-done count again after the sum (held, or with its tokens masked by the range it
sums rather than T, Triton 3.9's or 3.8's ptxas spilled 64-84 bytes in the sum; the kernels' compile tests check that
the copied combine does not spill).
"""

import triton
import triton.language as tl

from smsplit import ptx
from smsplit.trace import record_block

from .common import (COPIES_WORD, CTX_CHUNK_ENDS, CTX_COPIED, CTX_CW, CTX_CX, CTX_SIG, CTX_TIMEOUT, FAIL_WORD,
                     FREE_SLOT, SHORT_SLOT, SUMMED_SLOT, failed_before, finish, free_copy_stream, pick, signal_all,
                     slot_of, state_of, status_of, wait_for_one, wait_for_ranks)
from .rows import sum_returned_rows, sum_returned_weights

WEIGHTS_BLOCK = tl.constexpr(2048)  # the fp32 top-k weights a program pushes per step
WEIGHTS_TOKENS = tl.constexpr(64)  # the tokens whose weights a program sums per step
# tokens a program sums per step (TB): 8 with 2 ranks (the packed two-row sum; 2 ranks, 5 queued replays: 219.0 us
# at 8 against 250.1 at 4), else 4 (8 spill registers there)


@triton.jit
def wait_for_peers(ctx_ptr, state_ptr, slot, rank, R, skip_self, target, phase):
    """`wait_for_ranks` on this rank's signal slot ``slot`` (its words per source), with the table's timeout and
    status words."""
    sig = tl.load(ctx_ptr + CTX_SIG)
    wait_for_ranks(slot_of(ctx_ptr, sig, rank, slot), 0, 1, R, rank, skip_self, target, tl.load(ctx_ptr + CTX_TIMEOUT),
                   status_of(ctx_ptr), state_ptr + FAIL_WORD, phase)


@triton.jit
def push_rows_back(y_ptr, yw_ptr, starts_ptr, ctx_ptr, split_ptr, H, K, R, rank, max_tokens, y_rows,
                   HB: tl.constexpr, CHUNKS: tl.constexpr, TB: tl.constexpr):
    """Per source, the rows received from it (``starts_ptr``: int32, where each source's rows start in y, then the
    total) past those the copy engines return (``split_ptr``: where each source's chunks end, the last end its copied
    rows; None: every row), TB at a time, into this rank's slots of the source's
    combine area, then the weights of all its rows as one flat range (a source's rows are contiguous in y and in its
    combine slots). A receive that overflowed num_worst_tokens (status 4, which this rank's host raises) has rows
    past y's: none is read past ``y_rows``, and each source of a row past y's is told (SHORT_SLOT, status 10)."""
    VEC: tl.constexpr = HB // 8  # 16-byte vectors of a bf16 row
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    vec = tl.arange(0, VEC)[None, :]
    n_vec = H * 2 // 16
    vmask = vec < n_vec
    sig = tl.load(ctx_ptr + CTX_SIG)
    off_cx = tl.load(ctx_ptr + CTX_CX)
    for d in range(R):
        if d != rank:
            received_from = tl.load(starts_ptr + d)
            received_to = tl.load(starts_ptr + d + 1)  # (word R is the total: the last source's end)
            start = tl.minimum(received_from, y_rows)
            end = tl.minimum(received_to, y_rows)
            base = tl.load(ctx_ptr + d)
            # d has rows past y's (seen by d after the signal that follows)
            if (pid == 0) & (received_to > tl.maximum(received_from, y_rows)):
                ptx.st_release_sys(slot_of(ctx_ptr, sig, d, SHORT_SLOT) + rank, 1)
            first_slot = rank * max_tokens - start
            first = start
            if split_ptr is not None:
                first = start + tl.load(split_ptr + d * CHUNKS + CHUNKS - 1)
            for r0 in range(first + pid * TB, end, programs * TB):
                r = r0 + tl.arange(0, TB)
                push = (r < end)[:, None] & vmask
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
def sum_weights(pos_ptr, t_sum, R, rank, self_start, yw_ptr, cw, max_tokens, out_w_ptr, K, KP: tl.constexpr,
                RP: tl.constexpr):
    """The top-k weights' sums of tokens ``< t_sum``, in a pass of their own, WEIGHTS_TOKENS at a time (all were
    pushed before the barrier; in the rows' loop they spilled registers)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, RP)
    for t0 in range(pid * WEIGHTS_TOKENS, t_sum, programs * WEIGHTS_TOKENS):
        t = t0 + tl.arange(0, WEIGHTS_TOKENS)
        pos = tl.load(pos_ptr + t.to(tl.int64)[:, None] * R + cols[None, :],
                      mask=(t < t_sum)[:, None] & (cols[None, :] < R), other=-1)
        sum_returned_weights(t, t < t_sum, pos, R, rank, self_start, yw_ptr, cw, max_tokens, out_w_ptr, K, KP, RP,
                             WEIGHTS_TOKENS)


@triton.jit
def report_short_rows(ctx_ptr, rank, R, RP: tl.constexpr):
    """(The last program, after the signals, so that the peers waiting for them are not held up by this check.) A
    peer whose receive overflowed did not return some of this rank's rows (its SHORT_SLOT word): status 10."""
    cols = tl.arange(0, RP)
    short = tl.load(slot_of(ctx_ptr, tl.load(ctx_ptr + CTX_SIG), rank, SHORT_SLOT) + cols, mask=cols < R, other=0,
                    volatile=True)
    if tl.max(short, axis=0) > 0:
        status_ptr = status_of(ctx_ptr)
        if tl.load(status_ptr, volatile=True) == 0:
            tl.store(status_ptr + 1, tl.argmax(short, axis=0))
            tl.store(status_ptr, 10)


@triton.jit(do_not_specialize=["trace_tag", "y_rows"])  # a new tag id or receive size must not recompile
def combine_kernel(y_ptr, yw_ptr, layout_ptr, pos_ptr, ctx_ptr, cx_ptr, out_ptr, out_w_ptr,
                   T, H, K, R, rank, max_tokens, y_rows,
                   HB: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr, trace_ptr, trace_tag):
    """Push the i-th row received from each other rank back to slot [rank][i] of that source's combine area,
    then sum, for each of this rank's tokens, its rows from the ranks it went to (fp32; its own rank's row
    straight from y) into out (bf16). ``cx_ptr``: this rank's combine area (bf16 rows, ``[R * max_tokens, H]``,
    its fp32 weights right after); ``yw_ptr``, ``out_w_ptr`` (top-k weights), ``trace_ptr``: None when absent."""
    TB: tl.constexpr = 8 if RP == 2 else 4  # tokens a program sums per step (see above)
    if trace_ptr is not None:
        t_start = ptx.globaltimer()
    state_ptr = state_of(ctx_ptr)
    expected = tl.load(state_ptr + 2, volatile=True)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if failed_before(state_ptr):
        return
    # every peer has summed the previous combine (its programs' SUMMED_SLOT signals): its combine area is free to
    # overwrite (two combines in a row, no dispatch between)
    wait_for_peers(ctx_ptr, state_ptr, SUMMED_SLOT, rank, R, 1, expected, 8)
    self_start = tl.load(layout_ptr + R + rank)
    t_sum = tl.where(tl.load(layout_ptr + 2 * R) > y_rows, 0, T)  # (an overflowed receive sums nothing)
    push_rows_back(y_ptr, yw_ptr, layout_ptr + R, ctx_ptr, None, H, K, R, rank, max_tokens, y_rows, HB, 1, TB)
    signal_all(ctx_ptr, tl.load(ctx_ptr + CTX_SIG), 2, rank, R)
    wait_for_peers(ctx_ptr, state_ptr, 2, rank, R, 0, expected + programs, 3)
    # the combine area as typed pointers (alignment known: loads vectorize); its weights follow its rows
    cw = (cx_ptr + (R * max_tokens).to(tl.int64) * H).to(tl.pointer_type(tl.float32), bitcast=True)
    y_bf16 = y_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    if yw_ptr is not None:
        sum_weights(pos_ptr, t_sum, R, rank, self_start, yw_ptr, cw, max_tokens, out_w_ptr, K, KP, RP)
    for t0 in range(pid * TB, t_sum, programs * TB):
        t = t0 + tl.arange(0, TB)
        sum_returned_rows(t, t < T, pos_ptr, R, rank, self_start, y_bf16, yw_ptr, cx_ptr, cw, max_tokens, out_ptr,
                          out_w_ptr, H, K, HB, KP, RP, TB, False)
    # this program's reads of the combine area are done (the table's words loaded again: none held through the sum)
    signal_all(ctx_ptr, tl.load(ctx_ptr + CTX_SIG), SUMMED_SLOT, rank, R)
    if finish(state_of(ctx_ptr), 2, expected, programs, programs, -1, COPIES_WORD + 1):
        report_short_rows(ctx_ptr, rank, R, RP)
    if trace_ptr is not None:
        record_block(trace_ptr, trace_tag, t_start)


@triton.jit(do_not_specialize=["trace_tag"])  # a new tag id must not recompile
def combine_copied_kernel(y_ptr, yw_ptr, pos_ptr, ctx_ptr, cx_ptr, split_ptr, out_ptr, out_w_ptr,
                          T, H, K, R, rank, max_tokens,
                          HB: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr, CHUNKS: tl.constexpr,
                          trace_ptr, trace_tag):
    """`combine_kernel` beside copy engines that return the rows: ``split_ptr`` (int32 ``[R * CHUNKS + R + 2]``,
    made once per layout and chunking after a host read of the layout) ends each source's copied rows in CHUNKS
    chunks (positions among the rows received from it; the kernel pushes the rows past the last end, and all
    weights), then holds the receive rows ``y_rows`` and the layout's words ``[R, 2R]`` (where each source's rows
    start here, then the total: `combine_kernel`'s ``layout_ptr + R``). Program 0 tells each source its chunk ends,
    and the sum waits, per block of tokens, only
    for the chunks that hold the rows it adds (each chunk's copy-done flag), so it runs while the copy engines still
    move later chunks. A wait that fails, here or before, sets this rank's FREE_SLOT words, which its reset stream
    waits for."""
    TB: tl.constexpr = 8 if RP == 2 else 4  # tokens a program sums per step (see above)
    CP: tl.constexpr = 4 if CHUNKS <= 4 else 8  # (at most MAX_CHUNKS)
    if trace_ptr is not None:
        t_start = ptx.globaltimer()
    state_ptr = state_of(ctx_ptr)
    expected = tl.load(state_ptr + 2, volatile=True)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    own_free = slot_of(ctx_ptr, tl.load(ctx_ptr + CTX_SIG), rank, FREE_SLOT)
    if failed_before(state_ptr):
        if pid == 0:
            free_copy_stream(own_free, R)
        return
    # every peer has summed the previous combine: its combine area and chunk ends are free to overwrite
    wait_for_peers(ctx_ptr, state_ptr, SUMMED_SLOT, rank, R, 1, expected, 8)
    if (pid == 0) & (tl.load(state_ptr + FAIL_WORD, volatile=True) != 0):  # a wait failed
        free_copy_stream(own_free, R)
    cols = tl.arange(0, RP)
    cc = tl.arange(0, CP)
    y_rows = tl.load(split_ptr + R * CHUNKS)
    starts_ptr = split_ptr + R * CHUNKS + 1
    self_start = tl.load(starts_ptr + rank)
    t_sum = tl.where(tl.load(starts_ptr + R) > y_rows, 0, T)  # (an overflowed receive sums nothing)
    if pid == 0:  # each source learns where the chunks of the rows it gets back end
        off_ends = tl.load(ctx_ptr + CTX_CHUNK_ENDS)
        for d in range(R):
            if d != rank:
                ends_there = (tl.load(ctx_ptr + d) + off_ends).to(tl.pointer_type(tl.int32)) + rank * CHUNKS
                tl.store(ends_there + cc, tl.load(split_ptr + d * CHUNKS + cc, mask=cc < CHUNKS), mask=cc < CHUNKS)
    push_rows_back(y_ptr, yw_ptr, starts_ptr, ctx_ptr, split_ptr, H, K, R, rank, max_tokens, y_rows, HB, CHUNKS, TB)
    signal_all(ctx_ptr, tl.load(ctx_ptr + CTX_SIG), 2, rank, R)
    wait_for_peers(ctx_ptr, state_ptr, 2, rank, R, 0, expected + programs, 3)
    copies_seen = tl.load(state_ptr + COPIES_WORD + 1, volatile=True) + 1
    ends_here = (tl.load(ctx_ptr + rank) + tl.load(ctx_ptr + CTX_CHUNK_ENDS)).to(tl.pointer_type(tl.int32))
    ends = tl.load(ends_here + cols[:, None] * CHUNKS + cc[None, :], mask=(cols[:, None] < R) & (cc[None, :] < CHUNKS),
                   other=2**30, volatile=True)  # [RP, CP] chunk ends per source
    copied_end = tl.max(tl.where(cc[None, :] == CHUNKS - 1, ends, -1), axis=1)  # [RP] rows copied per source
    landed = tl.full((RP,), -1, tl.int32)  # per source, the last chunk this program has seen arrive
    # the combine area as typed pointers (alignment known: loads vectorize); its weights follow its rows
    cw = (cx_ptr + (R * max_tokens).to(tl.int64) * H).to(tl.pointer_type(tl.float32), bitcast=True)
    y_bf16 = y_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    if yw_ptr is not None:  # (while the copies land)
        sum_weights(pos_ptr, t_sum, R, rank, self_start, yw_ptr, cw, max_tokens, out_w_ptr, K, KP, RP)
    for t0 in range(pid * TB, t_sum, programs * TB):
        t = t0 + tl.arange(0, TB)
        pos = tl.load(pos_ptr + t.to(tl.int64)[:, None] * R + cols[None, :],
                      mask=(t < T)[:, None] & (cols[None, :] < R), other=-1)
        # [RP] the last copied row each source returns for these tokens (rows past the copies were pushed by the
        # source's SMs before the barrier above: a block whose last row was pushed may still hold copied rows of
        # the last chunk)
        last = tl.max(tl.where(pos < copied_end[None, :], pos, -1), axis=0)
        need = tl.sum((ends <= last[:, None]).to(tl.int32), axis=1)  # its chunk
        need = tl.where((last >= 0) & (cols != rank), need, -1)
        if tl.max(need - landed, axis=0) > 0:
            flags = (tl.load(ctx_ptr + rank) + tl.load(ctx_ptr + CTX_COPIED)).to(tl.pointer_type(tl.int32)) + R
            for d in range(R):
                c = pick(need, cols, d)
                if c > pick(landed, cols, d):  # chunks land in order: chunk c's flag covers the earlier ones
                    wait_for_one(flags + c * R + d, copies_seen, d, tl.load(ctx_ptr + CTX_TIMEOUT),
                                 status_of(ctx_ptr), state_of(ctx_ptr) + FAIL_WORD, 9)
            tl.debug_barrier()
            landed = tl.maximum(landed, need)
        sum_returned_rows(t, t < T, pos_ptr, R, rank, self_start, y_bf16, yw_ptr, cx_ptr, cw, max_tokens, out_ptr,
                          out_w_ptr, H, K, HB, KP, RP, TB, False)
    # every source's chain has ended (its last flag, sent to every rank): see FREE_SLOT
    flags = (tl.load(ctx_ptr + rank) + tl.load(ctx_ptr + CTX_COPIED)).to(tl.pointer_type(tl.int32)) + R
    timeout_ns = tl.load(ctx_ptr + CTX_TIMEOUT)
    status_ptr = status_of(ctx_ptr)
    fail_ptr = state_of(ctx_ptr) + FAIL_WORD
    copies_seen = tl.load(state_of(ctx_ptr) + COPIES_WORD + 1, volatile=True) + 1  # (as above: the last program
    # stores it only after every program has come here)
    for d in range(R):
        if (d != rank) & (pick(landed, cols, d) < CHUNKS - 1):
            wait_for_one(flags + (CHUNKS - 1) * R + d, copies_seen, d, timeout_ns, status_ptr, fail_ptr, 9)
    tl.debug_barrier()
    sig = tl.load(ctx_ptr + CTX_SIG)
    signal_all(ctx_ptr, sig, SUMMED_SLOT, rank, R)  # this program's reads of the combine area are done
    if finish(state_of(ctx_ptr), 2, expected, programs, programs, copies_seen, COPIES_WORD + 1):
        report_short_rows(ctx_ptr, rank, R, RP)
        # every program's reads are done: each source's copy stream may copy its next combine's rows
        for d in range(R):
            if d != rank:
                ptx.atom_add_release_sys(slot_of(ctx_ptr, sig, d, FREE_SLOT) + rank, 1)
    if trace_ptr is not None:
        record_block(trace_ptr, trace_tag, t_start)
