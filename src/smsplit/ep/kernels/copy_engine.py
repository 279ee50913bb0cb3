"""The copy-engine transport's kernels (`smsplit.ep.copy_engine`): a gate per call, the pack of each rank's tokens
into its staging area (its own rows straight into the received tensors), and the sum of the rows the copy engines
brought back."""

import triton
import triton.language as tl

from smsplit import ptx
from smsplit.trace import record_block

from .common import column, local_experts, wait_for_ranks
from .rows import load_tokens, sum_returned_rows


@triton.jit(do_not_specialize=["epoch"])
def gate_kernel(bases_ptr, arrive_off, ack_off, force_off, status_addr, fail_ptr, rank, R, NC, epoch, timeout_ns,
                phase):
    """One program: tell every rank that this rank has entered call ``epoch`` of this phase, then wait
    (bounded) until every rank has entered it and has acknowledged (``ack >= epoch - 1``) that it is done
    with what this rank is about to overwrite. If a wait times out, write ``epoch`` into this rank's
    ``force_off`` flags (``[R][NC]``) so that copy-engine streams waiting on them move on."""
    status_ptr = status_addr.to(tl.pointer_type(tl.int32))
    own = tl.load(bases_ptr + rank)
    own_ack = (own + ack_off).to(tl.pointer_type(tl.int32))
    tl.store(own_ack + rank, epoch)  # this rank never waits for itself
    for d in range(R):
        arrive = (tl.load(bases_ptr + d) + arrive_off).to(tl.pointer_type(tl.int32))
        ptx.st_release_sys(arrive + rank, epoch)
    own_arrive = (own + arrive_off).to(tl.pointer_type(tl.int32))
    wait_for_ranks(own_arrive, 0, 1, R, rank, 0, epoch, timeout_ns, status_ptr, fail_ptr, phase)
    wait_for_ranks(own_ack, 0, 1, R, rank, 1, epoch - 1, timeout_ns, status_ptr, fail_ptr, phase + 1)
    if tl.load(fail_ptr, volatile=True) != 0:
        force = (own + force_off).to(tl.pointer_type(tl.int32))
        for i in range(R * NC):
            tl.store(force + i, epoch)


@triton.jit(do_not_specialize=["T", "self_start", "epoch", "trace_tag"])  # per-call values must not recompile
def pack_kernel(x_ptr, scales_ptr, topk_ptr, weights_ptr, pos_ptr, bases_ptr, done_ptr, own_buf,
                recv_x, recv_scales, recv_topk, recv_weights, recv_src,
                T, H, K, R, rank, M, NC, chunk_tokens, self_start, num_local_experts, epoch,
                off_sx, off_ss, off_stopk, off_sw, off_ssrc, off_ready,
                X_BYTES: tl.constexpr, QUANTIZE: tl.constexpr, HAS_SCALES: tl.constexpr,
                HAS_TOPK: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                VEC: tl.constexpr, GROUPS: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr,
                TB: tl.constexpr, TRACE: tl.constexpr, trace_ptr, trace_tag):
    """Token t goes to row ``pos[t, d]`` of destination d's staging area (this rank's symmetric buffer,
    read by d's copy engine) or, for d == rank, straight to row ``self_start + pos[t, rank]`` of the
    received tensors. Tokens go in NC chunks of ``chunk_tokens``; when every program has finished a
    chunk, the last one release-stores ``epoch`` into ``ready[rank][chunk]`` of every other rank."""
    if TRACE:
        t_start = ptx.globaltimer()
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, RP)
    # staging regions of this rank's buffer, as typed pointers (their alignment is known: stores vectorize)
    sx = own_buf + off_sx
    ss = (own_buf + off_ss).to(tl.pointer_type(tl.float32), bitcast=True)
    stopk = (own_buf + off_stopk).to(tl.pointer_type(tl.int64), bitcast=True)
    sw = (own_buf + off_sw).to(tl.pointer_type(tl.float32), bitcast=True)
    ssrc = (own_buf + off_ssrc).to(tl.pointer_type(tl.int32), bitcast=True)
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
                if QUANTIZE or HAS_SCALES:
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
            for d in range(R):
                if d != rank:
                    ready = (tl.load(bases_ptr + d) + off_ready).to(tl.pointer_type(tl.int32))
                    ptx.st_release_sys(ready + rank * NC + c, epoch)
    if TRACE:
        record_block(trace_ptr, trace_tag, t_start)


@triton.jit(do_not_specialize=["T", "self_start", "epoch", "trace_tag"])  # per-call values must not recompile
def reduce_kernel(y_ptr, yw_ptr, pos_ptr, bases_ptr, exit_ptr, status_addr, fail_ptr, own_buf, out_ptr, out_w_ptr,
                  T, H, K, R, rank, M, NC, chunk_tokens, self_start, epoch,
                  off_cx, off_cw, off_cready, off_cack, timeout_ns,
                  HB: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr, TB: tl.constexpr,
                  HAS_WEIGHTS: tl.constexpr, TRACE: tl.constexpr, trace_ptr, trace_tag):
    """Sum, for each of this rank's tokens, its rows from the ranks it went to (fp32) into out (bf16):
    its own rank's row straight from y, the others' from the combine area, where the copy engines of
    those ranks put them. Chunk by chunk: wait (bounded) until every rank has flagged the chunk. At the
    end the last program release-stores ``epoch`` into ``combine_ack[rank]`` of every other rank."""
    status_ptr = status_addr.to(tl.pointer_type(tl.int32))
    if TRACE:
        t_start = ptx.globaltimer()
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cready = (own_buf + off_cready).to(tl.pointer_type(tl.int32), bitcast=True)
    cx = (own_buf + off_cx).to(tl.pointer_type(tl.bfloat16), bitcast=True)
    cw = (own_buf + off_cw).to(tl.pointer_type(tl.float32), bitcast=True)
    for c in range(NC):
        wait_for_ranks(cready, c, NC, R, rank, 1, epoch, timeout_ns, status_ptr, fail_ptr, 7)
        t_end = tl.minimum(T, (c + 1) * chunk_tokens)
        for t0 in range(c * chunk_tokens + pid * TB, t_end, programs * TB):
            t = t0 + tl.arange(0, TB)
            sum_returned_rows(t, t < t_end, pos_ptr, R, rank, self_start, y_ptr, yw_ptr, cx, cw, M, out_ptr, out_w_ptr,
                              H, K, HB, KP, RP, TB, HAS_WEIGHTS)  # slot [destination][position]
    tl.debug_barrier()
    old = tl.atomic_add(exit_ptr, 1, sem="acq_rel", scope="gpu")
    if old == programs - 1:
        tl.store(exit_ptr, 0)
        ptx.fence_acq_rel_sys()
        for d in range(R):
            if d != rank:
                ack = (tl.load(bases_ptr + d) + off_cack).to(tl.pointer_type(tl.int32))
                ptx.st_release_sys(ack + rank, epoch)
    if TRACE:
        record_block(trace_ptr, trace_tag, t_start)
