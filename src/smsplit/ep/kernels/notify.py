"""The count exchange that opens an uncached dispatch, and the counter bump that ends a copy stream's chain."""

import triton
import triton.language as tl

from .common import (CTX_COUNTS, CTX_SIG, CTX_TIMEOUT, failed_before, FAIL_WORD, finish, signal_all, slot_of, status_of,
                     wait_for_ranks)


@triton.jit
def notify_kernel(counts_ptr, ctx_ptr, state_ptr, layout_ptr, rank, R, num_worst, RP: tl.constexpr):
    """One program: write this rank's per-destination token counts (``counts_ptr``, int32 ``[R]``) into row ``rank``
    of every rank's count matrix, signal, wait for every rank's row, then write ``layout_ptr`` (int32):
    ``[0, R)`` where this rank's tokens start on each destination, ``[R, 2R]`` where each source's tokens start
    here (prefix, last = total), ``[2R + 1]`` rows received. A total past ``num_worst`` (> 0) is status 4."""
    status_ptr = status_of(ctx_ptr)
    if failed_before(state_ptr):  # (the host reads the status word before it trusts the layout)
        return
    sig = tl.load(ctx_ptr + CTX_SIG)
    counts_off = tl.load(ctx_ptr + CTX_COUNTS)
    expected = tl.load(state_ptr + 0, volatile=True)
    d = tl.arange(0, RP)
    dmask = d < R
    mine = tl.load(counts_ptr + d, mask=dmask, other=0)
    for p in range(R):
        row = (tl.load(ctx_ptr + p) + counts_off).to(tl.pointer_type(tl.int32)) + rank * R
        tl.store(row + d, mine, mask=dmask)
    signal_all(ctx_ptr, sig, 0, rank, R)
    own_counts = (tl.load(ctx_ptr + rank) + counts_off).to(tl.pointer_type(tl.int32))
    wait_for_ranks(slot_of(ctx_ptr, sig, rank, 0), 0, 1, R, rank, 0, expected + 1, tl.load(ctx_ptr + CTX_TIMEOUT),
                   status_ptr, state_ptr + FAIL_WORD, 1)
    s = tl.arange(0, RP)[:, None]
    dd = tl.arange(0, RP)[None, :]
    matrix = tl.load(own_counts + s * R + dd, mask=(s < R) & (dd < R), other=0, volatile=True)
    send_start = tl.sum(tl.where(s < rank, matrix, 0), axis=0)  # [RP] per destination
    from_source = tl.sum(tl.where(dd == rank, matrix, 0), axis=1)  # [RP] per source
    recv_end = tl.cumsum(from_source, axis=0)
    total = tl.sum(from_source, axis=0)
    tl.store(layout_ptr + d, send_start, mask=dmask)
    tl.store(layout_ptr + R + d, recv_end - from_source, mask=dmask)
    tl.store(layout_ptr + 2 * R, total)
    tl.store(layout_ptr + 2 * R + 1, total)
    if (num_worst > 0) & (total > num_worst):
        tl.store(status_ptr + 1, total)
        tl.store(status_ptr + 2, num_worst)
        tl.store(status_ptr, 4)
    finish(state_ptr, 0, expected, 1, 1, -1, 0)


@triton.jit
def bump_kernel(counter_ptr):
    """Add one to a device counter (one thread), after a copy stream's chain of copies: the copy-done flag value
    that the next chain copies to peers."""
    tl.store(counter_ptr, tl.load(counter_ptr) + 1)
