"""The SM-push dispatch of rows as they are (BF16, or FP8 with their scales), and the start and end every dispatch
kernel shares.

Token t goes to receive row ``send_start[d] + pos[t, d]`` of every destination d with ``pos >= 0`` (``send_start``:
the notify kernel's layout, ``pos``: the host's or the copy plan's positions). Each of the persistent programs takes
tokens ``pid * TB, (pid + programs) * TB, ...``; after its tokens it signals every destination and waits until every
program of every source has signalled it (`end_dispatch`).
"""

import triton
import triton.language as tl

from smsplit import ptx
from smsplit.trace import record_block

from .common import (COPIES_WORD, CTX_COPIED, CTX_SCALES, CTX_SIG, CTX_SRC, CTX_STATUS, CTX_TIMEOUT, CTX_TOPK,
                     CTX_WEIGHTS, CTX_X, FAIL_WORD, FINISHED_WORD, STARTED_SLOT, X_FREE_SLOT, column, failed_before,
                     finish, local_experts, pick, rank_of, signal_all, slot_of, state_of, wait_for_ranks)
from .rows import load_tokens

TOKENS_PER_STEP = tl.constexpr(4)  # tokens a program moves per step (BF16 / FP8 dispatch 258 / 440 us at 1, 224 /
# 245 at 4, 222 / 372 at 8: docs/design-notes.md)


@triton.jit
def begin_dispatch(ctx_ptr):
    """What a dispatch kernel reads first: ``(state_ptr, rank, expected, finished)``, this rank's state words and
    rank (from the context table), the arrivals per source its end waits for and the dispatches finished before this
    one (read before any program of this launch can finish). The kernel then returns at once if an earlier wait
    failed (`failed_before`), else starts (`start_dispatch`)."""
    state_ptr = state_of(ctx_ptr)
    expected = tl.load(state_ptr + 1, volatile=True)
    finished = tl.load(state_ptr + FINISHED_WORD, volatile=True)
    return state_ptr, rank_of(ctx_ptr), expected, finished


@triton.jit
def start_dispatch(ctx_ptr, state_ptr, rank, R, finished, GATE: tl.constexpr, COPIES: tl.constexpr):
    """Program 0 tells every rank that this rank has started this dispatch (STARTED_SLOT; COPIES: also X_FREE_SLOT,
    which the peers' copy streams wait for), after this rank's earlier work on the stream (reads of the last
    results). GATE (a cached dispatch: no count exchange before it): every program then waits, before storing into
    any peer, until every peer has started this dispatch (its ``finished + 1``-th)."""
    sig = tl.load(ctx_ptr + CTX_SIG)
    if tl.program_id(0) == 0:
        for d in range(R):
            ptx.atom_add_release_sys(slot_of(ctx_ptr, sig, d, STARTED_SLOT) + rank, 1)
            if COPIES:
                if d != rank:
                    ptx.st_release_sys(slot_of(ctx_ptr, sig, d, X_FREE_SLOT) + rank, 1)
    if GATE:
        status_ptr = tl.load(ctx_ptr + CTX_STATUS).to(tl.pointer_type(tl.int32))
        wait_for_ranks(slot_of(ctx_ptr, sig, rank, STARTED_SLOT), 0, 1, R, rank, 1, finished + 1,
                       tl.load(ctx_ptr + CTX_TIMEOUT), status_ptr, state_ptr + FAIL_WORD, 5)


@triton.jit
def receive_offsets(ctx_ptr):
    """The receive area's offsets in every rank's buffer, loaded once per program (a load in the loops would repeat
    at every store: the compiler cannot tell the table from the rows): rows, scales, top-k, weights, source."""
    return (tl.load(ctx_ptr + CTX_X), tl.load(ctx_ptr + CTX_SCALES), tl.load(ctx_ptr + CTX_TOPK),
            tl.load(ctx_ptr + CTX_WEIGHTS), tl.load(ctx_ptr + CTX_SRC))


