"""SM-push transport over NVLink: Triton kernels that write tokens straight into peers' buffers.

Every rank owns one symmetric buffer (``torch.distributed._symmetric_memory``: the same layout on
every rank, each rank's buffer mapped into every peer). A dispatch is two launches on the caller's
stream, both device-only (no host synchronization when the receive size is fixed):

1. ``notify`` (one program): write this rank's per-destination token counts into row ``rank`` of
   every peer's count matrix, signal, wait for every peer's row, then compute where this rank's
   tokens land on each destination and where each source's tokens start here.
2. ``dispatch`` (``num_sms`` persistent programs): each program takes tokens ``pid, pid + P, ...``,
   loads the row once with 16-byte non-caching loads (or quantizes it to FP8 e4m3 with one scale per
   128 values) and stores it, its top-k (as the destination's local expert ids), weights and source
   index into every destination's receive area with 16-byte stores. Then it signals each destination
   with a release add and waits until every program of every source has signalled it. With
   ``bulk="copy_engine"`` one copy-engine copy per peer moves the first rows of x instead (`_prefix_plan`)
   and the programs move the rest; rows quantized to FP8 here are pushed by the programs onto the same rows
   (or, with ``quantized_rows_by="copy_engine"``, staged in this rank's buffer and copied).

A combine first waits until every peer has summed the previous combine (so two combines in a row keep their
rows), pushes each received row back into its source's combine area (one slot per expert rank and
position among the rows that rank received from the source, so each source's rows go back as one block),
signals, waits, and sums the slots of each token in fp32 (with ``bulk="copy_engine"`` the copy engines move
the blocks in chunks and the sum starts on a chunk as soon as it has landed), then signals that its sum is done.

Waits are bounded: a wait that passes ``timeout_s`` records (phase, peer, counts) in a pinned host
word and lets the kernel finish; the host raises ``EPTimeoutError`` naming rank, peer and phase.

Received tensors are views into the buffer, valid until this rank's next dispatch: a dispatch writes into a
peer's receive area only once that peer has started the same dispatch, so whatever the peer queued on its stream
before it (reads of the previous results) is done. An uncached dispatch knows it from the count exchange; a cached
one waits for each peer's start signal (STARTED_SLOT), and its copies for each peer's X_FREE_SLOT word. So
dispatches may follow each other with no host synchronization (in a CUDA graph). `smsplit.ep.Buffer` copies the
results out. A dispatch bumps the buffer's autograd version, so a backward that saved a view raises instead of
reading overwritten data.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from smsplit import ptx
from smsplit.cuda_driver import StreamOps
from smsplit.fp8 import e4m3_v2_words, e4m3_v4_words, quantize_e4m3_bf16_vector_pairs, quantize_e4m3_groups
from smsplit.launch import FastLaunch
from smsplit.trace import record_block

from .layout import next_pow2 as _pow2
from .layout import region_offsets, token_positions
from .transport import (EPArgumentError, EPError, EPTimeoutError, check_combine_weights, symmetric_buffer,
                        worst_tokens_error)

SCALE_BLOCK = 128
ALIGN = 256
# what a timed-out wait was waiting for, by the code the kernels write into the status word (4 and 10: not waits:
# this rank's receive size passed num_worst_tokens, a peer's did so that this rank's combine misses rows)
WAITS = {1: "notify: waiting for rank {peer}'s token counts",
         2: "dispatch: waiting for rank {peer}'s rows",
         3: "combine: waiting for rank {peer}'s rows",
         5: "dispatch: waiting for rank {peer} to start the same dispatch",
         6: "dispatch: waiting for this rank's copies to land on rank {peer}",
         7: "dispatch: waiting for rank {peer}'s copies to land here",
         8: "combine: waiting for rank {peer} to finish summing the previous combine",
         9: "combine: waiting for a chunk copied from rank {peer}"}
BULK_MOVERS = ("sm", "copy_engine")
MAX_HOLE_SHARE = 0.125  # bulk="copy_engine": a peer's copied prefix may hold at most this share of tokens not sent there
MAX_CHUNKS = 8  # bulk="copy_engine": the most chunks a combine's copies are cut into

# local state words (per rank, not shared): [phase] arrivals per source seen so far, [FINISHED_WORD] dispatches
# this rank has finished, [4 + phase] programs of the current launch that have finished, [FAIL_WORD] set once a
# wait timed out, [COPIES_WORD + 0/1] copy-done flags per peer seen so far (bulk="copy_engine": dispatch, combine
# chunks)
STATE_WORDS = 10
FINISHED_WORD = tl.constexpr(3)
FAIL_WORD = tl.constexpr(7)
COPIES_WORD = tl.constexpr(8)
# shared signal words, 64 bytes per slot: slot [phase] counts the arrivals of a phase's programs per source
# (notify, dispatch, combine), slot SUMMED_SLOT the combine programs per rank that have finished their sums,
# slot FREE_SLOT (bulk="copy_engine") word [peer] 1 while this rank may copy a combine's rows into the peer's
# combine area (the peer has summed the previous ones; the peer's last combine program adds 1; this rank's reset
# stream waits for 1, lets the copy stream start its copies, and stores 0 beside them)
# slot STARTED_SLOT word [s] the dispatches rank s has started (its first launch's program 0 adds 1 on every rank),
# slot X_FREE_SLOT (bulk="copy_engine") word [s] 1 once rank s has started a dispatch that copies (not one whose
# kernel pushes every row): this rank's reset stream waits for 1 before its copy stream's dispatch copies into s's
# receive area, and stores 0 beside them
# slot SHORT_SLOT word [s] set (for good: the status it leads to is final) by rank s's combine when rank s received more
# rows than its num_worst_tokens, so that some of this rank's tokens went back uncombined
SUMMED_SLOT = tl.constexpr(3)
FREE_SLOT = tl.constexpr(4)
STARTED_SLOT = tl.constexpr(5)
X_FREE_SLOT = tl.constexpr(6)
SHORT_SLOT = tl.constexpr(7)
WEIGHTS_BLOCK = tl.constexpr(2048)  # combine: the fp32 top-k weights a program pushes per step
WEIGHTS_TOKENS = tl.constexpr(64)  # combine: the tokens whose weights a program sums per step


# --- device helpers --------------------------------------------------------------------------------

@triton.jit
def _wait_for_one(flag_ptr, target, peer, timeout_ns, status_ptr, fail_ptr, phase):
    """Wait (thread 0 spins; follow with ``tl.debug_barrier()``) until ``*flag_ptr >= target``, bounded by
    ``timeout_ns``, unless an earlier wait failed (device word ``fail_ptr``, read cheaply). On timeout thread 0
    writes (phase, peer, seen, expected) to the status words (pinned host memory, read by the host only: a read
    from every warp would cost a PCIe round trip each) and sets ``fail_ptr``, so every later wait returns at once."""
    if tl.load(fail_ptr, volatile=True) == 0:
        seen = ptx.wait_geq_sys(flag_ptr, target, timeout_ns)
        if seen < target:  # only thread 0 can see this
            tl.store(status_ptr + 1, peer)
            tl.store(status_ptr + 2, seen)
            tl.store(status_ptr + 3, target)
            tl.store(status_ptr, phase)
            tl.store(fail_ptr, 1)


@triton.jit
def _wait_for_ranks(flags_ptr, first, stride, R, rank, skip_self, target, timeout_ns, status_ptr, fail_ptr, phase):
    """Wait until ``flags_ptr[first + s * stride] >= target`` for every rank s < R (but ``rank`` when
    ``skip_self``), each wait bounded (`_wait_for_one`); the program waits at a barrier."""
    for s in range(R):
        if (skip_self == 0) | (s != rank):
            _wait_for_one(flags_ptr + first + s * stride, target, s, timeout_ns, status_ptr, fail_ptr, phase)
    tl.debug_barrier()


@triton.jit
def _failed_before(state_ptr):
    """Whether a wait of an earlier kernel of this rank timed out (its FAIL_WORD, stable while this kernel runs:
    the earlier kernels on the stream have ended). Such a kernel moves nothing and signals no peer: a kernel that
    skipped its waits but still signalled would put the peers' counters, and the copy streams' FREE words, out of
    step with their own calls (a reset stream's wait for a word, which the copy stream waits for, has no bound), see
    `smsplit.ep.Buffer`."""
    return tl.load(state_ptr + FAIL_WORD, volatile=True) != 0


@triton.jit
def _free_copy_stream(words, R):
    """Set this rank's R words at ``words`` (its FREE_SLOT or X_FREE_SLOT, one per peer) to 1 on an error path: its
    reset stream waits for them unbounded (cuStreamWaitValue32), and its copy stream for that, so a kernel that gives
    up frees both, never a hang."""
    for d in range(R):
        ptx.st_release_sys(words.to(tl.pointer_type(tl.int32)) + d, 1)


@triton.jit
def _signal_all(bases_ptr, sig_off, rank, R):
    """Release-add 1 to ``signal[rank]`` of every peer (thread 0), after this program's stores."""
    tl.debug_barrier()
    ptx.fence_acq_rel_sys()
    for d in range(R):
        sig = (tl.load(bases_ptr + d) + sig_off).to(tl.pointer_type(tl.int32))
        ptx.atom_add_release_sys(sig + rank, 1)


@triton.jit
def _finish(state_ptr, phase, expected, per_source, programs, copies_seen, copies_word):
    """The last program of a launch to finish advances the phase's expected arrivals per source
    (and, when ``copies_seen`` >= 0, stores it in word ``copies_word``) and resets the exit counter.
    Returns whether this program was the last."""
    old = tl.atomic_add(state_ptr + 4 + phase, 1, sem="acq_rel", scope="gpu")
    last = old == programs - 1
    if last:
        tl.store(state_ptr + 4 + phase, 0)
        tl.store(state_ptr + phase, expected + per_source)
        if copies_seen >= 0:
            tl.store(state_ptr + copies_word, copies_seen)
    return last


@triton.jit
def bump_kernel(counter_ptr):
    """Add one to a device counter (one thread), after a copy stream's chain of copies: the copy-done flag value
    that the next chain copies to peers."""
    tl.store(counter_ptr, tl.load(counter_ptr) + 1)


# --- notify ------------------------------------------------------------------------------------------

@triton.jit
def notify_kernel(counts_ptr, bases_ptr, counts_off, sig_off, state_ptr, layout_ptr, status_addr,
                  rank, R, num_worst, timeout_ns, RP: tl.constexpr):
    """layout_ptr (int32): [0, R) where this rank's tokens start on each destination,
    [R, 2R] where each source's tokens start here (prefix, last = total), [2R + 1] rows received."""
    status_ptr = status_addr.to(tl.pointer_type(tl.int32))
    if _failed_before(state_ptr):  # (the host reads the status word before it trusts the layout)
        return
    expected = tl.load(state_ptr + 0, volatile=True)
    d = tl.arange(0, RP)
    dmask = d < R
    mine = tl.load(counts_ptr + d, mask=dmask, other=0)
    for p in range(R):
        row = (tl.load(bases_ptr + p) + counts_off).to(tl.pointer_type(tl.int32)) + rank * R
        tl.store(row + d, mine, mask=dmask)
    _signal_all(bases_ptr, sig_off + 0 * 64, rank, R)
    own_counts = (tl.load(bases_ptr + rank) + counts_off).to(tl.pointer_type(tl.int32))
    own_sig = (tl.load(bases_ptr + rank) + sig_off + 0 * 64).to(tl.pointer_type(tl.int32))
    _wait_for_ranks(own_sig, 0, 1, R, rank, 0, expected + 1, timeout_ns, status_ptr, state_ptr + FAIL_WORD, 1)
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
    _finish(state_ptr, 0, expected, 1, 1, -1, 0)


# --- dispatch ----------------------------------------------------------------------------------------

@triton.jit
def _column(block, cols, d):
    """Column ``d`` of a ``[rows, RP]`` block (``cols`` = arange(RP)) as a ``[rows]`` block."""
    return tl.sum(tl.where(cols[None, :] == d, block, 0), axis=1)


@triton.jit
def _pick(values, cols, d):
    """Element ``d`` of a ``[RP]`` block."""
    return tl.sum(tl.where(cols == d, values, 0), axis=0)


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
            p_own = _column(pos, cols, rank).to(tl.int64)[:, None]
            p_peer = _column(pos, cols, 1 - rank).to(tl.int64)[:, None]
            own = tl.load(y_bf16.to(tl.pointer_type(tl.int32), bitcast=True) + (self_start + p_own) * (H // 2) + w,
                          mask=(p_own >= 0) & wmask, other=0)
            peer = tl.load(cx.to(tl.pointer_type(tl.int32), bitcast=True) + ((1 - rank) * slots + p_peer) * (H // 2) + w,
                           mask=(p_peer >= 0) & wmask, other=0, cache_modifier=".cg")
            tl.store(out_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + t64 * (H // 2) + w,
                     ptx.bf16x2_add_as_fp32(own, peer), mask=tmask[:, None] & wmask)
    else:
        acc = tl.zeros((TB, HB), dtype=tl.float32)
        for d in range(R):  # (not unrolled over RP with predicated loads: that is slower on Hopper)
            p = _column(pos, cols, d).to(tl.int64)[:, None]
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
        p = _column(pos, cols, d).to(tl.int64)[:, None]
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


@triton.jit
def _store_hole_rows(t, pos, v, w0, w1, w2, w3, row_bytes, copied, dest_start, dest_base, stage_base, off_x,
                     STAGE: tl.constexpr, RP: tl.constexpr, HALVES: tl.constexpr):
    """Store 16-byte vectors ``v`` (``[1, n]``, words ``w0..w3``) of the rows of tokens ``t`` that fill holes
    (`_store_hole_fillers`); HALVES: ``v`` are the word offsets of 8-byte halves (`chunk_halves`: ``w0, w1`` at
    ``v``, ``w2, w3`` at ``v + 16``)."""
    cols = tl.arange(0, RP)
    for d in tl.static_range(RP):
        p = _column(pos, cols, d)
        m = _pick(copied, cols, d)
        hole = ((p >= 0) & (p < m) & (t >= m))[:, None]
        row = _pick(dest_start, cols, d) + p.to(tl.int64)[:, None]
        if STAGE:
            base = stage_base
        else:
            base = _pick(dest_base, cols, d) + off_x
        dst = (base + row * row_bytes).to(tl.pointer_type(tl.int32))
        if HALVES:
            ptx.st_global_na_v2(dst + v, w0, w1, hole & (v < row_bytes // 4))
            ptx.st_global_na_v2(dst + v + 16, w2, w3, hole & (v + 16 < row_bytes // 4))
        else:
            ptx.st_global_na_v4(dst + 4 * v, w0, w1, w2, w3, hole & (v < row_bytes // 16))


@triton.jit
def _store_hole_fillers(fill_from, fill_to, x_ptr, pos_ptr, H, R, copied, dest_start, dest_base, stage_base, off_x,
                        pid, programs, STAGE: tl.constexpr, X_BYTES: tl.constexpr, QUANTIZE: tl.constexpr,
                        VEC: tl.constexpr, GROUPS: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr, TB: tl.constexpr,
                        QG: tl.constexpr, WIDE: tl.constexpr = False):
    """The rows of the tokens ``fill_from <= t < fill_to`` that fill holes of a copied prefix (`_prefix_plan`: token
    ``t >= copied[d]`` on a row ``p < copied[d]``), to the peer's receive rows or, with STAGE, to the same rows of this
    rank's staging area (``stage_base``), whose copies then carry them; QUANTIZE: in chunks of QG groups."""
    row_bytes = H * X_BYTES
    for t0 in range(fill_from + pid * TB, fill_to, programs * TB):
        t = t0 + tl.arange(0, TB)
        w0, w1, w2, w3, scale, topk, weights, pos = load_tokens(
            t, t < fill_to, x_ptr, x_ptr, x_ptr, x_ptr, pos_ptr, H, 1, R,
            X_BYTES, QUANTIZE, False, False, False, VEC, GROUPS, KP, RP, TB, not QUANTIZE)
        if QUANTIZE:
            t64 = t.to(tl.int64)[:, None]
            for g0 in range(0, H // 128, QG):
                a0, a1, a2, a3, b0, b1, b2, b3 = load_chunk(x_ptr, t64, t < fill_to, g0, H, QG, TB, WIDE)
                q0, q1, q2, q3, _ = quantize_chunk(x_ptr, t64, t < fill_to, g0, H, a0, a1, a2, a3, b0, b1, b2, b3,
                                                   QG, TB, WIDE)
                if WIDE:
                    _store_hole_rows(t, pos, chunk_vectors(g0, QG), q0, q1, q2, q3, row_bytes, copied, dest_start,
                                     dest_base, stage_base, off_x, STAGE, RP, False)
                else:
                    lo, _ = chunk_halves(g0, QG)
                    _store_hole_rows(t, pos, lo, q0, q1, q2, q3, row_bytes, copied, dest_start, dest_base, stage_base,
                                     off_x, STAGE, RP, True)
        else:
            _store_hole_rows(t, pos, tl.arange(0, VEC)[None, :], w0, w1, w2, w3, row_bytes, copied, dest_start,
                             dest_base, stage_base, off_x, STAGE, RP, False)


@triton.jit
def _x_row(d, p, t, row, base, copied, dest_base, cols, rank, off_x, off_stage, row_bytes, STAGE: tl.constexpr):
    """Where the x rows of tokens ``t`` go on destination d (``[TB, 1]`` int32 pointers: its receive rows, or with
    STAGE a peer's rows in this rank's staging area, same rows) and whether the kernel stores them (``[TB, 1]``):
    not those the copy engines move (positions below ``copied[d]``) but, with STAGE, all but the hole fillers'."""
    dst = (base + off_x + row * row_bytes).to(tl.pointer_type(tl.int32))
    if STAGE:
        staged = (_pick(dest_base, cols, rank) + off_stage + row * row_bytes).to(tl.pointer_type(tl.int32))
        dst = tl.where(d != rank, staged, dst)
    m = _pick(copied, cols, d)
    keep = p >= m
    if STAGE:
        keep = keep | (t < m)
    return dst, keep[:, None]


@triton.jit
def local_experts(topk, d, num_local_experts):
    """Top-k ids as rank ``d``'s local expert ids, -1 where the expert is elsewhere (or the choice dropped)."""
    local = topk - d * num_local_experts
    return tl.where((topk >= 0) & (local >= 0) & (local < num_local_experts), local, -1)


@triton.jit(do_not_specialize=["fill_from", "fill_to", "t_begin", "t_end", "trace_tag"])  # per-call values must not recompile
def dispatch_kernel(x_ptr, scales_ptr, topk_ptr, weights_ptr, pos_ptr, layout_ptr, bases_ptr, state_ptr,
                    status_addr, T, H, K, R, rank, num_local_experts, num_worst,
                    off_x, off_scales, off_topk, off_weights, off_src, sig_off, off_copied, copied_ptr, fill_from, fill_to,
                    timeout_ns, off_stage, t_begin, t_end, first,
                    X_BYTES: tl.constexpr, QUANTIZE: tl.constexpr, HAS_SCALES: tl.constexpr,
                    WAIT_COPIES: tl.constexpr, STAGE: tl.constexpr, SYNC: tl.constexpr, GATE: tl.constexpr,
                    HAS_TOPK: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                    VEC: tl.constexpr, GROUPS: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr,
                    TB: tl.constexpr, QG: tl.constexpr, WIDE_E4M3: tl.constexpr, TRACE: tl.constexpr, trace_ptr,
                    trace_tag):
    """Token t goes to receive row ``send_start[d] + pos[t, d]`` of every destination d with
    pos >= 0. Each program moves TB tokens per step. X_BYTES: bytes per element of the received
    x (2: bf16, 1: fp8). QUANTIZE: x is bf16, quantized here to e4m3 with a scale per 128, QG groups of 128 at a
    time (`quantize_chunk`); WIDE_E4M3: each thread quantizes 16 adjacent values and stores their e4m3 bytes as one
    16-byte vector (else two 8-byte halves 64 bytes apart).
    Copy engines may move rows ``0 .. copied[d]-1`` of x to rows ``0 .. copied[d]-1`` of this rank's rows on
    peer d (`_prefix_plan`): the kernel does not store rows at positions below ``copied[d]``, but those of tokens
    ``t >= copied[d]`` there (holes) once this rank's copy-done flag has reached d (tokens ``fill_from <= t <
    fill_to``). WAIT_COPIES: also wait until every peer's copy stream has raised its copy-done flag here
    (``copied`` flags) once more than seen so far.

    A launch moves tokens ``t_begin <= t < t_end``. STAGE: the rows of x bound for a peer go to the same row of
    this rank's staging area (``off_stage``) instead, for copy engines to move (their scales and metadata still go
    to the peer); the launch from token 0 first stages the rows that fill holes (``fill_from`` to ``fill_to``), which without
    STAGE the SYNC launch stores into the peers once this rank's copies have landed. SYNC: after its tokens the
    launch signals every destination, waits for every source (and, with WAIT_COPIES, the copy-done flags), writes
    the padding rows and ends the phase; a dispatch in several launches makes only its last one SYNC, and a launch
    before it may be followed by copies of the rows it staged.

    ``first``: the dispatch's first launch, whose program 0 tells every rank that this rank has started it
    (STARTED_SLOT; with WAIT_COPIES also X_FREE_SLOT, for their copy streams). GATE (a cached dispatch: no count
    exchange before it): wait, before storing into any peer, until every peer has started this dispatch."""
    status_ptr = status_addr.to(tl.pointer_type(tl.int32))
    fail_ptr = state_ptr + FAIL_WORD
    if TRACE:
        t_start = ptx.globaltimer()
    expected = tl.load(state_ptr + 1, volatile=True)
    finished = tl.load(state_ptr + FINISHED_WORD, volatile=True)  # dispatches before this one
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    own = tl.load(bases_ptr + rank)
    if _failed_before(state_ptr):
        if WAIT_COPIES:
            if pid == 0:
                _free_copy_stream(own + sig_off + X_FREE_SLOT * 64, R)
        return
    if (first != 0) & (pid == 0):  # after this rank's earlier work on the stream (reads of the last results)
        for d in range(R):
            sig = tl.load(bases_ptr + d) + sig_off
            ptx.atom_add_release_sys((sig + STARTED_SLOT * 64).to(tl.pointer_type(tl.int32)) + rank, 1)
            if WAIT_COPIES:
                if d != rank:
                    ptx.st_release_sys((sig + X_FREE_SLOT * 64).to(tl.pointer_type(tl.int32)) + rank, 1)
    if GATE:
        _wait_for_ranks((own + sig_off + STARTED_SLOT * 64).to(tl.pointer_type(tl.int32)), 0, 1, R, rank, 1,
                        finished + 1, timeout_ns, status_ptr, fail_ptr, 5)
    cols = tl.arange(0, RP)
    dest_start = tl.load(layout_ptr + cols, mask=cols < R, other=0).to(tl.int64)
    dest_base = tl.load(bases_ptr + cols, mask=cols < R, other=0)
    vec = tl.arange(0, VEC)[None, :]
    row_bytes = H * X_BYTES
    n_vec = row_bytes // 16
    vmask = vec < n_vec
    n_groups = H // 128
    grp = tl.arange(0, GROUPS)[None, :]
    gmask = grp < n_groups
    k = tl.arange(0, KP)[None, :]
    kmask = k < K
    copied = tl.load(copied_ptr + cols, mask=cols < R, other=0)
    if STAGE:
        if (t_begin == 0) & (fill_from < T):  # first, the hole fillers: the first copies carry their rows
            _store_hole_fillers(fill_from, fill_to, x_ptr, pos_ptr, H, R, copied, dest_start, dest_base,
                                _pick(dest_base, cols, rank) + off_stage, off_x, pid, programs, True, X_BYTES,
                                QUANTIZE, VEC, GROUPS, KP, RP, TB, QG, WIDE_E4M3)
    for t0 in range(t_begin + pid * TB, t_end, programs * TB):
        t = t0 + tl.arange(0, TB)
        w0, w1, w2, w3, scale, topk, weights, pos = load_tokens(
            t, t < t_end, x_ptr, scales_ptr, topk_ptr, weights_ptr, pos_ptr, H, K, R,
            X_BYTES, QUANTIZE, HAS_SCALES, HAS_TOPK, HAS_WEIGHTS, VEC, GROUPS, KP, RP, TB, not QUANTIZE)
        for d in tl.static_range(RP):  # unrolled: d is a constant, the picks are selects
            p = _column(pos, cols, d)
            ok = (p >= 0)[:, None]
            row = _pick(dest_start, cols, d) + p.to(tl.int64)[:, None]  # [TB, 1]
            base = _pick(dest_base, cols, d)
            if not QUANTIZE:
                dst, keep = _x_row(d, p, t, row, base, copied, dest_base, cols, rank, off_x, off_stage, row_bytes,
                                   STAGE)
                ptx.st_global_na_v4(dst + 4 * vec, w0, w1, w2, w3, ok & keep & vmask)
            if HAS_SCALES:
                dst_s = (base + off_scales + row * n_groups * 4).to(tl.pointer_type(tl.float32))
                tl.store(dst_s + grp, scale, mask=ok & gmask)
            if HAS_TOPK:
                dst_k = (base + off_topk + row * K * 8).to(tl.pointer_type(tl.int64))
                tl.store(dst_k + k, local_experts(topk, d, num_local_experts), mask=ok & kmask)
            if HAS_WEIGHTS:
                dst_w = (base + off_weights + row * K * 4).to(tl.pointer_type(tl.float32))
                tl.store(dst_w + k, weights, mask=ok & kmask)
            dst_i = (base + off_src + row * 4).to(tl.pointer_type(tl.int32))
            tl.store(dst_i, t[:, None], mask=ok)
        if QUANTIZE:  # the rows in chunks of QG groups: quantized, then stored with their scales
            t64 = t.to(tl.int64)[:, None]
            n0, n1, n2, n3, n4, n5, n6, n7 = load_chunk(x_ptr, t64, t < t_end, 0, H, QG, TB, WIDE_E4M3)
            for g0 in range(0, n_groups, QG):
                a0, a1, a2, a3, b0, b1, b2, b3 = n0, n1, n2, n3, n4, n5, n6, n7
                # the next chunk, in flight while this one is quantized
                n0, n1, n2, n3, n4, n5, n6, n7 = load_chunk(x_ptr, t64, t < t_end, g0 + QG, H, QG, TB, WIDE_E4M3)
                q0, q1, q2, q3, qscale = quantize_chunk(x_ptr, t64, t < t_end, g0, H, a0, a1, a2, a3, b0, b1, b2, b3,
                                                        QG, TB, WIDE_E4M3)
                lo, hi = chunk_halves(g0, QG)  # the word offsets of each thread's two 8-byte halves
                for d in tl.static_range(RP):
                    p = _column(pos, cols, d)
                    ok = (p >= 0)[:, None]
                    row = _pick(dest_start, cols, d) + p.to(tl.int64)[:, None]
                    base = _pick(dest_base, cols, d)
                    dst, keep = _x_row(d, p, t, row, base, copied, dest_base, cols, rank, off_x, off_stage,
                                       row_bytes, STAGE)
                    if WIDE_E4M3:
                        v16 = chunk_vectors(g0, QG)
                        ptx.st_global_na_v4(dst + 4 * v16, q0, q1, q2, q3, ok & keep & (v16 < row_bytes // 16))
                    else:
                        ptx.st_global_na_v2(dst + lo, q0, q1, ok & keep & (lo < row_bytes // 4))
                        ptx.st_global_na_v2(dst + hi, q2, q3, ok & keep & (hi < row_bytes // 4))
                    dst_s = (base + off_scales + row * n_groups * 4).to(tl.pointer_type(tl.float32))
                    store_chunk_scales(dst_s, g0, qscale, ok, n_groups, QG, TB)
    if SYNC and not STAGE:
        if fill_from < T:  # the holes in the copied rows, once the copies have landed
            copies_target = tl.load(state_ptr + COPIES_WORD, volatile=True) + 1
            for d in range(R):
                if _pick(copied, cols, d) > 0:
                    flag = (tl.load(bases_ptr + d) + off_copied).to(tl.pointer_type(tl.int32)) + rank
                    _wait_for_one(flag, copies_target, d, timeout_ns, status_ptr, state_ptr + FAIL_WORD, 6)
            tl.debug_barrier()
            _store_hole_fillers(fill_from, fill_to, x_ptr, pos_ptr, H, R, copied, dest_start, dest_base, 0, off_x, pid,
                                programs, False, X_BYTES, QUANTIZE, VEC, GROUPS, KP, RP, TB, QG, WIDE_E4M3)
    if SYNC:
        _signal_all(bases_ptr, sig_off + 1 * 64, rank, R)
        _wait_for_ranks((own + sig_off + 1 * 64).to(tl.pointer_type(tl.int32)), 0, 1, R, rank, 0, expected + programs,
                        timeout_ns, status_ptr, state_ptr + FAIL_WORD, 2)
        copies_seen = -1
        if WAIT_COPIES:
            copies_seen = tl.load(state_ptr + COPIES_WORD, volatile=True) + 1
            _wait_for_ranks((own + off_copied).to(tl.pointer_type(tl.int32)), 0, 1, R, rank, 1, copies_seen,
                            timeout_ns, status_ptr, state_ptr + FAIL_WORD, 7)
        if num_worst > 0:  # padding rows: zeros, top-k -1, source -1
            total = tl.load(layout_ptr + 2 * R)
            for r0 in range(total + pid * TB, num_worst, programs * TB):
                r = r0 + tl.arange(0, TB)
                ok = (r < num_worst)[:, None]
                row = r.to(tl.int64)[:, None]
                zero = tl.zeros((TB, VEC), dtype=tl.int32)
                dst = (own + off_x + row * row_bytes).to(tl.pointer_type(tl.int32))
                ptx.st_global_na_v4(dst + 4 * vec, zero, zero, zero, zero, ok & vmask)
                if QUANTIZE or HAS_SCALES:
                    dst_s = (own + off_scales + row * n_groups * 4).to(tl.pointer_type(tl.float32))
                    tl.store(dst_s + grp, tl.zeros((TB, GROUPS), dtype=tl.float32), mask=ok & gmask)
                if HAS_TOPK:
                    dst_k = (own + off_topk + row * K * 8).to(tl.pointer_type(tl.int64))
                    tl.store(dst_k + k, tl.full((TB, KP), -1, dtype=tl.int64), mask=ok & kmask)
                if HAS_WEIGHTS:
                    dst_w = (own + off_weights + row * K * 4).to(tl.pointer_type(tl.float32))
                    tl.store(dst_w + k, tl.zeros((TB, KP), dtype=tl.float32), mask=ok & kmask)
                dst_i = (own + off_src + row * 4).to(tl.pointer_type(tl.int32))
                tl.store(dst_i, tl.full((TB, 1), -1, dtype=tl.int32), mask=ok)
        if _finish(state_ptr, 1, expected, programs, programs, copies_seen, COPIES_WORD):
            tl.store(state_ptr + FINISHED_WORD, finished + 1)
    if WAIT_COPIES:
        if (pid == 0) & (tl.load(fail_ptr, volatile=True) != 0):  # a wait failed
            _free_copy_stream(own + sig_off + X_FREE_SLOT * 64, R)
    if TRACE:
        record_block(trace_ptr, trace_tag, t_start)


# --- combine -----------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["trace_tag", "y_rows"])  # a new tag id or receive size must not recompile
def combine_kernel(y_ptr, yw_ptr, layout_ptr, pos_ptr, bases_ptr, state_ptr, status_addr, own_buf,
                   chunk_ends_ptr, out_ptr, out_w_ptr, T, H, K, R, rank, max_tokens, y_rows,
                   off_cx, off_cw, off_chunk_ends, sig_off, off_copied, timeout_ns,
                   VEC: tl.constexpr, HB: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr,
                   TB: tl.constexpr, HAS_WEIGHTS: tl.constexpr, WAIT_COPIES: tl.constexpr,
                   CHUNKS: tl.constexpr, CP: tl.constexpr, TRACE: tl.constexpr, trace_ptr, trace_tag):
    """Push the i-th row received from each other rank back to slot [rank][i] of that source's combine area,
    then sum, for each of this rank's tokens, its rows from the ranks it went to (fp32; its own rank's row
    straight from y) into out (bf16).

    Copy engines may move the rows: ``chunk_ends`` (int32 ``[R, CHUNKS]``) ends each source's copied rows
    in CHUNKS chunks (positions among the rows received from it; the kernel pushes the rows past the last
    end, and all weights). WAIT_COPIES: program 0 tells each source its chunk ends, and the sum waits, per
    block of tokens, only for the chunks that hold the rows it adds (each chunk's copy-done flag), so it
    runs while the copy engines still move later chunks."""
    status_ptr = status_addr.to(tl.pointer_type(tl.int32))
    fail_ptr = state_ptr + FAIL_WORD
    if TRACE:
        t_start = ptx.globaltimer()
    expected = tl.load(state_ptr + 2, volatile=True)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    own = tl.load(bases_ptr + rank)
    if _failed_before(state_ptr):
        if WAIT_COPIES:
            if pid == 0:
                _free_copy_stream(own + sig_off + FREE_SLOT * 64, R)
        return
    # every peer has summed the previous combine (its programs' SUMMED_SLOT signals): its combine area
    # and chunk ends are free to overwrite (two combines in a row, no dispatch between)
    _wait_for_ranks((own + sig_off + SUMMED_SLOT * 64).to(tl.pointer_type(tl.int32)), 0, 1, R, rank, 1, expected,
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
    _wait_for_ranks((own + sig_off + 2 * 64).to(tl.pointer_type(tl.int32)), 0, 1, R, rank, 0, expected + programs,
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
                    c = _pick(need, cols, d)
                    if c > _pick(landed, cols, d):  # chunks land in order: chunk c's flag covers the earlier ones
                        _wait_for_one(flags + c * R + d, copies_seen, d, timeout_ns, status_ptr, fail_ptr, 9)
                tl.debug_barrier()
                landed = tl.maximum(landed, need)
        sum_returned_rows(t, t < T, pos_ptr, R, rank, self_start, y_bf16, yw_ptr, cx, cw, max_tokens, out_ptr, out_w_ptr,
                          H, K, HB, KP, RP, TB, False)
    if WAIT_COPIES:  # every source's chain has ended (its last flag, sent to every rank): see FREE_SLOT
        for d in range(R):
            if (d != rank) & (_pick(landed, cols, d) < CHUNKS - 1):
                _wait_for_one(flags + (CHUNKS - 1) * R + d, copies_seen, d, timeout_ns, status_ptr, fail_ptr, 9)
        tl.debug_barrier()
    _signal_all(bases_ptr, sig_off + SUMMED_SLOT * 64, rank, R)  # this program's reads of the combine area are done
    last = _finish(state_ptr, 2, expected, programs, programs, copies_seen, COPIES_WORD + 1)
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
    if TRACE:
        record_block(trace_ptr, trace_tag, t_start)


# --- host side ---------------------------------------------------------------------------------------

launch_bump, launch_notify = FastLaunch(bump_kernel), FastLaunch(notify_kernel)
launch_dispatch, launch_combine = FastLaunch(dispatch_kernel), FastLaunch(combine_kernel)


def _prefix_plan(to_peer: np.ndarray, share: float) -> tuple[int, np.ndarray]:
    """Where a dispatch with ``bulk="copy_engine"`` puts the rows it sends one peer (``to_peer``: bool ``[T]``, the
    tokens sent there): ``(m, pos)``, ``pos[t]`` the row of token t among this rank's rows there (-1: not sent).

    One copy moves rows ``0 .. m-1`` of x into rows ``0 .. m-1`` there, ``m = ceil(share * sent)``, so token
    ``t < m`` sent there lands on row t. The tokens before m that are not sent there (holes) are overwritten,
    once that copy has landed, by the first tokens after m that are sent there; the rest follow in token order
    from row m. A prefix with more than ``MAX_HOLE_SHARE`` holes is not worth copying: then ``m = 0`` and the
    rows are in token order."""
    sent = np.flatnonzero(to_peer)
    m = _share_of(share, len(sent))
    holes = np.flatnonzero(~to_peer[:m])
    if len(holes) > MAX_HOLE_SHARE * m:
        m, holes = 0, holes[:0]
    pos = np.full(len(to_peer), -1, np.int32)
    head, tail = sent[sent < m], sent[sent >= m]
    pos[head] = head
    pos[tail[: len(holes)]] = holes  # (there are at least as many: m <= sent)
    pos[tail[len(holes):]] = m + np.arange(len(tail) - len(holes))
    return m, pos


@dataclass
class DispatchSplit:
    """What a dispatch with ``bulk="copy_engine"`` gives the copy engines (`_prefix_plan`, per layout and share).

    Attributes:
        copies: ``[(peer, rows m, first row there)]``, rows ``0 .. m-1`` of x to that peer.
        copied: int32 device ``[R]``, m per rank (0 for this rank and peers the SMs serve).
        fill_from, fill_to: the tokens that fill holes lie in ``fill_from <= t < fill_to`` (both ``num_tokens``:
            no holes).
        pos: int32 device ``[num_tokens, R]``, the rows (this rank's own column: token order).
        host_copied, host_pos, host_send_start: ``copied`` and ``pos`` as the host computed them (numpy) and where
            this rank's rows start on each rank (the layout's first ``R`` entries), for the FP8 staging plan
            (`NvlinkTransport._stage_split`) without another read from the device.
    """

    copies: list
    copied: torch.Tensor
    fill_from: int
    fill_to: int
    pos: torch.Tensor
    host_copied: np.ndarray
    host_pos: np.ndarray
    host_send_start: list


def _stage_bounds(num_tokens: int, chunks: int, round_tokens: int) -> list[int]:
    """Token bounds of the FP8 staging launches: ``chunks`` ranges near equal, each but the last a whole number of
    rounds (``round_tokens``: tokens per step times programs), so that only the last launch ends on a partly idle
    round (4 equal ranges of 4096 tokens at 16 x 20 took 16 rounds where 13 do); fewer ranges if there are fewer
    rounds."""
    rounds = num_tokens / round_tokens
    cuts = {min(num_tokens, round(c * rounds / chunks) * round_tokens) for c in range(1, chunks)}
    return [0] + sorted(cuts - {0, num_tokens}) + [num_tokens]


def default_combine_chunks(num_sms: int) -> tuple[float, ...]:
    """The chunks (increasing fractions of the copied rows) a combine's copies are cut into, by comm SMs: from 20
    SMs on four, below three. More chunks let the sum start sooner but each costs a flag and a wait: with the
    DeepSeek-V3 shape on two GPUs, four were faster from 20 SMs on and slower at 16."""
    return (0.4, 0.7, 0.9, 1.0) if num_sms >= 20 else (0.5, 0.8, 1.0)


def _share_of(share: float, n: int) -> int:
    """``ceil(share * n)``, not tripped up by binary fractions (0.7 * 300 is 210.00000000000003)."""
    return min(n, math.ceil(round(share * n, 6)))


def _region_bytes(R: int, M: int, H: int, K: int) -> dict:
    """Bytes of each region of the symmetric buffer: flags, the count matrix, the copy-engine flags (per source:
    the dispatch's, then each combine chunk's) and where each source's combine chunks end, the receive area (one
    row for every token of every source, bf16-sized) with scales, top-k, weights and source index, and the
    combine area (one slot per source rank and position of a token among those sent there)."""
    rows = R * M
    return {"signals": (SHORT_SLOT.value + 1) * 64, "counts": R * R * 4, "copied": (1 + MAX_CHUNKS) * R * 4, "chunk_ends": R * MAX_CHUNKS * 4,
            "x": rows * H * 2, "scales": rows * (H // SCALE_BLOCK) * 4, "topk": rows * K * 8,
            "weights": rows * K * 4, "src": rows * 4,
            "cx": R * M * H * 2, "cw": R * M * K * 4}


@dataclass
class NvlinkLayout:
    """Device-side layout of one dispatch, kept for its combine.

    Attributes:
        pos: ``[num_tokens, num_ranks]`` int32, the token's index among this rank's tokens sent to
            each rank, -1 where it is not sent there.
        layout: int32 ``[2 * num_ranks + 2]`` written by the notify kernel: where this rank's tokens
            start on each destination, where each source's tokens start here, rows received.
        num_tokens: tokens on this rank.
        num_recv_rows: rows of the received tensors (``num_worst_tokens``, or the exact count).
        splits: per (``"dispatch"``, ``copy_share``), (``"stage"``, ``stage_chunks``, ``copy_share``, tokens per
            round) and (``"combine"``, ``combine_copy_share``, ``combine_chunks``), with ``bulk="copy_engine"``:
            the copies the copy engines make and where the SMs take over (see `NvlinkTransport`), made on first use
            from a host read.
        rank_prefix_matrix: DeepEP's ``rank_prefix_matrix`` of the dispatch that made this layout (``[R, R]`` int32,
            entry ``[i, j]`` the tokens ranks ``0..i`` send to rank ``j``), summed from the count matrix between the
            notify kernel and the dispatch kernel (after it, a peer's next notify may overwrite its row).
        sent_pos: the rows the dispatch that returned this layout put the tokens in on each rank, which its combine
            reads back: ``pos``, or a `DispatchSplit`'s ``pos`` when copy engines moved rows ``0 .. m-1`` of x (a
            dispatch with ``cached`` returns a copy of it that shares ``splits``).
    """

    pos: torch.Tensor
    layout: torch.Tensor
    num_tokens: int
    num_recv_rows: int
    splits: dict = field(default_factory=dict)
    sent_pos: torch.Tensor | None = None
    rank_prefix_matrix: torch.Tensor | None = None

    @property
    def num_recv_tokens(self) -> torch.Tensor:
        """Rows actually received, as a 1-element device tensor (no host synchronization)."""
        return self.layout[-2:-1]


class NvlinkTransport:
    """SM-push dispatch/combine between the GPUs of one node (see the module docstring).

    Args:
        group: NCCL process group, one rank per GPU, all GPUs NVLink peers.
        device: this rank's GPU.
        num_sms: persistent programs per kernel (all ranks must use the same count); at most the
            SMs the comm stream can reach.
        max_tokens: the most tokens any rank dispatches in one call.
        hidden: hidden size (a multiple of 128).
        max_topk: the largest top-k (up to 16).
        timeout_s: the longest a kernel waits for a peer before recording a timeout.
        bulk: who moves the token rows, those of a dispatch that does not quantize and those a combine
            sends back: ``"sm"`` (the kernels store them into peers' buffers) or ``"copy_engine"`` (copy
            engines copy the first rows of ``x`` into a peer's receive area in one copy per peer, and the rows
            received from each source back into its combine area; the kernels
            move this rank's own rows, top-k, weights and source indices, sum, and wait, bounded, for the
            peers' copy-done flags). An FP8 dispatch that quantizes here (``quantize``) has its rows moved as the
            attribute ``quantized_rows_by`` (the same on every rank, as every attribute here) says: ``"sm"``
            (the default: the kernel pushes every row as it quantizes it, on the rows the copy-engine dispatches
            of the layout use; faster than staging: a row leaves as soon as it is quantized, with no staging
            launch and copy to wait for) or ``"copy_engine"`` (staged in this rank's combine area over
            ``stage_chunks`` launches, each followed by copy-engine copies of what it staged).
            With ``"copy_engine"`` the first dispatch and the first combine of a
            layout read it on the host (a synchronization; later calls with that layout, ``cached``, can
            be captured in a CUDA graph; `plan` makes every plan at once). The copied rows of x include tokens
            not sent to that peer (holes): the kernel overwrites them with later tokens sent there once the copy
            has landed, so a source's rows are not all in token order (``recv_src_idx`` names each;
            `_prefix_plan`); a peer whose copy would hold more than ``MAX_HOLE_SHARE`` holes gets its rows from
            the SMs, in token order. A combine's rows go back to each source as one block, copied in the chunks
            ``combine_chunks`` (an attribute: increasing fractions of the copied rows, the last 1.0, at most
            ``MAX_CHUNKS``; by default `default_combine_chunks` of ``num_sms``), each with its own flag, and the
            sum starts on a chunk as soon as it has landed.
        copy_share: with ``bulk="copy_engine"``, the share of a dispatch's rows that the copy engines move:
            for a peer that gets ``n`` rows, rows ``0 .. ceil(copy_share * n)-1`` of x; the SMs push the rest at
            the same time (both paths then share NVLink; 1.0: copy engines only, but the holes). An FP8 dispatch
            that quantizes here with ``quantized_rows_by="copy_engine"`` stages the prefix's rows (its tokens
            rounded up to whole rounds of the programs) and its last launch pushes the later tokens' rows.
        combine_copy_share: the same for a combine: the copy engines move the first ``ceil(combine_copy_share
            * n)`` of the ``n`` rows received from each source, the SMs push the rest before the sum starts
            (1.0 is fastest: the SMs are better used summing the chunks as they land).
    """

    returns_views = True  # received tensors live in the symmetric buffer: Buffer copies them out

    def __init__(self, group, device: torch.device, num_sms: int, max_tokens: int, hidden: int,
                 max_topk: int = 16, timeout_s: float = 60.0, bulk: str = "sm", copy_share: float = 1.0,
                 combine_copy_share: float = 1.0):
        if bulk not in BULK_MOVERS:
            raise ValueError(f"bulk must be one of {BULK_MOVERS}, got {bulk!r}")
        for name, share in (("copy_share", copy_share), ("combine_copy_share", combine_copy_share)):
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {share}")

        if hidden % SCALE_BLOCK:
            raise ValueError(f"hidden must be a multiple of {SCALE_BLOCK}, got {hidden}")
        if not 1 <= max_topk <= 16:
            raise ValueError(f"max_topk must be in 1..16, got {max_topk}")
        self.group = group
        self.rank, self.num_ranks = group.rank(), group.size()
        if self.num_ranks > 16:
            raise ValueError(f"the NVLink transport handles up to 16 ranks, the group has {self.num_ranks}")
        self.device = torch.device(device)
        if num_sms < 1:
            raise ValueError(f"num_sms must be >= 1, got {num_sms}")
        self.num_sms = num_sms
        self.tokens_per_step = 4
        # 8 tokens per combine step with 2 ranks (the packed two-row sum: 128 registers, no spills); 4 with more
        # (8 spills there)
        self.combine_tokens_per_step = 8 if self.num_ranks == 2 else 4
        self.num_warps = 16  # per program of the dispatch and combine kernels
        self.combine_chunks = None  # by num_sms: default_combine_chunks
        self.stage_chunks = 4
        self.quantized_rows_by = "sm"
        self.quantize_tokens_per_step = 16  # a dispatch that quantizes: tokens per step, and groups of 128 values
        self.quantize_groups_per_step = 8  # quantized at a time
        self.e4m3_store_bytes = 16  # a dispatch that quantizes stores each thread's e4m3 bytes as one 16-byte vector
        # (8: two 8-byte halves)
        self.max_tokens, self.hidden, self.max_topk = max_tokens, hidden, max_topk
        self.timeout_ns = int(timeout_s * 1e9)
        self.timeout_s = timeout_s
        self.offsets, total = region_offsets(_region_bytes(self.num_ranks, max_tokens, hidden, max_topk), ALIGN)
        self.nbytes = total
        self.buffer, self.handle = symmetric_buffer(total, torch.uint8, group, self.device)
        self.buffer[: self.offsets["x"]].zero_()
        self.bases = torch.tensor(list(self.handle.buffer_ptrs), dtype=torch.int64, device=self.device)
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int32, device=self.device)
        self.status = torch.zeros(4, dtype=torch.int32, pin_memory=True)
        self._status_words = self.status.numpy()  # (the same memory: a read without torch's per-call work)
        self._status_ptr = self.status.data_ptr()
        self._views = {}  # `_view`'s views of self.buffer
        self.bulk, self.copy_share, self.combine_copy_share = bulk, copy_share, combine_copy_share
        self._all_by_sms = torch.zeros(self.num_ranks, 1, dtype=torch.int32, device=self.device)  # chunk ends: none
        self._none_copied = torch.zeros(self.num_ranks, dtype=torch.int32, device=self.device)  # dispatch rows: none
        if bulk == "copy_engine":
            self.ops = StreamOps(self.device)
            self.copy_stream = self.ops.new_stream()  # not a pooled stream: a caller's stream must never be it
            # the copy stream's waits for the peers' words run here, and the words' resets beside the copies
            self.reset_stream = self.ops.new_stream()
            self._words_seen, self._words_reset = torch.cuda.Event(), torch.cuda.Event()
            self._reset_pending = False
            # copy-done counters (dispatch, combine): the value the next chain copies into peers' flags (chains
            # count from 1), bumped on the copy stream after each chain
            self.copies_done = torch.ones(2, dtype=torch.int32, device=self.device)
            self.base_addrs = list(self.handle.buffer_ptrs)
            free = self.offsets["signals"] + FREE_SLOT.value * 64
            self.buffer[free: free + 4 * self.num_ranks].view(torch.int32).fill_(1)  # no combine yet to wait for
            self._free_addr = self.base_addrs[self.rank] + free  # this rank's FREE_SLOT words, per peer
            self._x_free_addr = self.base_addrs[self.rank] + self.offsets["signals"] + X_FREE_SLOT.value * 64
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group, device_ids=[self.device.index])

    @staticmethod
    @functools.lru_cache(maxsize=256)  # (every eager Buffer call checks its arguments against it)
    def buffer_bytes(num_ranks: int, max_tokens: int, hidden: int, max_topk: int = 16) -> int:
        """Bytes of the symmetric buffer each rank allocates."""
        return region_offsets(_region_bytes(num_ranks, max_tokens, hidden, max_topk), ALIGN)[1]

    # -- status ---------------------------------------------------------------------------------------

    def raise_if_failed(self) -> None:
        """Raise EPTimeoutError if a kernel recorded a timeout (reads pinned host memory; no sync)."""
        if self._status_words[0] == 0:
            return
        phase, peer, seen, expected = self.status.tolist()
        if phase == 4:  # (a replayed graph's; an eager call's host checks the counts first: check_num_worst_tokens)
            raise worst_tokens_error(self.rank, peer, seen, "; the rows past it are not in the returned tensors")
        if phase == 10:
            raise EPArgumentError("num_worst_tokens", f"num_worst_tokens: rank {peer} received more tokens than its "
                                                      f"num_worst_tokens, so rank {self.rank}'s combine misses the rows "
                                                      f"past it (rank {peer} raises the count)")
        what = WAITS.get(phase, "wait {phase}").format(peer=peer, phase=phase) + f" (saw {seen}, expected {expected})"
        raise EPTimeoutError.on_device(self.rank, peer, what, self.timeout_s)

    @property
    def _peers(self) -> list:
        """The other ranks, in order."""
        return [peer for peer in range(self.num_ranks) if peer != self.rank]

    def _status_addr(self) -> int:
        return self._status_ptr

    # -- views into this rank's buffer ------------------------------------------------------------------

    def _view(self, name: str, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """Region ``name`` of this rank's buffer as a ``dtype`` tensor of ``shape`` (the same tensor for the same
        arguments: views are made once)."""
        key = (name, dtype, shape, torch.is_inference_mode_enabled())  # (a view made there is an inference tensor)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 64:  # (receive sizes of uncached dispatches vary: keep the newest only)
                self._views.clear()
            numel = math.prod(shape)
            start = self.offsets[name]
            view = self._views[key] = self.buffer[start: start + numel * dtype.itemsize].view(dtype).view(shape)
        return view

    def rank_prefix_matrix(self) -> torch.Tensor:
        """DeepEP's ``rank_prefix_matrix`` of the last count exchange, in stream order right after its notify kernel
        (a later dispatch kernel lets the peers on to their next notify, which overwrites the counts): ``[R, R]``
        int32, entry ``[i, j]`` the tokens ranks ``0..i`` send to rank ``j``; a new tensor."""
        return self._view("counts", torch.int32, (self.num_ranks, self.num_ranks)).cumsum(0, dtype=torch.int32)

    def _dispatch_split(self, layout: NvlinkLayout, is_token_in_rank: torch.Tensor) -> DispatchSplit:
        """The copy-engine prefixes of a dispatch for ``copy_share`` (`_prefix_plan` per peer), made once per layout
        and share from a host read of the layout and of ``is_token_in_rank``."""
        key = ("dispatch", self.copy_share)
        if key not in layout.splits:
            R, T = self.num_ranks, layout.num_tokens
            send_start = layout.layout[:R].tolist()  # where this rank's rows start on each peer
            self.raise_if_failed()  # (after that synchronization) a failed count exchange leaves no layout
            in_rank = is_token_in_rank.cpu().numpy().astype(bool)
            pos = np.full((T, R), -1, np.int32)
            copied = np.zeros(R, np.int32)
            copies, fill_from, fill_to = [], T, 0
            for d in range(R):
                sent = int(in_rank[:, d].sum())
                if d == self.rank:
                    pos[:, d] = np.where(in_rank[:, d], np.cumsum(in_rank[:, d]) - 1, -1)
                    continue
                if sent and not 0 <= send_start[d] + sent <= R * self.max_tokens:
                    raise EPError(f"rank {self.rank}: the layout puts rows past the end of rank {d}'s receive area")
                copied[d], pos[:, d] = _prefix_plan(in_rank[:, d], self.copy_share)
                if copied[d]:
                    copies.append((d, int(copied[d]), int(send_start[d])))
                    if in_rank[: copied[d], d].sum() < copied[d]:  # holes: filled from token copied[d] on
                        fill_from = min(fill_from, int(copied[d]))
                        fillers = np.nonzero((pos[copied[d]:, d] >= 0) & (pos[copied[d]:, d] < copied[d]))[0]
                        if len(fillers):
                            fill_to = max(fill_to, int(copied[d]) + int(fillers[-1]) + 1)
            fill_to = fill_to if fill_from < T else T
            layout.splits[key] = DispatchSplit(copies, torch.from_numpy(copied).to(self.device), fill_from, fill_to,
                                               torch.from_numpy(pos).to(self.device), copied, pos, send_start)
        return layout.splits[key]

    def plan(self, layout: NvlinkLayout, is_token_in_rank: torch.Tensor) -> None:
        """With ``bulk="copy_engine"``: make every host plan of ``layout`` for the current shares and chunkings
        (dispatch, FP8 staging when ``quantized_rows_by`` is "copy_engine", combine; host reads, a
        synchronization), so that dispatches with ``cached=layout`` and combines of its rows can then be captured in
        a CUDA graph."""
        if self.bulk == "copy_engine":
            self._dispatch_split(layout, is_token_in_rank)
            if self.quantized_rows_by == "copy_engine":
                self._stage_split(layout, is_token_in_rank)
            self._combine_split(layout)

    @property
    def combine_chunks(self) -> tuple[float, ...]:
        """The chunks a combine's copies are cut into (see the class docstring); set a tuple of fractions to force
        them, None for `default_combine_chunks` of ``num_sms``."""
        return default_combine_chunks(self.num_sms) if self._combine_chunks is None else self._combine_chunks

    @combine_chunks.setter
    def combine_chunks(self, fractions) -> None:
        self._combine_chunks = None if fractions is None else tuple(fractions)

    def _combine_split(self, layout: NvlinkLayout):
        """``(chunks, chunk_ends)`` for ``combine_copy_share`` and ``combine_chunks`` (made once per layout, after a host
        read of where each source's rows start): ``chunks[c]`` lists the copies ``(source, first row, rows,
        first slot)`` of chunk c, ``chunk_ends`` (int32 device ``[R, len(combine_chunks)]``) where each source's
        chunks end, counted in rows received from it; the SMs push the rows past the last end."""
        fractions = tuple(self.combine_chunks)
        if not (0 < len(fractions) <= MAX_CHUNKS and fractions[-1] == 1.0
                and all(a < b for a, b in zip((0.0,) + fractions, fractions))):
            raise ValueError(f"combine_chunks must be 1 to {MAX_CHUNKS} increasing fractions in (0, 1] ending "
                             f"with 1.0, got {fractions}")
        key = ("combine", self.combine_copy_share, fractions)
        if key not in layout.splits:
            R = self.num_ranks
            starts = layout.layout[R: 2 * R + 1].tolist()  # where each source's rows start here, then the total
            self.raise_if_failed()
            ends = np.zeros((R, len(fractions)), np.int32)
            chunks = [[] for _ in fractions]
            for source in range(R):
                if source == self.rank:
                    continue
                copied = _share_of(self.combine_copy_share, starts[source + 1] - starts[source])
                begin = 0
                for c, fraction in enumerate(fractions):
                    ends[source, c] = end = _share_of(fraction, copied)
                    if end > begin:
                        chunks[c].append((source, starts[source] + begin, end - begin, begin))
                    begin = end
            layout.splits[key] = (chunks, torch.tensor(ends, device=self.device))
        return layout.splits[key]

    def _copy(self, steps: list, counter: int, after: torch.cuda.Event) -> torch.cuda.Event:
        """Queue, on the copy stream after ``after`` (an event of the current stream, recorded once the copies'
        inputs are queued), the ``steps`` in order:
        each ``(copies [(dst, src, nbytes)], flag, peers)`` copies, then this rank's copy-done counter ``counter``
        (0: dispatch, 1: combine) into word ``flag * R + rank`` of the copy flags of each of ``peers`` (a copy on
        the same stream starts when the data is in). Returns the event the current stream must wait for (after its
        kernel), so that the sources stay unchanged until read. Capturable in a CUDA graph (plain copies and stream
        memory operations then). A kernel that runs beside the copies is queued before them, after ``after``: in a
        CUDA graph it then starts sooner than when queued after them."""
        self._copy_start(counter, after)
        for copies, flag, peers in steps:
            self._copy_step(copies, flag, peers)
        return self._copy_done()

    def _copy_start(self, counter: int, after: torch.cuda.Event) -> None:
        """Start a `_copy`: the copy stream waits for ``after`` (an event of the current stream) and, before a dispatch's
        copies (counter 0), until every peer has started this dispatch (its X_FREE_SLOT word, set by its first
        launch), before a combine's (counter 1), until every peer has summed this rank's previous combine (its
        FREE_SLOT word, which it sets once it has this combine's last flag); stream memory operations, so that no
        kernel precedes the first copy (a kernel there delays it by a launch). Such waits cost a dispatch time even
        when the words are already set, so the waits and the words'
        resets run on ``reset_stream``: the copy stream waits for the waits only, and for the resets before its first
        flag (`_wait_for_reset`). Its flags copy counter ``counter``."""
        cs, rs = self.copy_stream, self.reset_stream
        cs.wait_event(after)
        rs.wait_event(after)
        words = self._x_free_addr if counter == 0 else self._free_addr
        for peer in self._peers:
            self.ops.wait_geq(rs, words + 4 * peer, 1)
        self._words_seen.record(rs)
        for peer in self._peers:  # (fenced: on the copy stream this would hold back the first copy)
            self.ops.write(rs, words + 4 * peer, 0)
        self._words_reset.record(rs)
        cs.wait_event(self._words_seen)
        self._reset_pending = True
        self._counter = self.copies_done[counter:counter + 1]

    def _copy_step(self, copies: list, flag: int, peers, after: torch.cuda.Event | None = None) -> None:
        """One step of a `_copy` (after ``after``, an event of the current stream, when given)."""
        cs = self.copy_stream
        if after is not None:
            cs.wait_event(after)
        if torch.cuda.is_current_stream_capturing():
            for dst, src, nbytes in copies:
                self.ops.memcpy(cs, dst, src, nbytes)
        else:
            self.ops.memcpy_batch(cs, copies)
        if peers:
            self._wait_for_reset()
        for peer in peers:
            self.ops.memcpy(cs, self.base_addrs[peer] + self.offsets["copied"] + 4 * (flag * self.num_ranks + self.rank),
                            self._counter.data_ptr(), 4)

    def _wait_for_reset(self) -> None:
        """The copy stream waits for the reset of the peers' words (`_copy_start`) before this chain's first flag: a
        peer sets its word again only after it has seen this chain's flags, so the reset never erases that."""
        if self._reset_pending:
            self.copy_stream.wait_event(self._words_reset)
            self._reset_pending = False

    def _copy_done(self) -> torch.cuda.Event:
        """End a `_copy`: bump the counter for the next chain; returns the event of the copy stream so far."""
        cs = self.copy_stream
        self._wait_for_reset()
        launch_bump(1, self._counter, num_warps=1, stream=cs)
        done = torch.cuda.Event()
        done.record(cs)
        return done

    def _stage_round(self) -> int:
        """Tokens an FP8 dispatch launch quantizes per round of its programs."""
        return self.quantize_tokens_per_step * self.num_sms

    def _stage_split(self, layout: NvlinkLayout, is_token_in_rank: torch.Tensor) -> list:
        """For an FP8 dispatch that stages the peers' rows (``bulk="copy_engine"``, quantized in the kernel):
        ``[(first token, end token, [(peer, first row, rows), ...]), ...]``, up to ``stage_chunks`` ranges of this
        rank's tokens (`_stage_bounds`) and, per peer, the runs of rows on that peer that the launch over them
        stages (a staged row keeps its row number). The rows are those of the BF16 dispatch (`_dispatch_split`), so that a layout puts a
        token on the same row whatever the dispatch moves: rows below the copied prefix's end m go in runs
        ``[a, min(b, m))`` per chunk of tokens ``[a, b)``, holes included (the first launch stages the tokens that
        fill them), the chunk's later tokens after them. Made once per layout."""
        if self.stage_chunks < 1:
            raise ValueError(f"stage_chunks must be >= 1, got {self.stage_chunks}")
        round_tokens = self._stage_round()
        key = ("stage", self.stage_chunks, self.copy_share, round_tokens)
        if key not in layout.splits:
            split = self._dispatch_split(layout, is_token_in_rank)
            R, T, C = self.num_ranks, layout.num_tokens, self.stage_chunks
            send_start, pos, copied = split.host_send_start, split.host_pos, split.host_copied.tolist()
            # the launches stage the tokens up to the longest copied prefix, rounded up to whole rounds (tokens
            # there past a shorter prefix go as tail runs); the dispatch's last launch pushes the rest itself
            prefix = max((copied[peer] for peer in self._peers), default=0)
            staged_end = min(T, -(-prefix // round_tokens) * round_tokens)
            bounds = _stage_bounds(staged_end, C, round_tokens) if staged_end > 0 else [0]
            chunks = []
            for a, b in zip(bounds, bounds[1:]):
                runs = []
                for peer in range(R):
                    if peer == self.rank:
                        continue
                    m = copied[peer]
                    p = pos[a:b, peer]
                    if a < m:  # rows a .. min(b, m)-1: its tokens' (row = token) and holes (fillers staged first)
                        runs.append((peer, send_start[peer] + a, min(b, m) - a))
                    tail = np.sort(p[p >= m])  # its tokens after the prefix that fill no hole: consecutive rows
                    if len(tail):
                        runs.append((peer, send_start[peer] + int(tail[0]), int(tail[-1] - tail[0] + 1)))
                chunks.append((a, b, runs))
            layout.splits[key] = chunks
        return layout.splits[key]

    # -- dispatch / combine ---------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
                 topk_weights: torch.Tensor | None, is_token_in_rank: torch.Tensor, num_local_experts: int,
                 quantize: bool = False, num_worst_tokens: int = 0, cached: "NvlinkLayout | None" = None,
                 trace=None, num_recv_tokens: int | None = None):
        """Send each token to the ranks in ``is_token_in_rank`` (see module docstring).

        Returns ``(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx, layout)``;
        recv_x is bf16 unless ``x`` is FP8 or ``quantize`` (then e4m3 with fp32 scales).
        Tensors not asked for are None. All received tensors are views into the buffer.
        ``cached``: the layout of an earlier dispatch with the same ``is_token_in_rank`` on every
        rank; skips the count exchange. ``num_recv_tokens``: the tokens this rank receives, when the caller knows
        them (`Buffer` does, from its header exchange): the call then does not wait for the count exchange's
        result (a read of it on the host), and a timeout there is raised by the next call.
        """
        self.raise_if_failed()
        R, T = self.num_ranks, x.size(0)
        H = x.size(1)
        K = topk_idx.size(1) if topk_idx is not None else (topk_weights.size(1) if topk_weights is not None else 0)
        if T > self.max_tokens or H != self.hidden or K > self.max_topk:
            raise ValueError(f"x: {T} tokens x {H} hidden, top-k {K} exceed the transport's "
                             f"max_tokens={self.max_tokens}, hidden={self.hidden}, max_topk={self.max_topk}")
        for name, t in (("x", x), ("scales", scales), ("topk_idx", topk_idx), ("topk_weights", topk_weights),
                        ("is_token_in_rank", is_token_in_rank)):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{name}: the kernels index rows densely; pass a contiguous tensor")
        fp8_in = x.dtype == torch.float8_e4m3fn
        x_bytes = 1 if (fp8_in or quantize) else 2
        planned = self.bulk == "copy_engine"  # the layout's rows are planned on the host
        if self.e4m3_store_bytes not in (8, 16):
            raise ValueError(f"e4m3_store_bytes must be 8 or 16, got {self.e4m3_store_bytes!r}")
        if self.quantized_rows_by not in BULK_MOVERS:
            raise ValueError(f"quantized_rows_by must be one of {BULK_MOVERS}, got {self.quantized_rows_by!r}")
        pushed = planned and quantize and self.quantized_rows_by == "sm"  # FP8 made here, pushed by the kernel
        copies = planned and not pushed  # copy engines move rows; the kernels wait for their flags
        staged = copies and quantize  # FP8 made here: the peers' rows are staged, then copied
        if staged and R > 2:
            raise ValueError("quantized_rows_by='copy_engine' stages each peer's rows at their row numbers there, "
                             f"which overlap in the staging area with more than 2 ranks (here {R}); use 'sm'")
        key = (("stage", self.stage_chunks, self.copy_share, self._stage_round()) if staged
               else ("dispatch", self.copy_share))
        if planned and torch.cuda.is_current_stream_capturing() and (cached is None or key not in cached.splits):
            raise ValueError("bulk='copy_engine': a dispatch captured in a CUDA graph needs a cached layout that an "
                             "earlier dispatch has used (its copies are planned on the host)")
        torch.autograd.graph.increment_version(self.buffer)
        if cached is not None:
            if cached.num_tokens != T:
                raise ValueError(f"cached: the cached layout is for {cached.num_tokens} tokens, x has {T}")
            pos, layout = cached.pos, cached.layout
            num_worst_tokens = cached.num_recv_rows if num_worst_tokens else 0
        else:
            pos, counts = token_positions(is_token_in_rank, with_counts=True)
            layout = torch.empty(2 * R + 2, dtype=torch.int32, device=self.device)
            launch_notify(1, counts, self.bases, self.offsets["counts"], self.offsets["signals"], self.state,
                          layout, self._status_addr(), self.rank, R, num_worst_tokens, self.timeout_ns,
                          RP=_pow2(R), num_warps=1)
        if cached is not None and not num_worst_tokens:
            rows = cached.num_recv_rows
        elif num_worst_tokens > 0:
            rows = num_worst_tokens
        elif num_recv_tokens is not None:
            rows = num_recv_tokens
        else:
            rows = int(layout[2 * R].item())
            self.raise_if_failed()
        plans = cached if cached is not None else NvlinkLayout(pos, layout, T, rows,
                                                               rank_prefix_matrix=self.rank_prefix_matrix())
        x_words = x.view(torch.uint8).view(torch.int32) if not quantize else x
        dummy = layout

        def launch(t_begin, t_end, sync, copied=None, fill_from=T, fill_to=T, stage=False, first=True):
            if trace is not None:
                trace_view, tag = trace.slots(self.num_sms, "dispatch", "comm")
            else:
                trace_view, tag = layout, 0
            launch_dispatch(
                self.num_sms,
                x_words, scales if scales is not None else dummy, topk_idx if topk_idx is not None else dummy,
                topk_weights if topk_weights is not None else dummy, pos, layout, self.bases, self.state,
                self._status_addr(), T, H, max(K, 1), R, self.rank, num_local_experts, num_worst_tokens,
                self.offsets["x"], self.offsets["scales"], self.offsets["topk"], self.offsets["weights"],
                self.offsets["src"], self.offsets["signals"], self.offsets["copied"],
                copied if copied is not None else self._none_copied, fill_from, fill_to, self.timeout_ns,
                self.offsets["cx"],
                t_begin, t_end, int(first),
                X_BYTES=x_bytes, QUANTIZE=quantize, HAS_SCALES=scales is not None, WAIT_COPIES=copies,
                STAGE=stage, SYNC=sync, GATE=cached is not None, HAS_TOPK=topk_idx is not None,
                HAS_WEIGHTS=topk_weights is not None, VEC=_pow2(H * x_bytes // 16), GROUPS=_pow2(H // SCALE_BLOCK),
                KP=_pow2(max(K, 1)), RP=_pow2(R),
                TB=self.quantize_tokens_per_step if quantize else self.tokens_per_step, QG=self.quantize_groups_per_step,
                WIDE_E4M3=self.e4m3_store_bytes == 16,
                TRACE=trace is not None,
                trace_ptr=trace_view, trace_tag=tag, num_warps=self.num_warps,
            )

        row_bytes = H * x_bytes
        peers = self._peers
        if staged:  # launches over the tokens of the copied prefixes, each followed by a copy of the rows it staged
            # (the combine area is the staging area: nothing else uses it during a dispatch), then one that pushes
            # the later tokens' rows itself (beside the copies), signals and waits
            # The copy stream's first wait (for the peers' start signals) is queued after the first launch, which
            # sends this rank's: queued before it, the wait can hold the launch back (the streams may share a hardware
            # queue) and two ranks then wait for each other's signal for ever.
            chunks = self._stage_split(plans, is_token_in_rank)
            split = self._dispatch_split(plans, is_token_in_rank)
            pos = split.pos
            inputs_ready = torch.cuda.current_stream(self.device.index).record_event()
            for c, (t_begin, t_end, staged_rows) in enumerate(chunks):
                launch(t_begin, t_end, sync=False, copied=split.copied, fill_from=split.fill_from,
                       fill_to=split.fill_to, stage=True,
                       first=c == 0)
                staged_event = torch.cuda.current_stream(self.device.index).record_event()
                if c == 0:
                    self._copy_start(0, after=inputs_ready)
                last = c == len(chunks) - 1
                self._copy_step([(self.base_addrs[peer] + self.offsets["x"] + row * row_bytes,
                                  self.base_addrs[self.rank] + self.offsets["cx"] + row * row_bytes, n * row_bytes)
                                 for peer, row, n in staged_rows], 0, peers if last else [], after=staged_event)
            if chunks:
                copied = self._copy_done()
                launch(chunks[-1][1], T, sync=True, copied=split.copied, first=False)
            else:  # nothing staged: the peers still wait for this rank's copy-done flag
                launch(0, T, sync=True, copied=split.copied, first=True)
                copied = self._copy([([], 0, peers)], 0, after=inputs_ready)
        elif pushed:  # every row from the SMs, on the rows the copy-engine dispatches of this layout use
            pos = self._dispatch_split(plans, is_token_in_rank).pos
            launch(0, T, sync=True)
        elif copies:  # the kernel moves this rank's own rows, the rest, and metadata beside the copies
            split = self._dispatch_split(plans, is_token_in_rank)
            pos = split.pos  # (the launch reads it)
            inputs_ready = torch.cuda.current_stream(self.device.index).record_event()
            launch(0, T, sync=True, copied=split.copied, fill_from=split.fill_from, fill_to=split.fill_to)
            copied = self._copy([([(self.base_addrs[peer] + self.offsets["x"] + row * row_bytes, x.data_ptr(), m * row_bytes)
                                   for peer, m, row in split.copies], 0, peers)], 0,  # every peer waits for it
                                after=inputs_ready)
        else:
            launch(0, T, sync=True)
        result = dataclasses.replace(plans, sent_pos=pos)  # for this dispatch's combine (the plans are shared)
        if copies:
            torch.cuda.current_stream(self.device.index).wait_event(copied)
        n_groups = H // SCALE_BLOCK
        recv_x = self._view("x", torch.float8_e4m3fn if x_bytes == 1 else torch.bfloat16, (rows, H))
        recv_scales = self._view("scales", torch.float32, (rows, n_groups)) if (quantize or scales is not None) else None
        recv_topk = self._view("topk", torch.int64, (rows, K)) if topk_idx is not None else None
        recv_weights = self._view("weights", torch.float32, (rows, K)) if topk_weights is not None else None
        recv_src = self._view("src", torch.int32, (rows,))
        return recv_x, recv_scales, recv_topk, recv_weights, recv_src, result

    def combine(self, y: torch.Tensor, y_weights: torch.Tensor | None, layout: NvlinkLayout, trace=None):
        """Send received row r of ``y`` (bf16 ``[num_recv_rows, hidden]``) back to its source and sum,
        per token, the rows that come back (fp32). Returns ``(combined bf16 [num_tokens, hidden],
        combined weights fp32 [num_tokens, K] or None)``; fresh tensors."""
        self.raise_if_failed()
        R, T, H = self.num_ranks, layout.num_tokens, self.hidden
        if y.dtype != torch.bfloat16 or y.shape != (layout.num_recv_rows, H) or not y.is_contiguous():
            raise ValueError(f"x: expected a contiguous bf16 tensor of shape {(layout.num_recv_rows, H)}, "
                             f"got {y.dtype} {tuple(y.shape)}")
        check_combine_weights(y_weights, layout.num_recv_rows, self.max_topk)
        K = y_weights.size(1) if y_weights is not None else 1
        copies = self.bulk == "copy_engine"
        if copies and torch.cuda.is_current_stream_capturing() and (
                ("combine", self.combine_copy_share, tuple(self.combine_chunks)) not in layout.splits):
            raise ValueError("bulk='copy_engine': a combine captured in a CUDA graph needs a layout that an earlier "
                             "combine has used (its copies are planned on the host)")
        out = torch.empty(T, H, dtype=torch.bfloat16, device=self.device)
        out_w = torch.empty(T, K, dtype=torch.float32, device=self.device) if y_weights is not None else None
        chunk_ends = self._all_by_sms
        if copies:
            chunks, chunk_ends = self._combine_split(layout)
            inputs_ready = torch.cuda.current_stream(self.device.index).record_event()
        if trace is not None:
            trace_view, tag = trace.slots(self.num_sms, "combine", "comm")
        else:
            trace_view, tag = layout.layout, 0
        chunk_count = chunk_ends.size(1)
        launch_combine(
            self.num_sms,
            y.view(torch.uint8).view(torch.int32),
            y_weights if y_weights is not None else out, layout.layout, layout.sent_pos, self.bases,
            self.state, self._status_addr(), self.buffer, chunk_ends, out, out_w if out_w is not None else out, T, H, K, R,
            self.rank, self.max_tokens, layout.num_recv_rows, self.offsets["cx"], self.offsets["cw"],
            self.offsets["chunk_ends"],
            self.offsets["signals"], self.offsets["copied"] + 4 * R, self.timeout_ns,
            VEC=_pow2(H * 2 // 16), HB=_pow2(H), KP=_pow2(K), RP=_pow2(R), TB=self.combine_tokens_per_step,
            HAS_WEIGHTS=y_weights is not None, WAIT_COPIES=copies, CHUNKS=chunk_count, CP=_pow2(chunk_count),
            TRACE=trace is not None, trace_ptr=trace_view, trace_tag=tag, num_warps=self.num_warps,
        )
        if copies:  # queued after the kernel (which pushes the rest and the weights and sums as chunks land)
            row_bytes = H * 2
            copied = self._copy([([(self.base_addrs[source] + self.offsets["cx"]
                                    + (self.rank * self.max_tokens + slot) * row_bytes,
                                    y.data_ptr() + row * row_bytes, n * row_bytes) for source, row, n, slot in chunk],
                                  1 + c, sorted({source for source, *_ in chunk}) if c < len(chunks) - 1 else
                                  self._peers) for c, chunk in enumerate(chunks)], 1, after=inputs_ready)
            torch.cuda.current_stream(self.device.index).wait_event(copied)
        return out, out_w
