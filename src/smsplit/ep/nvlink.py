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
   with a release add and waits until every program of every source has signalled it.

A combine pushes each received row back into its source's combine area (one slot per token and
expert rank), signals, waits, and sums the slots of each token in fp32.

Waits are bounded: a wait that passes ``timeout_s`` records (phase, peer, counts) in a pinned host
word and lets the kernel finish; the host raises ``EPTimeoutError`` naming rank, peer and phase.

Received tensors are views into the buffer: they stay valid until the next dispatch on this buffer.
The next dispatch bumps their autograd version, so a backward that saved one raises instead of
reading overwritten data; clone a received tensor to keep it longer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from smsplit import ptx
from smsplit.trace import record_block

from .transport import EPTimeoutError

SCALE_BLOCK = 128
FP8_MAX = 448.0
ALIGN = 256
PHASES = ("notify", "dispatch", "combine")
# local state words (per rank, not shared): [phase] arrivals per source seen so far,
# [4 + phase] programs of the current launch that have finished
STATE_WORDS = 8


# --- device helpers --------------------------------------------------------------------------------

@triton.jit
def _wait_for_sources(sig_ptr, R, target, timeout_ns, status_ptr, phase):
    """Wait until ``sig_ptr[s] >= target`` for every source s < R, each wait bounded by
    ``timeout_ns``. On timeout writes (phase, source, seen, expected) to the status words."""
    failed = tl.load(status_ptr, volatile=True)
    for s in range(R):
        start = ptx.globaltimer()
        now = start
        seen = ptx.ld_acquire_sys(sig_ptr + s)
        while (seen < target) & (now - start < timeout_ns) & (failed == 0):
            seen = ptx.ld_acquire_sys(sig_ptr + s)
            now = ptx.globaltimer()
        if (seen < target) & (failed == 0):
            tl.store(status_ptr + 1, s)
            tl.store(status_ptr + 2, seen)
            tl.store(status_ptr + 3, target)
            tl.store(status_ptr, phase)
            failed = 1


@triton.jit
def _signal_all(bases_ptr, sig_off, rank, R):
    """Release-add 1 to ``signal[rank]`` of every peer (thread 0), after this program's stores."""
    tl.debug_barrier()
    ptx.fence_acq_rel_sys()
    for d in range(R):
        sig = (tl.load(bases_ptr + d) + sig_off).to(tl.pointer_type(tl.int32))
        ptx.atom_add_release_sys(sig + rank, 1)


@triton.jit
def _finish(state_ptr, phase, expected, per_source, programs):
    """The last program of a launch to finish advances the phase's expected arrivals per source
    and resets the exit counter."""
    old = tl.atomic_add(state_ptr + 4 + phase, 1, sem="acq_rel", scope="gpu")
    if old == programs - 1:
        tl.store(state_ptr + 4 + phase, 0)
        tl.store(state_ptr + phase, expected + per_source)


# --- notify ------------------------------------------------------------------------------------------

@triton.jit
def notify_kernel(counts_ptr, bases_ptr, counts_off, sig_off, state_ptr, layout_ptr, status_ptr,
                  rank, R, num_worst, timeout_ns, RP: tl.constexpr):
    """layout_ptr (int32): [0, R) where this rank's tokens start on each destination,
    [R, 2R] where each source's tokens start here (prefix, last = total), [2R + 1] rows received."""
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
    _wait_for_sources(own_sig, R, expected + 1, timeout_ns, status_ptr, 1)
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
    _finish(state_ptr, 0, expected, 1, 1)


# --- dispatch ----------------------------------------------------------------------------------------

