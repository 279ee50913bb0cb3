"""The combine: each rank pushes every row it received back into its source's combine area (one slot per expert
rank and position among the rows that rank received from the source, so each source's rows go back as one block),
signals, waits, and sums the slots of each of its tokens in fp32 (`smsplit.ep.kernels.rows.sum_returned_rows`).

First it waits until every peer has summed the previous combine, so that two combines in a row keep their rows, and
when done it signals that its sum is done. With WAIT_COPIES copy engines return the rows in chunks and the sum starts
on a chunk as soon as it has landed.

One kernel for both (31 parameters), with the transport's constants as parameters: its sum holds all 128 registers of
a thread at 16 warps, and ptxas's allocation there is on an edge. Split into two kernels (one per WAIT_COPIES), or with the
constants loaded from the context table, the same code spilled 68-88 bytes in the sum's loop under Triton 3.7-3.9
where this one spills none (the kernels' compile tests check it).
"""

import triton
import triton.language as tl

from smsplit import ptx
from smsplit.trace import record_block

from .common import (COPIES_WORD, FAIL_WORD, FREE_SLOT, SHORT_SLOT, SUMMED_SLOT, failed_before, finish, pick,
                     wait_for_one, wait_for_ranks)
from .rows import sum_returned_rows, sum_returned_weights

WEIGHTS_BLOCK = tl.constexpr(2048)  # the fp32 top-k weights a program pushes per step
WEIGHTS_TOKENS = tl.constexpr(64)  # the tokens whose weights a program sums per step
# tokens a program sums per step (TB): 8 with 2 ranks (the packed two-row sum; 2 ranks, 5 queued replays: 219.0 us
# at 8 against 250.1 at 4), else 4 (8 spill registers there)


@triton.jit
def _signal_all(bases_ptr, sig_off, rank, R):
    """Release-add 1 to ``signal[rank]`` of every peer (thread 0), after this program's stores."""
    tl.debug_barrier()
    ptx.fence_acq_rel_sys()
    for d in range(R):
        sig = (tl.load(bases_ptr + d) + sig_off).to(tl.pointer_type(tl.int32))
        ptx.atom_add_release_sys(sig + rank, 1)


@triton.jit
def _free_copy_stream(words, R):
    """Set this rank's R words at ``words`` (its FREE_SLOT or X_FREE_SLOT, one per peer) to 1 on an error path: its
    reset stream waits for them unbounded (cuStreamWaitValue32), and its copy stream for that, so a kernel that gives
    up frees both, never a hang."""
    for d in range(R):
        ptx.st_release_sys(words.to(tl.pointer_type(tl.int32)) + d, 1)


