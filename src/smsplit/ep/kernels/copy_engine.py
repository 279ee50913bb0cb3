"""The copy-engine transport's kernels (`smsplit.ep.copy_engine`): a gate per call, the pack of each rank's tokens
into its staging area (its own rows straight into the received tensors), and the sum of the rows the copy engines
brought back.

Each rank's `CopyEngineTransport` keeps a context table (int64, `CE_WORDS`): every rank's buffer address in
``[0, MAX_RANKS)``, then the transport's constants (`CE_TIMEOUT` ...). The gate, which runs before every pack and
reduce on the caller's stream, writes the call's values (tokens, tokens per chunk, where this rank's own rows start,
local experts, epoch) into the call words of its phase (`CALL_WORDS` per phase), which the pack or reduce after it
reads: their signatures hold the call's tensors and the few values their loops read (a kernel parameter stays in the
constant bank), and a new call's values never recompile them.
"""

import triton
import triton.language as tl

from smsplit import ptx
from smsplit.trace import record_block

from .common import column, local_experts, wait_for_ranks
from .rows import load_tokens, sum_returned_rows

# context table words (int64) after the MAX_RANKS buffer addresses
CE_TIMEOUT = tl.constexpr(16)  # ns a wait may take
CE_STATUS = tl.constexpr(17)  # address of the pinned status words (phase, peer, seen, expected)
CE_FAIL = tl.constexpr(18)  # address of this rank's failure word (int32; set by a wait that timed out)
CE_DONE = tl.constexpr(19)  # address of the exit counters (int32): the pack's per chunk, then the reduce's
CE_CALL = tl.constexpr(20)  # address of the call words (int32, [2, CALL_WORDS]: dispatch, combine)
CE_RANK = tl.constexpr(21)
CE_M = tl.constexpr(22)  # max_tokens: the slots per source in the staging and combine areas
CE_NC = tl.constexpr(23)  # chunks a rank's tokens are cut into
CE_SX = tl.constexpr(24)  # region offsets in every rank's buffer: the staging area (rows, scales, top-k, weights,
CE_SS = tl.constexpr(25)  # source index)
CE_STOPK = tl.constexpr(26)
CE_SW = tl.constexpr(27)
CE_SSRC = tl.constexpr(28)
CE_GATE = tl.constexpr(29)  # a gate's arrive, ack and ready flags: the dispatch's (3 words), then the combine's
CE_WORDS = 35
# call words (int32) of a phase, written by its gate
CALL_T, CALL_CHUNK, CALL_SELF = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
CALL_LOCAL, CALL_EPOCH = tl.constexpr(3), tl.constexpr(4)
CALL_WORDS = tl.constexpr(8)
PACK_TOKENS = tl.constexpr(4)  # tokens a pack program moves per step
REDUCE_TOKENS = tl.constexpr(2)  # tokens a reduce program sums per step


@triton.jit
def call_words(ctx_ptr, combine):
    """The call words (int32 pointer) of the dispatch's (``combine`` 0) or the combine's (1) phase."""
    return tl.load(ctx_ptr + CE_CALL).to(tl.pointer_type(tl.int32)) + combine * CALL_WORDS


