"""SM-push transport over NVLink: Triton kernels that write tokens straight into peers' buffers.

Every rank owns one symmetric buffer (``torch.distributed._symmetric_memory``: the same layout on
every rank, each rank's buffer mapped into every peer). A dispatch is two launches on the caller's
stream, both device-only (no host synchronization when the receive size is fixed):

1. ``notify`` (one program): write this rank's per-destination token counts into row ``rank`` of
   every peer's count matrix, signal, wait for every peer's row, then compute where this rank's
   tokens land on each destination and where each source's tokens start here.
2. a dispatch kernel (``num_sms`` persistent programs, the count each call passes): each program takes tokens
   ``pid, pid + P, ...``, loads the row once with 16-byte non-caching loads (or quantizes it to FP8 e4m3 with one
   scale per 128 values) and stores it, its top-k (as the destination's local expert ids), weights and source
   index into every destination's receive area with 16-byte stores. Then it signals each destination with a
   release add and waits until every program of every source has signalled it. With ``bulk="copy_engine"`` one
   copy-engine copy per peer moves the first rows of x instead (`smsplit.ep.nvlink_plan.prefix_plan`) and the
   programs move the rest; rows quantized to FP8 here are pushed by the programs onto the same rows.

A combine first waits until every peer has summed the previous combine (so two combines in a row keep their rows),
pushes each received row back into its source's combine area (one slot per expert rank and
position among the rows that rank received from the source, so each source's rows go back as one block),
signals, waits, and sums the slots of each token in fp32 (with ``bulk="copy_engine"`` the copy engines move
the blocks in chunks and the sum starts on a chunk as soon as it has landed), then signals that its sum is done.
The kernels are in `smsplit.ep.kernels`, one module per family; the host plans in `smsplit.ep.nvlink_plan`.

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

import torch
import torch.distributed as dist

from smsplit.cuda_driver import StreamOps
from smsplit.launch import FastLaunch

from .kernels.combine import combine_copied_kernel, combine_kernel
from .kernels.common import FREE_SLOT, STATE_WORDS, WAITS, X_FREE_SLOT
from .kernels.dispatch import dispatch_kernel
from .kernels.dispatch_copied import dispatch_copied_kernel
from .kernels.dispatch_fp8 import dispatch_fp8_kernel
from .kernels.notify import bump_kernel, notify_kernel
from .layout import next_pow2 as _pow2
from .layout import token_positions
from .rows import region_offsets
from .nvlink_plan import (ALIGN, SCALE_BLOCK, DispatchSplit,
                          check_num_sms, combine_split, context_table, default_combine_chunks, dispatch_split,
                          region_bytes)
from .transport import (EPArgumentError, EPTimeoutError, check_combine_weights, symmetric_buffer,
                        worst_tokens_error)

BULK_MOVERS = ("sm", "copy_engine")
NUM_WARPS = 16  # per program of the dispatch and combine kernels (FP8 dispatch at 20 SMs 116.8 us at 16 against
# 127.9 at 8; combine 198.9-199.9 at 16 against 275.6-276.7 at 32: docs/design-notes.md)

launch_bump, launch_notify = FastLaunch(bump_kernel), FastLaunch(notify_kernel)
launch_dispatch, launch_dispatch_fp8 = FastLaunch(dispatch_kernel), FastLaunch(dispatch_fp8_kernel)
launch_dispatch_copied = FastLaunch(dispatch_copied_kernel)
launch_combine, launch_combine_copied = FastLaunch(combine_kernel), FastLaunch(combine_copied_kernel)


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
        splits: with ``bulk="copy_engine"``, the host plans of this layout, made on first use from a host read:
            ``"dispatch"`` (a `DispatchSplit`: the rows the copy engines move) and ``("combine", chunks)`` (the
            combine's copies in chunks, `combine_split`; the chunks depend on the call's SM count).
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
        max_tokens: the most tokens any rank dispatches in one call.
        hidden: hidden size (a multiple of 128).
        max_topk: the largest top-k (up to 16).
        timeout_s: the longest a kernel waits for a peer before recording a timeout.
        bulk: who moves the token rows, those of a dispatch that does not quantize and those a combine
            sends back: ``"sm"`` (the kernels store them into peers' buffers) or ``"copy_engine"`` (copy
            engines copy the rows of ``x`` sent to a peer into its receive area in one copy per peer, from token 0
            to the number of tokens sent there, and every row received from each source back into its combine
            area; the kernels move this rank's own rows, top-k, weights and source indices, sum, and wait, bounded,
            for the peers' copy-done flags). An FP8 dispatch that quantizes here (``quantize``) has its rows pushed
            by the kernel as it quantizes them, on the rows the copy-engine dispatches of the layout use.
            With ``"copy_engine"`` the first dispatch and the first combine of a
            layout read it on the host (a synchronization; later calls with that layout, ``cached``, can
            be captured in a CUDA graph; `plan` makes every plan at once). The copied rows of x include tokens
            not sent to that peer (holes): the kernel overwrites them with later tokens sent there once the copy
            has landed, so a source's rows are not all in token order (``recv_src_idx`` names each;
            `smsplit.ep.nvlink_plan.prefix_plan`); a peer whose copy would hold more than ``MAX_HOLE_SHARE`` holes
            gets its rows from the SMs, in token order. A combine's rows go back to each source as one block,
            copied in the chunks `default_combine_chunks` gives for the call's ``num_sms``, each with its own flag,
            and the sum starts on a chunk as soon as it has landed.

    Every call passes ``num_sms``: the persistent programs of its kernels (every rank the same count), at most the
    SMs the stream can reach; what depends on it (the grid, a combine's chunks) is derived per call.
    """

    returns_views = True  # received tensors live in the symmetric buffer: Buffer copies them out

    def __init__(self, group, device: torch.device, max_tokens: int, hidden: int, max_topk: int = 16,
                 timeout_s: float = 60.0, bulk: str = "sm"):
        if bulk not in BULK_MOVERS:
            raise ValueError(f"bulk must be one of {BULK_MOVERS}, got {bulk!r}")
        if hidden % SCALE_BLOCK:
            raise ValueError(f"hidden must be a multiple of {SCALE_BLOCK}, got {hidden}")
        if not 1 <= max_topk <= 16:
            raise ValueError(f"max_topk must be in 1..16, got {max_topk}")
        self.group = group
        self.rank, self.num_ranks = group.rank(), group.size()
        if self.num_ranks > 16:
            raise ValueError(f"the NVLink transport handles up to 16 ranks, the group has {self.num_ranks}")
        self.device = torch.device(device)
        self.max_tokens, self.hidden, self.max_topk = max_tokens, hidden, max_topk
        self.timeout_ns = int(timeout_s * 1e9)
        self.timeout_s = timeout_s
        self.offsets, total = region_offsets(region_bytes(self.num_ranks, max_tokens, hidden, max_topk), ALIGN)
        self.nbytes = total
        self.buffer, self.handle = symmetric_buffer(total, torch.uint8, group, self.device)
        self.buffer[: self.offsets["x"]].zero_()
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int32, device=self.device)
        self.status = torch.zeros(4, dtype=torch.int32, pin_memory=True)
        self._status_words = self.status.numpy()  # (the same memory: a read without torch's per-call work)
        self.base_addrs = list(self.handle.buffer_ptrs)
        self.ctx = torch.tensor(context_table(self.base_addrs, self.offsets, self.timeout_ns, self.status.data_ptr(),
                                              self.rank, self.state.data_ptr()), dtype=torch.int64, device=self.device)
        # this rank's combine area: bf16 rows, then (right after: the combine kernels derive them) fp32 weights
        if self.offsets["cw"] != self.offsets["cx"] + self.num_ranks * max_tokens * hidden * 2:
            raise AssertionError("the combine area's weights must follow its rows")
        self._cx = self.buffer[self.offsets["cx"]: self.offsets["cw"]].view(torch.bfloat16)
        self._views = {}  # `_view`'s views of self.buffer
        self.bulk = bulk
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
        return region_offsets(region_bytes(num_ranks, max_tokens, hidden, max_topk), ALIGN)[1]

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

    # -- host plans (bulk="copy_engine") ------------------------------------------------------------------

    def _dispatch_split(self, layout: NvlinkLayout, is_token_in_rank: torch.Tensor) -> DispatchSplit:
        """The copy-engine prefixes of a dispatch (`dispatch_split`), made once per layout from a host read of the
        layout and of ``is_token_in_rank``."""
        if "dispatch" not in layout.splits:
            send_start = layout.layout[: self.num_ranks].tolist()  # where this rank's rows start on each peer
            self.raise_if_failed()  # (after that synchronization) a failed count exchange leaves no layout
            in_rank = is_token_in_rank.cpu().numpy().astype(bool)
            layout.splits["dispatch"] = dispatch_split(self.rank, in_rank, send_start,
                                                       self.num_ranks * self.max_tokens, self.device)
        return layout.splits["dispatch"]

    def _combine_split(self, layout: NvlinkLayout, num_sms: int):
        """``(chunks, chunk_ends)`` of a combine with ``num_sms`` SMs (`combine_split` in the chunks of
        `default_combine_chunks`), made once per layout and chunking, after a host read of where each source's rows
        start."""
        fractions = default_combine_chunks(num_sms)
        key = ("combine", fractions)
        if key not in layout.splits:
            starts = layout.layout[self.num_ranks: 2 * self.num_ranks + 1].tolist()  # then the total
            self.raise_if_failed()
            layout.splits[key] = combine_split(self.rank, starts, fractions, self.device,
                                               call_words=(layout.num_recv_rows, *starts))
        return layout.splits[key]

    def plan(self, layout: NvlinkLayout, is_token_in_rank: torch.Tensor, *, num_sms: int) -> None:
        """With ``bulk="copy_engine"``: make every host plan of ``layout`` for calls with ``num_sms`` SMs (its
        dispatch's copies, its combine's chunks; host reads, a synchronization), so that dispatches with
        ``cached=layout`` and combines of its rows can then be captured in a CUDA graph."""
        num_sms = check_num_sms(num_sms)
        if self.bulk == "copy_engine":
            self._dispatch_split(layout, is_token_in_rank)
            self._combine_split(layout, num_sms)

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

    # -- dispatch / combine ---------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
                 topk_weights: torch.Tensor | None, is_token_in_rank: torch.Tensor, num_local_experts: int, *,
                 num_sms: int, quantize: bool = False, num_worst_tokens: int = 0,
                 cached: "NvlinkLayout | None" = None, num_recv_tokens: int | None = None, trace=None):
        """Send each token to the ranks in ``is_token_in_rank`` (see module docstring), with ``num_sms``
        persistent programs.

        Returns ``(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx, layout)``;
        recv_x is bf16 unless ``x`` is FP8 (then with its fp32 ``scales``, one per 128 values) or ``quantize``
        (then e4m3 with fp32 scales). Tensors not asked for are None. All received tensors are views into the buffer.
        ``cached``: the layout of an earlier dispatch with the same ``is_token_in_rank`` on every
        rank; skips the count exchange. ``num_recv_tokens``: the tokens this rank receives, when the caller knows
        them (`Buffer` does, from its header exchange): the call then does not wait for the count exchange's
        result (a read of it on the host), and a timeout there is raised by the next call.
        """
        self.raise_if_failed()
        num_sms = check_num_sms(num_sms)
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
        if quantize and fp8_in:
            raise ValueError("quantize: x is already FP8 (pass its scales instead)")
        if (scales is not None) != fp8_in and not quantize:
            raise ValueError("scales: an FP8 x comes with its fp32 scales (one per 128 values), any other x without")
        x_bytes = 1 if (fp8_in or quantize) else 2
        planned = self.bulk == "copy_engine"  # the layout's rows are planned on the host
        copies = planned and not quantize  # copy engines move rows; the kernels wait for their flags
        if planned and torch.cuda.is_current_stream_capturing() and (cached is None or "dispatch" not in cached.splits):
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
            launch_notify(1, counts, self.ctx, self.state, layout, self.rank, R, num_worst_tokens, RP=_pow2(R),
                          num_warps=1)
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
        if planned:  # (FP8 made here: pushed by the kernel, on the rows the copy-engine dispatches of this layout use)
            split = self._dispatch_split(plans, is_token_in_rank)
            pos = split.pos
        trace_view, tag = trace.slots(num_sms, "dispatch", "comm") if trace is not None else (None, 0)
        kp, rp, gate = _pow2(max(K, 1)), _pow2(R), cached is not None
        meta = (topk_idx, topk_weights, pos, layout, self.ctx, T, H, max(K, 1), R, num_local_experts,
                num_worst_tokens)
        consts = dict(GATE=gate, GROUPS=_pow2(H // SCALE_BLOCK), KP=kp, RP=rp, trace_ptr=trace_view, trace_tag=tag,
                      num_warps=NUM_WARPS)
        if quantize:  # (its state words and rank as parameters: `smsplit.ep.kernels.dispatch_fp8`)
            launch_dispatch_fp8(num_sms, x, *meta[:5], self.state, T, H, max(K, 1), self.rank, R, num_local_experts,
                                num_worst_tokens, **consts)
        else:
            args = (x.view(torch.uint8).view(torch.int32), scales, *meta[:5])
            if copies:  # the kernel moves this rank's own rows, the rest, and metadata beside the copies
                inputs_ready = torch.cuda.current_stream(self.device.index).record_event()
                launch_dispatch_copied(num_sms, *args, split.plan, *meta[5:], **consts)
                row_bytes = H * x_bytes
                copied = self._copy([([(self.base_addrs[peer] + self.offsets["x"] + row * row_bytes, x.data_ptr(),
                                        m * row_bytes) for peer, m, row in split.copies], 0, self._peers)], 0,
                                    after=inputs_ready)  # (every peer waits for this rank's flag)
                torch.cuda.current_stream(self.device.index).wait_event(copied)
            else:
                launch_dispatch(num_sms, *args, *meta[5:], **consts)
        result = dataclasses.replace(plans, sent_pos=pos)  # for this dispatch's combine (the plans are shared)
        n_groups = H // SCALE_BLOCK
        recv_x = self._view("x", torch.float8_e4m3fn if x_bytes == 1 else torch.bfloat16, (rows, H))
        recv_scales = self._view("scales", torch.float32, (rows, n_groups)) if x_bytes == 1 else None
        recv_topk = self._view("topk", torch.int64, (rows, K)) if topk_idx is not None else None
        recv_weights = self._view("weights", torch.float32, (rows, K)) if topk_weights is not None else None
        recv_src = self._view("src", torch.int32, (rows,))
        return recv_x, recv_scales, recv_topk, recv_weights, recv_src, result

    def combine(self, y: torch.Tensor, y_weights: torch.Tensor | None, layout: NvlinkLayout, *, num_sms: int,
                trace=None):
        """Send received row r of ``y`` (bf16 ``[num_recv_rows, hidden]``) back to its source and sum,
        per token, the rows that come back (fp32), with ``num_sms`` persistent programs. Returns ``(combined bf16
        [num_tokens, hidden], combined weights fp32 [num_tokens, K] or None)``; fresh tensors."""
        self.raise_if_failed()
        num_sms = check_num_sms(num_sms)
        R, T, H = self.num_ranks, layout.num_tokens, self.hidden
        if y.dtype != torch.bfloat16 or y.shape != (layout.num_recv_rows, H) or not y.is_contiguous():
            raise ValueError(f"x: expected a contiguous bf16 tensor of shape {(layout.num_recv_rows, H)}, "
                             f"got {y.dtype} {tuple(y.shape)}")
        check_combine_weights(y_weights, layout.num_recv_rows, self.max_topk)
        K = y_weights.size(1) if y_weights is not None else 1
        copies = self.bulk == "copy_engine"
        if copies and torch.cuda.is_current_stream_capturing() and (
                ("combine", default_combine_chunks(num_sms)) not in layout.splits):
            raise ValueError("bulk='copy_engine': a combine captured in a CUDA graph needs a layout that an earlier "
                             "combine with its SM count has used (its copies are planned on the host)")
        out = torch.empty(T, H, dtype=torch.bfloat16, device=self.device)
        out_w = torch.empty(T, K, dtype=torch.float32, device=self.device) if y_weights is not None else None
        if copies:
            chunks, split = self._combine_split(layout, num_sms)
            inputs_ready = torch.cuda.current_stream(self.device.index).record_event()
        trace_view, tag = trace.slots(num_sms, "combine", "comm") if trace is not None else (None, 0)
        y_words = y.view(torch.uint8).view(torch.int32)
        consts = dict(HB=_pow2(H), KP=_pow2(K), RP=_pow2(R), trace_ptr=trace_view, trace_tag=tag, num_warps=NUM_WARPS)
        if copies:
            launch_combine_copied(num_sms, y_words, y_weights, layout.sent_pos, self.ctx, self._cx, split, out, out_w,
                                  T, H, K, R, self.rank, self.max_tokens, CHUNKS=split.size(1), **consts)
        else:
            launch_combine(num_sms, y_words, y_weights, layout.layout, layout.sent_pos, self.ctx, self._cx, out, out_w,
                           T, H, K, R, self.rank, self.max_tokens, layout.num_recv_rows, **consts)
        if copies:  # queued after the kernel (which pushes the weights and sums as chunks land)
            row_bytes = H * 2
            copied = self._copy([([(self.base_addrs[source] + self.offsets["cx"]
                                    + (self.rank * self.max_tokens + slot) * row_bytes,
                                    y.data_ptr() + row * row_bytes, n * row_bytes) for source, row, n, slot in chunk],
                                  1 + c, sorted({source for source, *_ in chunk}) if c < len(chunks) - 1 else
                                  self._peers) for c, chunk in enumerate(chunks)], 1, after=inputs_ready)
            torch.cuda.current_stream(self.device.index).wait_event(copied)
        return out, out_w