@triton.jit
def store_metadata(offs, base, row, ok, t, d, scale, topk, weights, K, n_groups, num_local_experts,
                   HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_WEIGHTS: tl.constexpr, GROUPS: tl.constexpr,
                   KP: tl.constexpr):
    """Store what goes with tokens ``t``'s rows on destination d (buffer ``base``, receive rows ``row`` ``[TB, 1]``
    where ``ok``): their scales (HAS_SCALES), top-k ids as d's local experts, weights, and the tokens' index."""
    off_x, off_scales, off_topk, off_weights, off_src = offs
    grp = tl.arange(0, GROUPS)[None, :]
    k = tl.arange(0, KP)[None, :]
    if HAS_SCALES:
        dst_s = (base + off_scales + row * n_groups * 4).to(tl.pointer_type(tl.float32))
        tl.store(dst_s + grp, scale, mask=ok & (grp < n_groups))
    if HAS_TOPK:
        dst_k = (base + off_topk + row * K * 8).to(tl.pointer_type(tl.int64))
        tl.store(dst_k + k, local_experts(topk, d, num_local_experts), mask=ok & (k < K))
    if HAS_WEIGHTS:
        dst_w = (base + off_weights + row * K * 4).to(tl.pointer_type(tl.float32))
        tl.store(dst_w + k, weights, mask=ok & (k < K))
    dst_i = (base + off_src + row * 4).to(tl.pointer_type(tl.int32))
    tl.store(dst_i, t[:, None], mask=ok)


