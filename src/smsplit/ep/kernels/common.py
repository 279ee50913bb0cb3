"""What the NVLink kernels share: the state and signal words, the context table, bounded waits and signals.

Each rank's `NvlinkTransport` keeps a context table (int64, `CTX_WORDS`): the addresses of every rank's symmetric
buffer in ``[0, MAX_RANKS)``, then the transport's constants (`CTX_TIMEOUT` ...): the region offsets of the buffer,
the timeout, the pinned status words, this rank and its state words. A kernel takes the table as one pointer and
loads what it uses, so that its signature holds what varies per call (and the few constants its hot loop reads: a
kernel parameter stays in the constant bank, where a loaded value holds a register through the loop).
"""

import triton
import triton.language as tl

from smsplit import ptx

MAX_RANKS = 16
# context table words (int64) after the MAX_RANKS buffer addresses
CTX_TIMEOUT = tl.constexpr(16)  # ns a wait may take
CTX_STATUS = tl.constexpr(17)  # address of the pinned status words (phase, peer, seen, expected)
CTX_SIG = tl.constexpr(18)  # region offsets in every rank's buffer: signal slots
CTX_COUNTS = tl.constexpr(19)  # count matrix
CTX_X = tl.constexpr(20)  # receive area: rows, scales, top-k, weights, source index
CTX_SCALES = tl.constexpr(21)
CTX_TOPK = tl.constexpr(22)
CTX_WEIGHTS = tl.constexpr(23)
CTX_SRC = tl.constexpr(24)
CTX_COPIED = tl.constexpr(25)  # copy-done flags (dispatch: word [s]; combine chunk c: word (1 + c) * R + s)
CTX_CX = tl.constexpr(26)  # combine area: rows, weights
CTX_CW = tl.constexpr(27)
CTX_CHUNK_ENDS = tl.constexpr(28)  # where each source's combine chunks end (bulk="copy_engine")
CTX_RANK = tl.constexpr(29)  # this rank
CTX_STATE = tl.constexpr(30)  # address of this rank's local state words (int32, `STATE_WORDS`)
CTX_WORDS = 31

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
# slot STARTED_SLOT word [s] the dispatches rank s has started (its program 0 adds 1 on every rank),
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
SIGNAL_SLOTS = 8

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


@triton.jit
def status_of(ctx_ptr):
    """The pinned status words (int32 pointer) the table names."""
    return tl.load(ctx_ptr + CTX_STATUS).to(tl.pointer_type(tl.int32))


@triton.jit
def state_of(ctx_ptr):
    """This rank's local state words (int32 pointer) the table names."""
    return tl.load(ctx_ptr + CTX_STATE).to(tl.pointer_type(tl.int32))


@triton.jit
def rank_of(ctx_ptr):
    """This rank (int32), from the table."""
    return tl.load(ctx_ptr + CTX_RANK).to(tl.int32)


@triton.jit
def slot_of(ctx_ptr, sig, d, slot):
    """Signal slot ``slot`` of rank d's buffer (``sig``: the slots' offset, `CTX_SIG`), as int32 pointer (its words
    are per source rank)."""
    return (tl.load(ctx_ptr + d) + sig + slot * 64).to(tl.pointer_type(tl.int32))


@triton.jit
def wait_for_one(flag_ptr, target, peer, timeout_ns, status_ptr, fail_ptr, phase):
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
def wait_for_ranks(flags_ptr, first, stride, R, rank, skip_self, target, timeout_ns, status_ptr, fail_ptr, phase):
    """Wait until ``flags_ptr[first + s * stride] >= target`` for every rank s < R (but ``rank`` when
    ``skip_self``), each wait bounded (`wait_for_one`); the program waits at a barrier."""
    for s in range(R):
        if (skip_self == 0) | (s != rank):
            wait_for_one(flags_ptr + first + s * stride, target, s, timeout_ns, status_ptr, fail_ptr, phase)
    tl.debug_barrier()


@triton.jit
def failed_before(state_ptr):
    """Whether a wait of an earlier kernel of this rank timed out (its FAIL_WORD, stable while this kernel runs:
    the earlier kernels on the stream have ended). Such a kernel moves nothing and signals no peer: a kernel that
    skipped its waits but still signalled would put the peers' counters, and the copy streams' FREE words, out of
    step with their own calls (a reset stream's wait for a word, which the copy stream waits for, has no bound), see
    `smsplit.ep.Buffer`."""
    return tl.load(state_ptr + FAIL_WORD, volatile=True) != 0


@triton.jit
def free_copy_stream(words, R):
    """Set this rank's R words at ``words`` (its FREE_SLOT or X_FREE_SLOT, one per peer) to 1 on an error path: its
    reset stream waits for them unbounded (cuStreamWaitValue32), and its copy stream for that, so a kernel that gives
    up frees both, never a hang."""
    for d in range(R):
        ptx.st_release_sys(words + d, 1)


@triton.jit
def signal_all(ctx_ptr, sig, slot, rank, R):
    """Release-add 1 to word ``rank`` of signal slot ``slot`` of every rank (thread 0), after this program's
    stores."""
    tl.debug_barrier()
    ptx.fence_acq_rel_sys()
    for d in range(R):
        ptx.atom_add_release_sys(slot_of(ctx_ptr, sig, d, slot) + rank, 1)


@triton.jit
def finish(state_ptr, phase, expected, per_source, programs, copies_seen, copies_word):
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
def column(block, cols, d):
    """Column ``d`` of a ``[rows, RP]`` block (``cols`` = arange(RP)) as a ``[rows]`` block."""
    return tl.sum(tl.where(cols[None, :] == d, block, 0), axis=1)


@triton.jit
def pick(values, cols, d):
    """Element ``d`` of a ``[RP]`` block."""
    return tl.sum(tl.where(cols == d, values, 0), axis=0)


@triton.jit
def local_experts(topk, d, num_local_experts):
    """Top-k ids as rank ``d``'s local expert ids, -1 where the expert is elsewhere (or the choice dropped)."""
    local = topk - d * num_local_experts
    return tl.where((topk >= 0) & (local >= 0) & (local < num_local_experts), local, -1)