@triton.jit
def dispatch_kernel(x_ptr, scales_ptr, topk_ptr, weights_ptr, pos_ptr, layout_ptr, bases_ptr, state_ptr,
                    status_ptr, T, H, K, R, rank, num_local_experts, num_worst,
                    off_x, off_scales, off_topk, off_weights, off_src, sig_off, timeout_ns,
                    X_BYTES: tl.constexpr, QUANTIZE: tl.constexpr, HAS_SCALES: tl.constexpr,
                    HAS_TOPK: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                    VEC: tl.constexpr, GROUPS: tl.constexpr, KP: tl.constexpr, TRACE: tl.constexpr,
                    trace_ptr, trace_tag):
    """x rows go to receive row ``send_start[d] + pos[t, d]`` of every destination d with pos >= 0.
    X_BYTES: bytes per element of the received x (2: bf16, 1: fp8). QUANTIZE: x is bf16, quantize."""
    if TRACE:
        t_start = ptx.globaltimer()
    expected = tl.load(state_ptr + 1, volatile=True)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    vec = tl.arange(0, VEC)
    row_bytes = H * X_BYTES
    n_vec = row_bytes // 16
    vmask = vec < n_vec
    n_groups = H // 128
    g = tl.arange(0, GROUPS)[:, None]
    c = tl.arange(0, 128)[None, :]
    gmask = g < n_groups
    k = tl.arange(0, KP)
    kmask = k < K
    for t in range(pid, T, programs):
        t64 = t.to(tl.int64)
        if QUANTIZE:
            xf = tl.load(x_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True) + t64 * H + g * 128 + c,
                         mask=gmask, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(xf), axis=1)
            scale = tl.where(amax > 0, amax / 448.0, 1.0)
            q = (xf / scale[:, None]).to(tl.float8e4nv)
        else:
            w0, w1, w2, w3 = ptx.ld_global_nc_v4(x_ptr + t64 * (row_bytes // 4) + 4 * vec, vmask)
            if HAS_SCALES:
                scale = tl.load(scales_ptr + t64 * n_groups + tl.arange(0, GROUPS), mask=tl.arange(0, GROUPS) < n_groups)
        if HAS_TOPK:
            topk = tl.load(topk_ptr + t64 * K + k, mask=kmask, other=-1)
        if HAS_WEIGHTS:
            weights = tl.load(weights_ptr + t64 * K + k, mask=kmask, other=0.0)
        for d in range(R):
            p = tl.load(pos_ptr + t64 * R + d)
            if p >= 0:
                row = (tl.load(layout_ptr + d) + p).to(tl.int64)
                base = tl.load(bases_ptr + d)
                if QUANTIZE:
                    dst_q = (base + off_x + row * H).to(tl.pointer_type(tl.float8e4nv))
                    tl.store(dst_q + g * 128 + c, q, mask=gmask)
                    dst_s = (base + off_scales + row * n_groups * 4).to(tl.pointer_type(tl.float32))
                    tl.store(dst_s + tl.arange(0, GROUPS), scale,
                             mask=tl.arange(0, GROUPS) < n_groups)
                else:
                    dst = (base + off_x + row * row_bytes).to(tl.pointer_type(tl.int32))
                    ptx.st_global_na_v4(dst + 4 * vec, w0, w1, w2, w3, vmask)
                    if HAS_SCALES:
                        dst_s = (base + off_scales + row * n_groups * 4).to(tl.pointer_type(tl.float32))
                        tl.store(dst_s + tl.arange(0, GROUPS), scale, mask=tl.arange(0, GROUPS) < n_groups)
                if HAS_TOPK:
                    local = topk - d * num_local_experts
                    local = tl.where((topk >= 0) & (local >= 0) & (local < num_local_experts), local, -1)
                    dst_k = (base + off_topk + row * K * 8).to(tl.pointer_type(tl.int64))
                    tl.store(dst_k + k, local, mask=kmask)
                if HAS_WEIGHTS:
                    dst_w = (base + off_weights + row * K * 4).to(tl.pointer_type(tl.float32))
                    tl.store(dst_w + k, weights, mask=kmask)
                dst_i = (base + off_src + row * 4).to(tl.pointer_type(tl.int32))
                tl.store(dst_i, t)
    _signal_all(bases_ptr, sig_off + 1 * 64, rank, R)
    own = tl.load(bases_ptr + rank)
    _wait_for_sources((own + sig_off + 1 * 64).to(tl.pointer_type(tl.int32)), R, expected + programs,
                      timeout_ns, status_ptr, 2)
    if num_worst > 0:  # padding rows: zeros, top-k -1
        total = tl.load(layout_ptr + 2 * R)
        for row32 in range(total + pid, num_worst, programs):
            row = row32.to(tl.int64)
            dst = (own + off_x + row * row_bytes).to(tl.pointer_type(tl.int32))
            ptx.st_global_na_v4(dst + 4 * vec, vec * 0, vec * 0, vec * 0, vec * 0, vmask)
            if QUANTIZE or HAS_SCALES:
                dst_s = (own + off_scales + row * n_groups * 4).to(tl.pointer_type(tl.float32))
                tl.store(dst_s + tl.arange(0, GROUPS), 0.0, mask=tl.arange(0, GROUPS) < n_groups)
            if HAS_TOPK:
                tl.store((own + off_topk + row * K * 8).to(tl.pointer_type(tl.int64)) + k, -1, mask=kmask)
            if HAS_WEIGHTS:
                tl.store((own + off_weights + row * K * 4).to(tl.pointer_type(tl.float32)) + k, 0.0, mask=kmask)
            tl.store((own + off_src + row * 4).to(tl.pointer_type(tl.int32)), -1)
    _finish(state_ptr, 1, expected, programs, programs)
    if TRACE:
        record_block(trace_ptr, trace_tag, t_start)


# --- combine -----------------------------------------------------------------------------------------

@triton.jit
def combine_kernel(y_ptr, yw_ptr, src_ptr, layout_ptr, pos_ptr, bases_ptr, state_ptr, status_ptr,
                   out_ptr, out_w_ptr, T, H, K, R, rank, max_tokens, n_rows,
                   off_cx, off_cw, sig_off, timeout_ns,
                   VEC: tl.constexpr, HB: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr,
                   HAS_WEIGHTS: tl.constexpr, TRACE: tl.constexpr, trace_ptr, trace_tag):
    """Push received row r back to slot [rank][src[r]] of its source's combine area, then sum
    the slots [d][t] of this rank's tokens over the ranks d they went to (fp32) into out (bf16)."""
    if TRACE:
        t_start = ptx.globaltimer()
    expected = tl.load(state_ptr + 2, volatile=True)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    vec = tl.arange(0, VEC)
    n_vec = H * 2 // 16
    vmask = vec < n_vec
    k = tl.arange(0, KP)
    kmask = k < K
    total = tl.load(layout_ptr + 2 * R)
    sources = tl.arange(0, RP)
    starts = tl.load(layout_ptr + R + sources, mask=sources < R, other=2**30)
    for r in range(pid, total, programs):
        r64 = r.to(tl.int64)
        source = tl.sum((starts <= r).to(tl.int32), axis=0) - 1
        j = tl.load(src_ptr + r64).to(tl.int64)
        base = tl.load(bases_ptr + source)
        w0, w1, w2, w3 = ptx.ld_global_nc_v4(y_ptr + r64 * (n_vec * 4) + 4 * vec, vmask)
        slot = rank * max_tokens + j
        dst = (base + off_cx + slot * H * 2).to(tl.pointer_type(tl.int32))
        ptx.st_global_na_v4(dst + 4 * vec, w0, w1, w2, w3, vmask)
        if HAS_WEIGHTS:
            w = tl.load(yw_ptr + r64 * K + k, mask=kmask)
            tl.store((base + off_cw + slot * K * 4).to(tl.pointer_type(tl.float32)) + k, w, mask=kmask)
    _signal_all(bases_ptr, sig_off + 2 * 64, rank, R)
    own = tl.load(bases_ptr + rank)
    _wait_for_sources((own + sig_off + 2 * 64).to(tl.pointer_type(tl.int32)), R, expected + programs,
                      timeout_ns, status_ptr, 3)
    h = tl.arange(0, HB)
    hmask = h < H
    for t in range(pid, T, programs):
        t64 = t.to(tl.int64)
        acc = tl.zeros((HB,), dtype=tl.float32)
        acc_w = tl.zeros((KP,), dtype=tl.float32)
        for d in range(R):
            if tl.load(pos_ptr + t64 * R + d) >= 0:
                slot = d * max_tokens + t64
                src = (own + off_cx + slot * H * 2).to(tl.pointer_type(tl.bfloat16))
                acc += tl.load(src + h, mask=hmask, other=0.0, volatile=True).to(tl.float32)
                if HAS_WEIGHTS:
                    src_w = (own + off_cw + slot * K * 4).to(tl.pointer_type(tl.float32))
                    acc_w += tl.load(src_w + k, mask=kmask, other=0.0, volatile=True)
        tl.store(out_ptr + t64 * H + h, acc.to(tl.bfloat16), mask=hmask)
        if HAS_WEIGHTS:
            tl.store(out_w_ptr + t64 * K + k, acc_w, mask=kmask)
    _finish(state_ptr, 2, expected, programs, programs)
    if TRACE:
        record_block(trace_ptr, trace_tag, t_start)
