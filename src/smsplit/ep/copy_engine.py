"""Copy-engine transport: SMs pack, the GPU's copy engines move the bytes across NVLink, SMs unpack (the copies and
stream memory operations through `smsplit.cuda_driver.StreamOps`)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from smsplit.cuda_driver import StreamOps
from smsplit.launch import FastLaunch

from .kernels import copy_engine as kernels
from .kernels.copy_engine import gate_kernel, pack_kernel, reduce_kernel
from .layout import next_pow2 as _pow2
from .layout import token_positions
from .rows import region_offsets
from .nvlink_plan import ALIGN, SCALE_BLOCK, check_num_sms
from .transport import (EPTimeoutError, all_gather_into_tensor, check_combine_weights, check_num_worst_tokens, poll_until,
                        symmetric_buffer)


PHASES = {5: "dispatch: waiting for rank {peer} to enter the dispatch",
          6: "dispatch: waiting for rank {peer} to finish copying the previous dispatch",
          7: "combine: waiting for rank {peer}'s rows",
          8: "combine: waiting for rank {peer} to enter the combine",
          9: "combine: waiting for rank {peer} to finish the previous combine"}


launch_gate, launch_pack, launch_reduce = FastLaunch(gate_kernel), FastLaunch(pack_kernel), FastLaunch(reduce_kernel)


def _region_bytes(R: int, M: int, H: int, K: int, NC: int) -> dict:
    """Bytes of each region of the symmetric buffer: the flags, the staging area (this rank's tokens packed per
    destination, bf16-sized rows, with scales, top-k, weights and source index), the combine area (the rows
    other ranks send back, one slot per rank and token)."""
    rows = R * M
    return {"ready": R * NC * 4, "combine_ready": R * NC * 4, "dispatch_arrive": R * 4, "combine_arrive": R * 4,
            "dispatch_ack": R * 4, "combine_ack": R * 4,
            "sx": rows * H * 2, "ss": rows * (H // SCALE_BLOCK) * 4, "stopk": rows * K * 8, "sw": rows * K * 4,
            "ssrc": rows * 4, "cx": rows * H * 2, "cw": rows * K * 4}


@dataclass
class CopyEngineLayout:
    """Host and device layout of one dispatch, kept for its combine.

    Attributes:
        pos: ``[num_tokens, num_ranks]`` int32 on the device: the token's row among this rank's tokens for each
            destination, -1 where it does not go.
        counts: ``[num_ranks, num_chunks, num_ranks]`` host array: tokens from rank s's chunk c to rank d.
        num_tokens: tokens on this rank.
        chunk_tokens: tokens per chunk on this rank.
        recv_start: ``num_ranks + 1`` host ints: where each source's rows start in the received tensors.
        num_recv_rows: rows of the received tensors (``num_worst_tokens``, or the exact count).
    """

    pos: torch.Tensor
    counts: np.ndarray
    num_tokens: int
    chunk_tokens: int
    recv_start: list
    num_recv_rows: int

    @property
    def num_recv_tokens(self) -> int:
        return self.recv_start[-1]


class CopyEngineTransport:
    """Dispatch/combine between the GPUs of one node with the copy engines moving the bytes (module docstring).

    Args:
        group: NCCL process group, one rank per GPU, all GPUs NVLink peers.
        device: this rank's GPU.
        max_tokens: the most tokens any rank dispatches in one call.
        hidden: hidden size (a multiple of 128).
        max_topk: the largest top-k (up to 16).
        num_chunks: pieces each rank's tokens are cut into, so that packing, copying and summing overlap.
        num_copy_streams: streams the copies are spread over (peers round-robin).
        timeout_s: the longest a kernel waits for a peer before recording a timeout.

    Every call passes ``num_sms``: the programs of its pack or reduce kernel (every rank the same count), at most the
    SMs the caller's stream can reach.
    """

    returns_views = False  # fresh received tensors: Buffer need not copy them

    def __init__(self, group, device: torch.device, max_tokens: int, hidden: int, max_topk: int = 16,
                 timeout_s: float = 60.0, num_chunks: int = 4, num_copy_streams: int = 2):
        if hidden % SCALE_BLOCK:
            raise ValueError(f"hidden must be a multiple of {SCALE_BLOCK}, got {hidden}")
        if not 1 <= max_topk <= 16:
            raise ValueError(f"max_topk must be in 1..16, got {max_topk}")
        if num_chunks < 1 or num_copy_streams < 1:
            raise ValueError(f"num_chunks and num_copy_streams must be >= 1, got {num_chunks}, {num_copy_streams}")
        self.group = group
        self.rank, self.num_ranks = group.rank(), group.size()
        self.device = torch.device(device)
        self.num_chunks = num_chunks
        self.max_tokens, self.hidden, self.max_topk = max_tokens, hidden, max_topk
        self.timeout_s, self.timeout_ns = timeout_s, int(timeout_s * 1e9)
        self.offsets, total = region_offsets(_region_bytes(self.num_ranks, max_tokens, hidden, max_topk, num_chunks),
                                             ALIGN)
        self.nbytes = total
        self.buffer, self.handle = symmetric_buffer(total, torch.uint8, group, self.device)
        self.buffer[: self.offsets["sx"]].zero_()
        self.base_addrs = list(self.handle.buffer_ptrs)
        self.done = torch.zeros(num_chunks + 1, dtype=torch.int32, device=self.device)  # pack chunks, reduce exit
        self.status = torch.zeros(4, dtype=torch.int32, pin_memory=True)
        self._status_words = self.status.numpy()  # (the same memory: a read without torch's per-call work)
        self.failed = torch.zeros(1, dtype=torch.int32, device=self.device)  # set by a wait that timed out
        self.call = torch.zeros(2, kernels.CALL_WORDS.value, dtype=torch.int32, device=self.device)  # the gates'
        self.ctx = torch.tensor(self._context_table(), dtype=torch.int64, device=self.device)
        rows = self.num_ranks * max_tokens  # this rank's combine area: bf16 rows, then (right after) fp32 weights
        if self.offsets["cw"] != self.offsets["cx"] + rows * hidden * 2:
            raise AssertionError("the combine area's weights must follow its rows (the reduce kernel derives them)")
        self._cx = self.buffer[self.offsets["cx"]: self.offsets["cw"]].view(torch.bfloat16)
        self._dummy_f32 = torch.zeros(1, dtype=torch.float32, device=self.device)  # for absent received tensors
        self._dummy_i64 = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.ops = StreamOps(self.device)
        self.copy_streams = [self.ops.new_stream() for _ in range(num_copy_streams)]
        self.dispatch_epoch = 0
        self.combine_epoch = 0
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group, device_ids=[self.device.index])

    def _context_table(self) -> list:
        """The words of this rank's context table (`smsplit.ep.kernels.copy_engine`): every rank's buffer address,
        then the constants the kernels load."""
        words = [0] * kernels.CE_WORDS
        words[:self.num_ranks] = self.base_addrs
        gate = [self.offsets[name] for name in ("dispatch_arrive", "dispatch_ack", "ready", "combine_arrive",
                                                "combine_ack", "combine_ready")]
        for index, value in ((kernels.CE_TIMEOUT, self.timeout_ns), (kernels.CE_STATUS, self.status.data_ptr()),
                             (kernels.CE_FAIL, self.failed.data_ptr()), (kernels.CE_DONE, self.done.data_ptr()),
                             (kernels.CE_CALL, self.call.data_ptr()), (kernels.CE_RANK, self.rank),
                             (kernels.CE_M, self.max_tokens), (kernels.CE_NC, self.num_chunks),
                             (kernels.CE_SX, self.offsets["sx"]), (kernels.CE_SS, self.offsets["ss"]),
                             (kernels.CE_STOPK, self.offsets["stopk"]), (kernels.CE_SW, self.offsets["sw"]),
                             (kernels.CE_SSRC, self.offsets["ssrc"]),
                             *((kernels.CE_GATE + i, offset) for i, offset in enumerate(gate))):
            words[int(index)] = value
        return words

    @staticmethod
    @functools.lru_cache(maxsize=256)  # (every eager Buffer call checks its arguments against it)
    def buffer_bytes(num_ranks: int, max_tokens: int, hidden: int, max_topk: int = 16, num_chunks: int = 4) -> int:
        """Bytes of the symmetric buffer each rank allocates."""
        return region_offsets(_region_bytes(num_ranks, max_tokens, hidden, max_topk, num_chunks), ALIGN)[1]

    # -- status ---------------------------------------------------------------------------------------

    def raise_if_failed(self) -> None:
        """Raise EPTimeoutError if a kernel recorded a timeout (reads pinned host memory; no sync)."""
        if self._status_words[0] == 0:
            return
        phase, peer, seen, expected = self.status.tolist()
        what = PHASES.get(phase, "phase {phase}").format(peer=peer, phase=phase) + f" (saw {seen}, expected {expected})"
        raise EPTimeoutError.on_device(self.rank, peer, what, self.timeout_s)

    def _flag(self, rank: int, name: str, index: int) -> int:
        return self.base_addrs[rank] + self.offsets[name] + 4 * index

    # -- layout ---------------------------------------------------------------------------------------

    def layout(self, is_token_in_rank: torch.Tensor, num_worst_tokens: int = 0) -> CopyEngineLayout:
        """Where every token goes, from every rank's ``is_token_in_rank`` (a collective: an NCCL all-gather of
        per-chunk counts, then a host copy). Raises ValueError on every rank if any rank would receive more
        than ``num_worst_tokens`` rows (when it is > 0): `EPArgumentError` (`check_num_worst_tokens`)."""
        R, NC = self.num_ranks, self.num_chunks
        T = is_token_in_rank.size(0)
        chunk = max(1, -(-T // NC))
        in_rank = is_token_in_rank.to(torch.int32)
        pos = token_positions(is_token_in_rank)
        chunk_of = torch.arange(T, device=self.device) // chunk
        per_chunk = torch.zeros(NC, R, dtype=torch.int64, device=self.device).index_add_(0, chunk_of, in_rank.long())
        gathered = torch.empty(R, NC, R, dtype=torch.int64, device=self.device)
        work = all_gather_into_tensor(gathered, per_chunk, group=self.group, async_op=True)
        if not poll_until(work.is_completed, time.monotonic() + self.timeout_s):
            peer = (self.rank + 1) % R
            what = f"layout: waiting for the per-chunk counts of one of ranks {[p for p in range(R) if p != self.rank]}"
            raise EPTimeoutError.on_device(self.rank, peer, what, self.timeout_s)
        counts = gathered.cpu().numpy()
        totals = counts.sum(axis=(0, 1))  # rows each rank receives
        check_num_worst_tokens(totals.tolist(), [num_worst_tokens] * R)
        recv = counts[:, :, self.rank].sum(axis=1)
        recv_start = [0] + np.cumsum(recv).tolist()
        return CopyEngineLayout(pos, counts, T, chunk, [int(v) for v in recv_start],
                                num_worst_tokens or int(recv_start[-1]))

    # -- dispatch / combine ---------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
                 topk_weights: torch.Tensor | None, is_token_in_rank: torch.Tensor, num_local_experts: int, *,
                 num_sms: int, quantize: bool = False, num_worst_tokens: int = 0,
                 cached: CopyEngineLayout | None = None, num_recv_tokens: int | None = None, trace=None):
        """Send each token to the ranks in ``is_token_in_rank``; the same contract as
        `smsplit.ep.nvlink.NvlinkTransport.dispatch`, but the received tensors are fresh (not views).
        ``num_recv_tokens`` is accepted for that contract and not needed: this transport reads its counts on the
        host."""
        self.raise_if_failed()
        num_sms = check_num_sms(num_sms)
        R, NC, T, H, me = self.num_ranks, self.num_chunks, x.size(0), x.size(1), self.rank
        K = topk_idx.size(1) if topk_idx is not None else (topk_weights.size(1) if topk_weights is not None else 0)
        if T > self.max_tokens or H != self.hidden or K > self.max_topk:
            raise ValueError(f"x: {T} tokens x {H} hidden, top-k {K} exceed the transport's "
                             f"max_tokens={self.max_tokens}, hidden={self.hidden}, max_topk={self.max_topk}")
        for name, t in (("x", x), ("scales", scales), ("topk_idx", topk_idx), ("topk_weights", topk_weights),
                        ("is_token_in_rank", is_token_in_rank)):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{name}: the kernels index rows densely; pass a contiguous tensor")
        fp8_in = x.dtype == torch.float8_e4m3fn
        if quantize and fp8_in:
            raise ValueError("quantize: x is already FP8 (pass its scales instead)")
        if (scales is not None) != fp8_in and not quantize:  # (the pack kernel knows FP8 rows by their scales)
            raise ValueError("scales: an FP8 x comes with its fp32 scales (one per 128 values), any other x without")
        if cached is not None:
            if cached.num_tokens != T:
                raise ValueError(f"cached: the cached layout is for {cached.num_tokens} tokens, x has {T}")
            layout = cached
        else:
            layout = self.layout(is_token_in_rank, num_worst_tokens)
        rows, total = layout.num_recv_rows, layout.num_recv_tokens
        x_bytes = 1 if (quantize or fp8_in) else 2
        G = H // SCALE_BLOCK
        stream = torch.cuda.current_stream(self.device.index)
        dev = self.device
        recv_x = torch.empty(rows, H, dtype=torch.float8_e4m3fn if x_bytes == 1 else torch.bfloat16, device=dev)
        recv_scales = torch.empty(rows, G, dtype=torch.float32, device=dev) if (quantize or scales is not None) else None
        recv_topk = torch.empty(rows, K, dtype=torch.int64, device=dev) if topk_idx is not None else None
        recv_weights = torch.empty(rows, K, dtype=torch.float32, device=dev) if topk_weights is not None else None
        recv_src = torch.empty(rows, dtype=torch.int32, device=dev)
        self.dispatch_epoch += 1
        epoch = self.dispatch_epoch
        launch_gate(1, self.ctx, R, 0, epoch, T, layout.chunk_tokens, layout.recv_start[me], num_local_experts,
                    num_warps=1)
        entered = torch.cuda.Event()
        entered.record(stream)
        trace_view, tag = trace.slots(num_sms, "pack", "comm") if trace is not None else (None, 0)
        launch_pack(
            num_sms,
            x if quantize else x.view(torch.uint8).view(torch.int32), scales, topk_idx, topk_weights, layout.pos,
            self.ctx, recv_x, recv_scales if recv_scales is not None else self._dummy_f32,
            recv_topk if recv_topk is not None else self._dummy_i64,
            recv_weights if recv_weights is not None else self._dummy_f32, recv_src, H, max(K, 1), R,
            GROUPS=_pow2(G), KP=_pow2(max(K, 1)), RP=_pow2(R), trace_ptr=trace_view, trace_tag=tag, num_warps=8,
        )
        row_bytes = H * x_bytes
        finished = []
        for i, s in enumerate(p for p in range(R) if p != me):
            cs = self.copy_streams[i % len(self.copy_streams)]
            cs.wait_event(entered)
            base, slab, at = self.base_addrs[s], me * self.max_tokens, layout.recv_start[s]
            n_prev = 0
            for c in range(NC):
                n = int(layout.counts[s, c, me])
                if n == 0 and c < NC - 1:
                    continue
                self.ops.wait_geq(cs, self._flag(me, "ready", s * NC + c), epoch)
                self.ops.memcpy(cs, recv_x.data_ptr() + (at + n_prev) * row_bytes,
                                base + self.offsets["sx"] + (slab + n_prev) * row_bytes, n * row_bytes)
                if recv_scales is not None:
                    self.ops.memcpy(cs, recv_scales.data_ptr() + (at + n_prev) * G * 4,
                                    base + self.offsets["ss"] + (slab + n_prev) * G * 4, n * G * 4)
                n_prev += n
            for t, name, width in ((recv_topk, "stopk", K * 8), (recv_weights, "sw", K * 4), (recv_src, "ssrc", 4)):
                if t is not None:
                    self.ops.memcpy(cs, t.data_ptr() + at * width, base + self.offsets[name] + slab * width,
                                    n_prev * width)
            self.ops.write(cs, self._flag(s, "dispatch_ack", me), epoch)
            done = torch.cuda.Event()
            done.record(cs)
            finished.append(done)
        for done in finished:
            stream.wait_event(done)
        if rows > total:  # num_worst_tokens padding
            recv_x[total:].view(torch.uint8).zero_()
            for t, fill in ((recv_scales, 0), (recv_topk, -1), (recv_weights, 0), (recv_src, -1)):
                if t is not None:
                    t[total:].fill_(fill)
        return recv_x, recv_scales, recv_topk, recv_weights, recv_src, layout

    def combine(self, y: torch.Tensor, y_weights: torch.Tensor | None, layout: CopyEngineLayout, *, num_sms: int,
                trace=None):
        """Send received row r of ``y`` (bf16 ``[num_recv_rows, hidden]``) back to its source and sum, per
        token, the rows that come back (fp32). Returns ``(bf16 [num_tokens, hidden], fp32 [num_tokens, K] or
        None)``."""
        self.raise_if_failed()
        num_sms = check_num_sms(num_sms)
        R, NC, T, H, me = self.num_ranks, self.num_chunks, layout.num_tokens, self.hidden, self.rank
        if y.dtype != torch.bfloat16 or y.shape != (layout.num_recv_rows, H) or not y.is_contiguous():
            raise ValueError(f"x: expected a contiguous bf16 tensor of shape {(layout.num_recv_rows, H)}, "
                             f"got {y.dtype} {tuple(y.shape)}")
        check_combine_weights(y_weights, layout.num_recv_rows, self.max_topk)
        K = y_weights.size(1) if y_weights is not None else 1
        stream = torch.cuda.current_stream(self.device.index)
        out = torch.empty(T, H, dtype=torch.bfloat16, device=self.device)
        out_w = torch.empty(T, K, dtype=torch.float32, device=self.device) if y_weights is not None else None
        self.combine_epoch += 1
        epoch = self.combine_epoch
        launch_gate(1, self.ctx, R, 1, epoch, T, layout.chunk_tokens, layout.recv_start[me], 0, num_warps=1)
        entered = torch.cuda.Event()
        entered.record(stream)
        finished = []
        for i, d in enumerate(p for p in range(R) if p != me):
            cs = self.copy_streams[i % len(self.copy_streams)]
            cs.wait_event(entered)
            base, slab, at = self.base_addrs[d], me * self.max_tokens, layout.recv_start[d]
            n_prev = 0
            for c in range(NC):
                n = int(layout.counts[d, c, me])
                self.ops.memcpy(cs, base + self.offsets["cx"] + (slab + n_prev) * H * 2,
                                y.data_ptr() + (at + n_prev) * H * 2, n * H * 2)
                if y_weights is not None:
                    self.ops.memcpy(cs, base + self.offsets["cw"] + (slab + n_prev) * K * 4,
                                    y_weights.data_ptr() + (at + n_prev) * K * 4, n * K * 4)
                self.ops.write(cs, self._flag(d, "combine_ready", me * NC + c), epoch)
                n_prev += n
            done = torch.cuda.Event()
            done.record(cs)
            finished.append(done)
        trace_view, tag = trace.slots(num_sms, "reduce", "comm") if trace is not None else (None, 0)
        launch_reduce(num_sms, y, y_weights, layout.pos, self.ctx, self._cx, out, out_w, H, K, R, me, self.max_tokens,
                      HB=_pow2(H), KP=_pow2(K), RP=_pow2(R), trace_ptr=trace_view, trace_tag=tag, num_warps=16)
        for done in finished:
            stream.wait_event(done)
        return out, out_w
