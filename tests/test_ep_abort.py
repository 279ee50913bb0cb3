"""A rank whose `Buffer` call fails on that rank alone (before it reaches the exchange the others wait in) aborts the
buffer: the peers raise `EPAbortError` (an `EPError`) naming that rank and its error at once, not `EPTimeoutError`
at `timeout_s`; every rank's buffer refuses later calls. Errors that every rank raises together (argument errors
agreed through the header exchange: tests/test_ep_errors.py) leave the buffer usable.

On gloo (CPU), with the headers through host shared memory and through the group. A peer whose process ends between
two calls: tests/test_ep_lost_peers.py.
"""

import mmap
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from smsplit.ep import Buffer, EPAbortError, EPError, EventOverlap, compute_dispatch_layout
from smsplit.ep import host_headers
from smsplit.ep.reference import ReferenceTransport
from ep_harness import gloo_pool

NUM_EXPERTS, HIDDEN, TOPK = 12, 128, 3
TIMEOUT_S = 60.0  # far above NOTICED_S: a wait that ignores the abort fails the test
NOTICED_S = 5.0  # the peers raise within this (a loaded 2-core machine's scheduling included)
LATE_S = 0.5  # the failing rank fails this long after the others started waiting


class BrokenEvent(EventOverlap):
    """An event whose wait fails: an error that escapes a call before its header exchange."""

    def current_stream_wait(self) -> None:
        raise RuntimeError("the event's stream is gone")


def inputs(rank, world_size, seed=0):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(4, HIDDEN, generator=g).to(torch.bfloat16)
    topk = torch.rand(4, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOPK]
    per_rank, per_expert, in_rank = compute_dispatch_layout(topk, NUM_EXPERTS, world_size)
    return dict(x=x, topk_idx=topk, num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert,
                is_token_in_rank=in_rank)


FAILURES = {  # where: (what rank 0 does, what the others do meanwhile, what rank 0's error says)
    "get_dispatch_layout": ("topk_idx out of range in get_dispatch_layout", "dispatch", "expert ids must lie in"),
    "dispatch": ("an event whose wait fails in dispatch", "dispatch", "the event's stream is gone"),
    "combine": ("an event whose wait fails in combine", "combine", "the event's stream is gone"),
    "destroyed": ("a dispatch on a destroyed buffer", "dispatch", "this Buffer was destroyed"),
}


def case_rank_fails_alone(rank, world_size, where, headers):
    """Rank 0 fails in `where` (see FAILURES) while the others wait for it; returns rank 0's error message, or on
    the others (type name, message, peer, error, seconds)."""
    if headers == "group":
        ReferenceTransport.host_headers_allowed = False
    try:
        group = dist.new_group(backend="gloo")  # its connections may break; the pool's group stays intact
        buffer = Buffer(group, timeout_s=TIMEOUT_S)
    finally:
        ReferenceTransport.host_headers_allowed = True
    args = inputs(rank, world_size)
    recv_x, _, _, _, handle, _ = buffer.dispatch(**args)  # one call that works: the ranks are in step
    if rank == 0:
        time.sleep(LATE_S)
        with pytest.raises(Exception) as caught:
            if where == "get_dispatch_layout":
                buffer.get_dispatch_layout(args["topk_idx"] + NUM_EXPERTS, NUM_EXPERTS)
            elif where == "dispatch":
                buffer.dispatch(**args, previous_event=BrokenEvent())
            elif where == "combine":
                buffer.combine(recv_x, handle, previous_event=BrokenEvent())
            else:
                buffer.destroy()
                buffer.dispatch(**args)
        outcome = str(caught.value)
    else:
        start = time.monotonic()
        with pytest.raises(EPError) as caught:
            if FAILURES[where][1] == "combine":
                buffer.combine(recv_x, handle)
            else:
                buffer.dispatch(**args)
        error = caught.value
        outcome = (type(error).__name__, str(error), getattr(error, "peer", None), getattr(error, "error", None),
                   time.monotonic() - start)
    if where != "destroyed":  # every rank's buffer refuses later calls, naming the failure
        with pytest.raises(EPError, match="unusable after an earlier failure"):
            buffer.dispatch(**args)
        with pytest.raises(EPError, match="unusable after an earlier failure"):
            buffer.get_dispatch_layout(args["topk_idx"], NUM_EXPERTS)
    return outcome