@triton.jit
def end_dispatch(ctx_ptr, offs, state_ptr, layout_ptr, rank, R, K, row_bytes, n_groups, num_worst, expected, finished,
                 COPIES: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                 VEC: tl.constexpr, GROUPS: tl.constexpr, KP: tl.constexpr, TB: tl.constexpr):
    """After a program's tokens: signal every destination, wait for every source's programs (COPIES: and for
    every peer's copy-done flag, once more than seen so far), write this rank's padding rows past the received ones
    up to ``num_worst`` (zeros, scales 0, top-k -1, weights 0, source -1) and end the phase (the last program)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    status_ptr = tl.load(ctx_ptr + CTX_STATUS).to(tl.pointer_type(tl.int32))
    timeout_ns = tl.load(ctx_ptr + CTX_TIMEOUT)
    own = tl.load(ctx_ptr + rank)
    sig = tl.load(ctx_ptr + CTX_SIG)
    off_x, off_scales, off_topk, off_weights, off_src = offs
    signal_all(ctx_ptr, sig, 1, rank, R)
    wait_for_ranks(slot_of(ctx_ptr, sig, rank, 1), 0, 1, R, rank, 0, expected + programs, timeout_ns, status_ptr,
                   state_ptr + FAIL_WORD, 2)
    copies_seen = -1
    if COPIES:
        copies_seen = tl.load(state_ptr + COPIES_WORD, volatile=True) + 1
        wait_for_ranks((own + tl.load(ctx_ptr + CTX_COPIED)).to(tl.pointer_type(tl.int32)), 0, 1, R, rank, 1,
                       copies_seen, timeout_ns, status_ptr, state_ptr + FAIL_WORD, 7)
    if num_worst > 0:  # padding rows: zeros, top-k -1, source -1
        vec = tl.arange(0, VEC)[None, :]
        grp = tl.arange(0, GROUPS)[None, :]
        k = tl.arange(0, KP)[None, :]
        total = tl.load(layout_ptr + 2 * R)
        for r0 in range(total + pid * TB, num_worst, programs * TB):
            r = r0 + tl.arange(0, TB)
            ok = (r < num_worst)[:, None]
            row = r.to(tl.int64)[:, None]
            zero = tl.zeros((TB, VEC), dtype=tl.int32)
            dst = (own + off_x + row * row_bytes).to(tl.pointer_type(tl.int32))
            ptx.st_global_na_v4(dst + 4 * vec, zero, zero, zero, zero, ok & (vec < row_bytes // 16))
            if HAS_SCALES:
                dst_s = (own + off_scales + row * n_groups * 4).to(tl.pointer_type(tl.float32))
                tl.store(dst_s + grp, tl.zeros((TB, GROUPS), dtype=tl.float32), mask=ok & (grp < n_groups))
            if HAS_TOPK:
                dst_k = (own + off_topk + row * K * 8).to(tl.pointer_type(tl.int64))
                tl.store(dst_k + k, tl.full((TB, KP), -1, dtype=tl.int64), mask=ok & (k < K))
            if HAS_WEIGHTS:
                dst_w = (own + off_weights + row * K * 4).to(tl.pointer_type(tl.float32))
                tl.store(dst_w + k, tl.zeros((TB, KP), dtype=tl.float32), mask=ok & (k < K))
            dst_i = (own + off_src + row * 4).to(tl.pointer_type(tl.int32))
            tl.store(dst_i, tl.full((TB, 1), -1, dtype=tl.int32), mask=ok)
    if finish(state_ptr, 1, expected, programs, programs, copies_seen, COPIES_WORD):
        tl.store(state_ptr + FINISHED_WORD, finished + 1)


@triton.jit
def push_tokens(x_ptr, scales_ptr, topk_ptr, weights_ptr, pos_ptr, T, H, K, R, dest_start, dest_base, copied, offs,
                num_local_experts, X_BYTES: tl.constexpr, VEC: tl.constexpr, GROUPS: tl.constexpr, KP: tl.constexpr,
                RP: tl.constexpr):
    """The token loop of a dispatch that moves rows as they are: this program's tokens ``pid * TB, (pid + programs) *
    TB, ...`` (TB: `TOKENS_PER_STEP`) go to receive row ``dest_start[d] + pos[t, d]`` of every destination d with
    ``pos >= 0`` (buffer ``dest_base[d]``, region offsets ``offs``), the row itself only where ``pos >= copied[d]``
    (below: the rows copy engines move), its metadata always.

    Software-pipelined: each step issues the next step's loads (rows, positions, top-k, weights) before its own
    stores, which store what the step before loaded. A step that loads its rows and then stores them leaves the order
    to ptxas, which (at 64 registers, and with 128 as well) puts each 16-byte load just before its store: a warp
    then waits for 6 to 8 load round trips one after another per step of 4 tokens (2 vectors a token per thread),
    and the loop is latency-bound (BF16, hidden 7168, 4096 tokens at 20 SMs: 209.7 us at 8 round trips a step,
    158.8 at 6, on an H100 at one rank; about 0.5 us per round trip). A load cannot move past the loop's back edge,
    so a step waits for one round trip, with all its loads in flight.
    """
    HAS_SCALES: tl.constexpr = scales_ptr is not None
    HAS_TOPK: tl.constexpr = topk_ptr is not None
    HAS_WEIGHTS: tl.constexpr = weights_ptr is not None
    TB: tl.constexpr = TOKENS_PER_STEP
    pid = tl.program_id(0)
    stride = tl.num_programs(0) * TB
    cols = tl.arange(0, RP)
    vec = tl.arange(0, VEC)[None, :]
    row_bytes = H * X_BYTES
    n_groups = H // 128
    off_x = offs[0]
    t = pid * TB + tl.arange(0, TB)
    w0, w1, w2, w3, scale, topk, weights, pos = load_tokens(
        t, t < T, x_ptr, scales_ptr, topk_ptr, weights_ptr, pos_ptr, H, K, R, X_BYTES, False, HAS_SCALES, HAS_TOPK,
        HAS_WEIGHTS, VEC, GROUPS, KP, RP, TB, True)
    for t0 in range(pid * TB, T, stride):
        t = t0 + tl.arange(0, TB)
        nt = t + stride  # the next step's tokens, loaded before this step's stores
        n0, n1, n2, n3, n_scale, n_topk, n_weights, n_pos = load_tokens(
            nt, nt < T, x_ptr, scales_ptr, topk_ptr, weights_ptr, pos_ptr, H, K, R, X_BYTES, False, HAS_SCALES,
            HAS_TOPK, HAS_WEIGHTS, VEC, GROUPS, KP, RP, TB, True)
        for d in tl.static_range(RP):  # unrolled: d is a constant, the picks are selects
            p = column(pos, cols, d)
            ok = (p >= 0)[:, None]
            row = pick(dest_start, cols, d) + p.to(tl.int64)[:, None]  # [TB, 1]
            base = pick(dest_base, cols, d)
            dst = (base + off_x + row * row_bytes).to(tl.pointer_type(tl.int32))
            keep = (p >= pick(copied, cols, d))[:, None]  # not the rows the copy engines move
            ptx.st_global_na_v4(dst + 4 * vec, w0, w1, w2, w3, ok & keep & (vec < row_bytes // 16))
            store_metadata(offs, base, row, ok, t, d, scale, topk, weights, K, n_groups, num_local_experts,
                           HAS_SCALES, HAS_TOPK, HAS_WEIGHTS, GROUPS, KP)
        w0, w1, w2, w3, scale, topk, weights, pos = n0, n1, n2, n3, n_scale, n_topk, n_weights, n_pos


@triton.jit(do_not_specialize=["trace_tag"])  # a new tag id must not recompile
def dispatch_kernel(x_ptr, scales_ptr, topk_ptr, weights_ptr, pos_ptr, layout_ptr, ctx_ptr,
                    T, H, K, R, num_local_experts, num_worst,
                    GATE: tl.constexpr, GROUPS: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr,
                    trace_ptr, trace_tag):
    """Push every token's row (x as int32 words: BF16, or FP8 e4m3 when ``scales_ptr`` is given, with its fp32
    scales, one per 128 values) with 16-byte non-caching loads and stores into every destination's receive rows,
    and its top-k (as the destination's local expert ids), weights and index beside it. ``topk_ptr``,
    ``weights_ptr``, ``scales_ptr``, ``trace_ptr``: None when absent. GATE: a cached dispatch (`start_dispatch`).
    GROUPS: the scales of a row (``H / 128``) as a power of two; a row's 16-byte vectors (VEC) follow from it."""
    if trace_ptr is not None:
        t_start = ptx.globaltimer()
    state_ptr, rank, expected, finished = begin_dispatch(ctx_ptr)
    if failed_before(state_ptr):
        return
    start_dispatch(ctx_ptr, state_ptr, rank, R, finished, GATE, False)
    HAS_SCALES: tl.constexpr = scales_ptr is not None  # FP8 rows
    X_BYTES: tl.constexpr = 1 if HAS_SCALES else 2
    VEC: tl.constexpr = GROUPS * 8 * X_BYTES  # (H a multiple of 128: the power of two above H * X_BYTES / 16)
    cols = tl.arange(0, RP)
    dest_start = tl.load(layout_ptr + cols, mask=cols < R, other=0).to(tl.int64)
    dest_base = tl.load(ctx_ptr + cols, mask=cols < R, other=0)
    offs = receive_offsets(ctx_ptr)
    push_tokens(x_ptr, scales_ptr, topk_ptr, weights_ptr, pos_ptr, T, H, K, R, dest_start, dest_base,
                tl.zeros((RP,), dtype=tl.int32), offs, num_local_experts, X_BYTES, VEC, GROUPS, KP, RP)
    end_dispatch(ctx_ptr, offs, state_ptr, layout_ptr, rank, R, K, H * X_BYTES, H // 128, num_worst, expected,
                 finished, False, HAS_SCALES, topk_ptr is not None, weights_ptr is not None, VEC, GROUPS, KP,
                 TOKENS_PER_STEP)
    if trace_ptr is not None:
        record_block(trace_ptr, trace_tag, t_start)