@triton.jit(do_not_specialize=["epoch", "T", "chunk_tokens", "self_start"])  # per-call values must not recompile
def gate_kernel(ctx_ptr, R, combine, epoch, T, chunk_tokens, self_start, num_local_experts):
    """One program: store this call's values into the call words of its phase (``combine``: 0 dispatch, 1
    combine) for the pack or reduce after it, tell every rank that this rank has entered call ``epoch`` of the
    phase, then wait (bounded) until every rank has entered it and has acknowledged (``ack >= epoch - 1``) that it
    is done with what this rank is about to overwrite. If a wait times out, write ``epoch`` into this rank's ready
    flags (``[R][NC]``) so that copy-engine streams waiting on them move on."""
    call = call_words(ctx_ptr, combine)
    tl.store(call + CALL_T, T)
    tl.store(call + CALL_CHUNK, chunk_tokens)
    tl.store(call + CALL_SELF, self_start)
    tl.store(call + CALL_LOCAL, num_local_experts)
    tl.store(call + CALL_EPOCH, epoch)
    rank = tl.load(ctx_ptr + CE_RANK).to(tl.int32)
    status_ptr = tl.load(ctx_ptr + CE_STATUS).to(tl.pointer_type(tl.int32))
    fail_ptr = tl.load(ctx_ptr + CE_FAIL).to(tl.pointer_type(tl.int32))
    timeout_ns = tl.load(ctx_ptr + CE_TIMEOUT)
    gate = ctx_ptr + CE_GATE + 3 * combine
    arrive_off, ack_off, force_off = tl.load(gate), tl.load(gate + 1), tl.load(gate + 2)
    phase = 5 + 3 * combine  # the status codes of `smsplit.ep.copy_engine.PHASES`
    own = tl.load(ctx_ptr + rank)
    own_ack = (own + ack_off).to(tl.pointer_type(tl.int32))
    tl.store(own_ack + rank, epoch)  # this rank never waits for itself
    for d in range(R):
        arrive = (tl.load(ctx_ptr + d) + arrive_off).to(tl.pointer_type(tl.int32))
        ptx.st_release_sys(arrive + rank, epoch)
    own_arrive = (own + arrive_off).to(tl.pointer_type(tl.int32))
    wait_for_ranks(own_arrive, 0, 1, R, rank, 0, epoch, timeout_ns, status_ptr, fail_ptr, phase)
    wait_for_ranks(own_ack, 0, 1, R, rank, 1, epoch - 1, timeout_ns, status_ptr, fail_ptr, phase + 1)
    if tl.load(fail_ptr, volatile=True) != 0:
        force = (own + force_off).to(tl.pointer_type(tl.int32))
        for i in range(R * tl.load(ctx_ptr + CE_NC).to(tl.int32)):
            tl.store(force + i, epoch)