@pytest.mark.parametrize("where,headers", [("get_dispatch_layout", "shared_memory"), ("get_dispatch_layout", "group"),
                                           ("dispatch", "shared_memory"), ("combine", "shared_memory"),
                                           ("combine", "group"), ("destroyed", "shared_memory")])
def test_a_rank_that_fails_alone_is_named_by_the_others_at_once(where, headers):
    world_size = 3
    results = gloo_pool(world_size).run(case_rank_fails_alone, where, headers, timeout_s=TIMEOUT_S + 30)
    expected = FAILURES[where][2]
    assert expected in results[0], results[0]
    call = "dispatch" if where == "destroyed" else where
    for rank in range(1, world_size):
        kind, message, peer, error, elapsed = results[rank]
        assert kind == "EPAbortError" and peer == 0, (rank, message)
        assert error.startswith(f"{call}: ") and expected in error, (rank, error)
        assert "rank 0 failed" in message and expected in message, (rank, message)
        assert elapsed < LATE_S + NOTICED_S, (rank, elapsed, message)


def case_errors_every_rank_raises_keep_the_buffer(rank, world_size):
    """An argument error on one rank that the header exchange makes every rank raise, then a plain-argument error
    of get_dispatch_layout on every rank: no abort, the buffer still works (and quickly: nothing waits)."""
    buffer = Buffer(dist.group.WORLD, timeout_s=TIMEOUT_S)
    args = inputs(rank, world_size)
    bad = dict(args, x=torch.zeros(4, HIDDEN, dtype=torch.int32)) if rank == 1 else args
    with pytest.raises(ValueError, match="^x: "):
        buffer.dispatch(**bad)
    with pytest.raises(ValueError, match="^num_experts: "):
        buffer.get_dispatch_layout(args["topk_idx"], NUM_EXPERTS + 1)
    recv_x, _, _, _, handle, _ = buffer.dispatch(**args)
    combined, _, _ = buffer.combine(recv_x, handle)
    assert torch.equal(combined, (args["x"].float() * args["is_token_in_rank"].sum(1, keepdim=True)).to(torch.bfloat16))


def test_errors_every_rank_raises_do_not_abort():
    gloo_pool(2).run(case_errors_every_rank_raises_keep_the_buffer)


# -- the abort entries and process watch of the shared file, on one process --------------------------------------

def test_abort_entries_keep_the_first_error_and_its_cause():
    mapping = mmap.mmap(-1, host_headers.HostHeaders.file_bytes(3))
    ranks = [host_headers.HostHeaders(r, 3, mapping) for r in range(3)]
    assert all(ranks[0].failure(q) is None for q in range(3))
    long = "é" * 2000  # longer than an entry holds: cut, still valid text
    ranks[2].abort(5, 2, long)
    ranks[2].abort(9, 1, "a later failure")  # the first is kept
    code, cause, message = ranks[0].failure(2)
    assert (code, cause) == (5, 2) and long.startswith(message.rstrip("\ufffd")) and len(message.encode()) <= 1024
    ranks[1].abort(3, 0, "dispatch: RuntimeError: boom")
    assert ranks[2].failure(1) == (3, 0, "dispatch: RuntimeError: boom") and ranks[1].failure(0) is None


def test_an_ended_process_is_seen_and_a_live_one_is_not():
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    ended_pid = int(done.stdout)
    mine = (os.getpid(), host_headers.process_start(os.getpid()))
    assert mine[1] is not None and host_headers.process_start(ended_pid) is None
    mapping = mmap.mmap(-1, host_headers.HostHeaders.file_bytes(3))
    # rank 1: this process; rank 2: the ended one (its start time as it was: any value, the pid is gone)
    watcher = host_headers.HostHeaders(0, 3, mapping, [None, mine, (ended_pid, mine[1])])
    assert watcher.ended(1) is None and watcher.ended(2) == ended_pid
    reused = host_headers.HostHeaders(0, 3, mapping, [None, (mine[0], mine[1] + 1), None])  # same pid, other start
    assert reused.ended(1) == mine[0] and reused.ended(2) is None