@triton.jit(do_not_specialize=["trace_tag", "y_rows"])  # a new tag id or receive size must not recompile
def combine_kernel(y_ptr, yw_ptr, layout_ptr, pos_ptr, bases_ptr, state_ptr, status_addr, own_buf,
                   chunk_ends_ptr, out_ptr, out_w_ptr, T, H, K, R, rank, max_tokens, y_rows,
                   off_cx, off_cw, off_chunk_ends, sig_off, off_copied, timeout_ns,
                   HB: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr, WAIT_COPIES: tl.constexpr,
                   CHUNKS: tl.constexpr, trace_ptr, trace_tag):
    """Push the i-th row received from each other rank back to slot [rank][i] of that source's combine area,
    then sum, for each of this rank's tokens, its rows from the ranks it went to (fp32; its own rank's row
    straight from y) into out (bf16).

    Copy engines may move the rows: ``chunk_ends`` (int32 ``[R, CHUNKS]``) ends each source's copied rows
    in CHUNKS chunks (positions among the rows received from it; the kernel pushes the rows past the last
    end, and all weights). WAIT_COPIES: program 0 tells each source its chunk ends, and the sum waits, per
    block of tokens, only for the chunks that hold the rows it adds (each chunk's copy-done flag), so it
    runs while the copy engines still move later chunks."""
    HAS_WEIGHTS: tl.constexpr = yw_ptr is not None  # (and out_w_ptr)
    VEC: tl.constexpr = HB // 8  # 16-byte vectors of a bf16 row
    TB: tl.constexpr = 8 if RP == 2 else 4  # tokens a program sums per step (see above)
    CP: tl.constexpr = 4 if CHUNKS <= 4 else 8  # (at most MAX_CHUNKS)
    status_ptr = status_addr.to(tl.pointer_type(tl.int32))
    fail_ptr = state_ptr + FAIL_WORD
    if trace_ptr is not None:
        t_start = ptx.globaltimer()
    expected = tl.load(state_ptr + 2, volatile=True)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    own = tl.load(bases_ptr + rank)
    if failed_before(state_ptr):
        if WAIT_COPIES:
            if pid == 0:
                _free_copy_stream(own + sig_off + FREE_SLOT * 64, R)
        return
    # every peer has summed the previous combine (its programs' SUMMED_SLOT signals): its combine area
    # and chunk ends are free to overwrite (two combines in a row, no dispatch between)
    wait_for_ranks((own + sig_off + SUMMED_SLOT * 64).to(tl.pointer_type(tl.int32)), 0, 1, R, rank, 1, expected,
                    timeout_ns, status_ptr, fail_ptr, 8)
    if WAIT_COPIES:
        if (pid == 0) & (tl.load(fail_ptr, volatile=True) != 0):  # a wait failed
            _free_copy_stream(own + sig_off + FREE_SLOT * 64, R)
    vec = tl.arange(0, VEC)[None, :]
    n_vec = H * 2 // 16
    vmask = vec < n_vec
    cols = tl.arange(0, RP)
    cc = tl.arange(0, CP)
    self_start = tl.load(layout_ptr + R + rank)
    # a receive that overflowed num_worst_tokens (status 4, which this rank's host raises) has rows past y's: none is
    # read past y_rows, this rank sums nothing, and each source of a row past y's is told (SHORT_SLOT, status 10)
    t_sum = tl.where(tl.load(layout_ptr + 2 * R) > y_rows, 0, T)
    if WAIT_COPIES:
        if pid == 0:  # each source learns where the chunks of the rows it gets back end
            for d in range(R):
                if d != rank:
                    ends_there = (tl.load(bases_ptr + d) + off_chunk_ends).to(tl.pointer_type(tl.int32)) + rank * CHUNKS
                    tl.store(ends_there + cc, tl.load(chunk_ends_ptr + d * CHUNKS + cc, mask=cc < CHUNKS), mask=cc < CHUNKS)
    # per source, its rows past the copies (all of them without copy engines), TB at a time, then the weights of
    # all its rows as one flat range (a source's rows are contiguous in y and in its combine slots)
    for d in range(R):
        if d != rank:
            received_from = tl.load(layout_ptr + R + d)
            received_to = tl.load(layout_ptr + R + d + 1)  # (word 2R is the total: the last source's end)
            start = tl.minimum(received_from, y_rows)
            end = tl.minimum(received_to, y_rows)
            base = tl.load(bases_ptr + d)
            # d has rows past y's (seen by d after the signal below)
            if (pid == 0) & (received_to > tl.maximum(received_from, y_rows)):
                ptx.st_release_sys((base + sig_off + SHORT_SLOT * 64).to(tl.pointer_type(tl.int32)) + rank, 1)
            first_slot = rank * max_tokens - start
            for r0 in range(start + tl.load(chunk_ends_ptr + d * CHUNKS + CHUNKS - 1) + pid * TB, end, programs * TB):
                r = r0 + tl.arange(0, TB)
                push = (r < end)[:, None] & vmask
                r64 = r.to(tl.int64)[:, None]
                w0, w1, w2, w3 = ptx.ld_global_nc_v4(y_ptr + r64 * (n_vec * 4) + 4 * vec, push)
                dst = (base + off_cx + (first_slot + r64) * H * 2).to(tl.pointer_type(tl.int32))
                ptx.st_global_na_v4(dst + 4 * vec, w0, w1, w2, w3, push)
            if HAS_WEIGHTS:
                n_w = (end - start) * K
                src_w = yw_ptr + start.to(tl.int64) * K
                dst_w = (base + off_cw + (rank * max_tokens).to(tl.int64) * K * 4).to(tl.pointer_type(tl.float32))
                for f0 in range(pid * WEIGHTS_BLOCK, n_w, programs * WEIGHTS_BLOCK):
                    f = f0 + tl.arange(0, WEIGHTS_BLOCK)
                    tl.store(dst_w + f, tl.load(src_w + f, mask=f < n_w), mask=f < n_w)
    _signal_all(bases_ptr, sig_off + 2 * 64, rank, R)
    wait_for_ranks((own + sig_off + 2 * 64).to(tl.pointer_type(tl.int32)), 0, 1, R, rank, 0, expected + programs,
                    timeout_ns, status_ptr, fail_ptr, 3)
    copies_seen = -1
    if WAIT_COPIES:
        copies_seen = tl.load(state_ptr + COPIES_WORD + 1, volatile=True) + 1
        ends_here = (own_buf + off_chunk_ends).to(tl.pointer_type(tl.int32), bitcast=True)
        ends = tl.load(ends_here + cols[:, None] * CHUNKS + cc[None, :], mask=(cols[:, None] < R) & (cc[None, :] < CHUNKS),
                       other=2**30, volatile=True)  # [RP, CP] chunk ends per source
        copied_end = tl.max(tl.where(cc[None, :] == CHUNKS - 1, ends, -1), axis=1)  # [RP] rows copied per source
        landed = tl.full((RP,), -1, tl.int32)  # per source, the last chunk this program has seen arrive
        flags = (own + off_copied).to(tl.pointer_type(tl.int32))  # chunk c's flag from source d: word c * R + d
    # the combine area as typed pointers off this rank's buffer tensor (alignment known: loads vectorize)
    cx = (own_buf + off_cx).to(tl.pointer_type(tl.bfloat16), bitcast=True)
    cw = (own_buf + off_cw).to(tl.pointer_type(tl.float32), bitcast=True)
    y_bf16 = y_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    if HAS_WEIGHTS:  # all pushed before the barrier: summed first, in a pass of their own (while the copies land; in
        # the rows' loop they spilled registers)
        for t0 in range(pid * WEIGHTS_TOKENS, t_sum, programs * WEIGHTS_TOKENS):
            t = t0 + tl.arange(0, WEIGHTS_TOKENS)
            pos = tl.load(pos_ptr + t.to(tl.int64)[:, None] * R + cols[None, :],
                          mask=(t < T)[:, None] & (cols[None, :] < R), other=-1)
            sum_returned_weights(t, t < T, pos, R, rank, self_start, yw_ptr, cw, max_tokens, out_w_ptr, K, KP, RP,
                                 WEIGHTS_TOKENS)
    for t0 in range(pid * TB, t_sum, programs * TB):
        t = t0 + tl.arange(0, TB)
        if WAIT_COPIES:
            pos = tl.load(pos_ptr + t.to(tl.int64)[:, None] * R + cols[None, :], mask=(t < T)[:, None] & (cols[None, :] < R),
                          other=-1)
            # [RP] the last copied row each source returns for these tokens (rows past the copies were pushed by
            # the source's SMs before the barrier above: a block whose last row was pushed may still hold copied
            # rows of the last chunk)
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
        sum_returned_rows(t, t < T, pos_ptr, R, rank, self_start, y_bf16, yw_ptr, cx, cw, max_tokens, out_ptr, out_w_ptr,
                          H, K, HB, KP, RP, TB, False)
    if WAIT_COPIES:  # every source's chain has ended (its last flag, sent to every rank): see FREE_SLOT
        for d in range(R):
            if (d != rank) & (pick(landed, cols, d) < CHUNKS - 1):
                wait_for_one(flags + (CHUNKS - 1) * R + d, copies_seen, d, timeout_ns, status_ptr, fail_ptr, 9)
        tl.debug_barrier()
    _signal_all(bases_ptr, sig_off + SUMMED_SLOT * 64, rank, R)  # this program's reads of the combine area are done
    last = finish(state_ptr, 2, expected, programs, programs, copies_seen, COPIES_WORD + 1)
    if last:  # (after the signals, so that the peers waiting for them are not held up by this check)
        short = tl.load((own + sig_off + SHORT_SLOT * 64).to(tl.pointer_type(tl.int32)) + cols, mask=cols < R, other=0,
                        volatile=True)
        if tl.max(short, axis=0) > 0:  # a peer's receive overflowed: some of this rank's rows did not come back
            if tl.load(status_ptr, volatile=True) == 0:
                tl.store(status_ptr + 1, tl.argmax(short, axis=0))
                tl.store(status_ptr, 10)
    if WAIT_COPIES:
        if last:  # every program's reads are done: each source's copy stream may copy its next combine's rows
            for d in range(R):
                if d != rank:
                    ptx.atom_add_release_sys((tl.load(bases_ptr + d) + sig_off + FREE_SLOT * 64).to(
                        tl.pointer_type(tl.int32)) + rank, 1)
    if trace_ptr is not None:
        record_block(trace_ptr, trace_tag, t_start)