@triton.jit(do_not_specialize=["trace_tag"])  # a new tag id must not recompile
def pack_kernel(x_ptr, scales_ptr, topk_ptr, weights_ptr, pos_ptr, ctx_ptr,
                recv_x, recv_scales, recv_topk, recv_weights, recv_src, H, K, R,
                GROUPS: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr, trace_ptr, trace_tag):
    """Token t goes to row ``pos[t, d]`` of destination d's staging area (this rank's symmetric buffer,
    read by d's copy engine) or, for d == rank, straight to row ``self_start + pos[t, rank]`` of the
    received tensors. Tokens go in NC chunks of ``chunk_tokens``; when every program has finished a
    chunk, the last one release-stores ``epoch`` into ``ready[rank][chunk]`` of every other rank (the call's values
    from its gate's call words).

    ``x_ptr``: int32 words of BF16 or FP8 rows as they are, or a float x (bf16, fp16, fp32) quantized here to e4m3
    (its scales, one per 128 values, into ``recv_scales`` and the staging area); ``scales_ptr``: an FP8 x's scales;
    ``topk_ptr``, ``weights_ptr``, ``trace_ptr``: None when absent (the received tensors they fill are then
    placeholders). GROUPS: the scales of a row as a power of two (a row's 16-byte vectors follow from it)."""
    QUANTIZE: tl.constexpr = x_ptr.dtype.element_ty != tl.int32
    HAS_SCALES: tl.constexpr = scales_ptr is not None
    HAS_TOPK: tl.constexpr = topk_ptr is not None
    HAS_WEIGHTS: tl.constexpr = weights_ptr is not None
    X_BYTES: tl.constexpr = 1 if HAS_SCALES else (1 if QUANTIZE else 2)
    VEC: tl.constexpr = GROUPS * 8 * X_BYTES  # (H a multiple of 128)
    TB: tl.constexpr = PACK_TOKENS
    if trace_ptr is not None:
        t_start = ptx.globaltimer()
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    call = call_words(ctx_ptr, 0)
    T = tl.load(call + CALL_T)
    chunk_tokens = tl.load(call + CALL_CHUNK)
    self_start = tl.load(call + CALL_SELF)
    num_local_experts = tl.load(call + CALL_LOCAL)
    rank = tl.load(ctx_ptr + CE_RANK).to(tl.int32)
    M = tl.load(ctx_ptr + CE_M).to(tl.int32)
    NC = tl.load(ctx_ptr + CE_NC).to(tl.int32)
    done_ptr = tl.load(ctx_ptr + CE_DONE).to(tl.pointer_type(tl.int32))
    cols = tl.arange(0, RP)
    # staging regions of this rank's buffer, as typed pointers
    own = tl.load(ctx_ptr + rank)
    sx = (own + tl.load(ctx_ptr + CE_SX)).to(tl.pointer_type(tl.uint8))
    ss = (own + tl.load(ctx_ptr + CE_SS)).to(tl.pointer_type(tl.float32))
    stopk = (own + tl.load(ctx_ptr + CE_STOPK)).to(tl.pointer_type(tl.int64))
    sw = (own + tl.load(ctx_ptr + CE_SW)).to(tl.pointer_type(tl.float32))
    ssrc = (own + tl.load(ctx_ptr + CE_SSRC)).to(tl.pointer_type(tl.int32))
    vec = tl.arange(0, VEC)[None, :]
    row_bytes = H * X_BYTES
    n_vec = row_bytes // 16
    vmask = vec < n_vec
    n_groups = H // 128
    grp = tl.arange(0, GROUPS)[None, :]
    gmask = grp < n_groups
    k = tl.arange(0, KP)[None, :]
    kmask = k < K
    for c in range(NC):
        t_end = tl.minimum(T, (c + 1) * chunk_tokens)
        for t0 in range(c * chunk_tokens + pid * TB, t_end, programs * TB):
            t = t0 + tl.arange(0, TB)
            w0, w1, w2, w3, scale, topk, weights, pos = load_tokens(
                t, t < t_end, x_ptr, scales_ptr, topk_ptr, weights_ptr, pos_ptr, H, K, R,
                X_BYTES, QUANTIZE, HAS_SCALES, HAS_TOPK, HAS_WEIGHTS, VEC, GROUPS, KP, RP, TB, True)
            for d in range(R):
                p = column(pos, cols, d)
                ok = (p >= 0)[:, None]
                if d == rank:
                    row = self_start + p.to(tl.int64)[:, None]
                    x_dst = recv_x.to(tl.pointer_type(tl.uint8), bitcast=True)
                    s_dst = recv_scales
                    k_dst = recv_topk
                    w_dst = recv_weights
                    i_dst = recv_src
                else:
                    row = d * M + p.to(tl.int64)[:, None]  # destination d's rows in each staging region
                    x_dst = sx
                    s_dst = ss
                    k_dst = stopk
                    w_dst = sw
                    i_dst = ssrc
                dst = x_dst.to(tl.pointer_type(tl.int32), bitcast=True) + row * (row_bytes // 4)
                ptx.st_global_na_v4(dst + 4 * vec, w0, w1, w2, w3, ok & vmask)  # e4m3 rows too: 16-byte stores
                if X_BYTES == 1:
                    tl.store(s_dst + row * n_groups + grp, scale, mask=ok & gmask)
                if HAS_TOPK:
                    tl.store(k_dst + row * K + k, local_experts(topk, d, num_local_experts), mask=ok & kmask)
                if HAS_WEIGHTS:
                    tl.store(w_dst + row * K + k, weights, mask=ok & kmask)
                tl.store(i_dst + row, t[:, None], mask=ok)
        tl.debug_barrier()
        ptx.fence_acq_rel_sys()
        old = tl.atomic_add(done_ptr + c, 1, sem="acq_rel", scope="gpu")
        if old == programs - 1:
            tl.store(done_ptr + c, 0)
            ptx.fence_acq_rel_sys()
            ready_off = tl.load(ctx_ptr + CE_GATE + 2)
            epoch = tl.load(call + CALL_EPOCH)
            for d in range(R):
                if d != rank:
                    ready = (tl.load(ctx_ptr + d) + ready_off).to(tl.pointer_type(tl.int32))
                    ptx.st_release_sys(ready + rank * NC + c, epoch)
    if trace_ptr is not None:
        record_block(trace_ptr, trace_tag, t_start)


@triton.jit(do_not_specialize=["trace_tag"])  # a new tag id must not recompile
def reduce_kernel(y_ptr, yw_ptr, pos_ptr, ctx_ptr, cx_ptr, out_ptr, out_w_ptr, H, K, R, rank, M,
                  HB: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr, trace_ptr, trace_tag):
    """Sum, for each of this rank's tokens, its rows from the ranks it went to (fp32) into out (bf16):
    its own rank's row straight from y, the others' from the combine area (``cx_ptr``: this rank's, bf16 rows
    ``[R * M, H]``, its fp32 weights right after), where the copy engines of those ranks put them. Chunk by chunk:
    wait (bounded) until every rank has flagged the chunk. At the end the last program release-stores ``epoch``
    into ``combine_ack[rank]`` of every other rank (the call's values from its gate's call words). ``yw_ptr``,
    ``out_w_ptr`` (top-k weights), ``trace_ptr``: None when absent."""
    TB: tl.constexpr = REDUCE_TOKENS
    if trace_ptr is not None:
        t_start = ptx.globaltimer()
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    call = call_words(ctx_ptr, 1)
    T = tl.load(call + CALL_T)
    chunk_tokens = tl.load(call + CALL_CHUNK)
    self_start = tl.load(call + CALL_SELF)
    NC = tl.load(ctx_ptr + CE_NC).to(tl.int32)
    cready = (tl.load(ctx_ptr + rank) + tl.load(ctx_ptr + CE_GATE + 5)).to(tl.pointer_type(tl.int32))
    cw = (cx_ptr + (R * M).to(tl.int64) * H).to(tl.pointer_type(tl.float32), bitcast=True)
    for c in range(NC):  # (the call's epoch and the table's words loaded per chunk: none held through the sum)
        wait_for_ranks(cready, c, NC, R, rank, 1, tl.load(call_words(ctx_ptr, 1) + CALL_EPOCH),
                       tl.load(ctx_ptr + CE_TIMEOUT), tl.load(ctx_ptr + CE_STATUS).to(tl.pointer_type(tl.int32)),
                       tl.load(ctx_ptr + CE_FAIL).to(tl.pointer_type(tl.int32)), 7)
        t_end = tl.minimum(T, (c + 1) * chunk_tokens)
        for t0 in range(c * chunk_tokens + pid * TB, t_end, programs * TB):
            t = t0 + tl.arange(0, TB)
            sum_returned_rows(t, t < t_end, pos_ptr, R, rank, self_start, y_ptr, yw_ptr, cx_ptr, cw, M, out_ptr,
                              out_w_ptr, H, K, HB, KP, RP, TB, yw_ptr is not None)  # slot [destination][position]
    tl.debug_barrier()
    exit_ptr = tl.load(ctx_ptr + CE_DONE).to(tl.pointer_type(tl.int32)) + NC
    old = tl.atomic_add(exit_ptr, 1, sem="acq_rel", scope="gpu")
    if old == programs - 1:
        tl.store(exit_ptr, 0)
        ptx.fence_acq_rel_sys()
        ack_off = tl.load(ctx_ptr + CE_GATE + 4)
        epoch = tl.load(call_words(ctx_ptr, 1) + CALL_EPOCH)  # (loaded again: not held through the sum)
        for d in range(R):
            if d != rank:
                ack = (tl.load(ctx_ptr + d) + ack_off).to(tl.pointer_type(tl.int32))
                ptx.st_release_sys(ack + rank, epoch)
    if trace_ptr is not None:
        record_block(trace_ptr, trace_tag, t_start)
