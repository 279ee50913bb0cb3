"""A peer lost while tokens move (the reference backend on gloo, the one that runs on a CPU; the device backends'
lost peers are tests/test_ep_nvlink.py's, on GPUs), and buffers on subgroups whose group ranks are not the global
ranks.

- A peer whose process exits in the dispatch's or the combine's token exchange: every other rank raises `EPError`
  naming it (its rank in the group) and the phase within a few seconds (`EXIT_NOTICED_S`), long before `timeout_s`.
- A peer that hangs there: every other rank raises `EPTimeoutError` naming it and the phase at `timeout_s`, give or
  take `MARGIN_S` (the scheduling of a loaded 2-core CI machine).
- A peer whose process exits between the dispatch and the combine: the others wait for it in the combine's header
  exchange, which goes through host shared memory (`smsplit.ep.host_headers`), where they watch each peer's process
  (its pid and start time): `EPAbortError` naming it within a few seconds, long before `timeout_s`.

A peer that never arrives at the header exchange: tests/test_ep_errors.py.
"""

import os
import queue
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from oracles import new_group_in_order
from smsplit.ep import Buffer, EPAbortError, EPError, EPTimeoutError
from ep_harness import context, gloo_pool
from smsplit.launch import free_port

NUM_EXPERTS, HIDDEN, TOPK, TOKENS = 12, 256, 3, 5
EXIT_NOTICED_S = 5.0  # a peer's exit is seen this soon (its connections close)
MARGIN_S = 3.0  # a hung peer is reported within [timeout_s, timeout_s + MARGIN_S]
PHASES = ["dispatch", "combine"]  # (their token exchanges)


def routing(rank, group_size, seed=0):
    """x, topk_idx, topk_weights of one rank: every token goes to an expert of every rank (so every rank waits for
    tokens from every peer, in the dispatch and in the combine), the rest of its top-k at random."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    local = NUM_EXPERTS // group_size
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    topk = torch.randint(0, NUM_EXPERTS, (TOKENS, max(TOPK, group_size)), generator=g)
    topk[:, :group_size] = torch.arange(group_size) * local + torch.randint(0, local, (TOKENS, group_size),
                                                                             generator=g)
    return x, topk, torch.rand(topk.shape, generator=g)


def lose_peer(buffer, phase, how, hang_s=0.0):
    """Make this rank's `buffer` lose itself in `phase`'s token exchange (``"combine_headers"``: at the start of the
    combine, before its headers): its process exits there (``how="exit"``) or it sleeps `hang_s` there and then
    raises `Hung`."""
    def lost(*args, **kwargs):
        if how == "exit":
            os._exit(3)
        time.sleep(hang_s)
        raise Hung

    if phase == "combine_headers":
        buffer.combine = lost
    else:
        setattr(buffer.transport, phase, lost)


class Hung(Exception):
    pass


def lost_peer_call(buffer, group_rank, group_size, phase, lost):
    """Dispatch, then combine, on `buffer`; the rank `lost` loses itself in `phase`'s token exchange (see
    `lose_peer`). Returns (the exception the call of `phase` raised here: type name, message, peer; its seconds),
    or None for `lost`. The buffer must refuse any later call."""
    x, topk, w = routing(group_rank, group_size)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, NUM_EXPERTS)
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk, topk_weights=w)
    start = time.monotonic()
    try:
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, **args)
        assert phase != "dispatch", "the dispatch did not notice the lost peer"
        start = time.monotonic()
        buffer.combine(recv_x, handle, topk_weights=recv_w)
    except Hung:
        return None
    except (EPError, EPTimeoutError) as error:
        outcome = type(error).__name__, str(error), getattr(error, "peer", None), time.monotonic() - start
        assert not isinstance(error, EPAbortError) or "ended" in error.error
        with pytest.raises(EPError, match="unusable after an earlier failure"):
            buffer.dispatch(x, **args)
        return outcome
    raise AssertionError(f"rank {group_rank}: the {phase} did not notice the lost peer")


# -- a peer whose process exits: processes of their own (the lost one takes its connections with it) --------------

def _exit_rank(rank, world_size, port, results, phase, lost, timeout_s):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        buffer = Buffer(dist.group.WORLD, timeout_s=timeout_s)
        if rank == lost:
            lose_peer(buffer, phase, "exit")
        results.put((rank, True, lost_peer_call(buffer, rank, world_size, phase, lost)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    results.close()
    results.join_thread()  # (the queue's thread has written the result)
    os._exit(0)  # no teardown: the group has lost a member


def run_with_exiting_peer(world_size, phase, lost, timeout_s, limit_s=90.0):
    """`_exit_rank` on `world_size` processes (from `ep_harness.context()`); the results of every rank but `lost`, by
    rank."""
    ctx = context()
    results = ctx.Queue()
    port = free_port()
    processes = [ctx.Process(target=_exit_rank, daemon=True,
                                 args=(r, world_size, port, results, phase, lost, timeout_s))
                 for r in range(world_size)]
    for p in processes:
        p.start()
    outcomes, deadline = {}, time.monotonic() + limit_s
    try:
        while len(outcomes) < world_size - 1:
            try:
                rank, ok, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - {lost} - set(outcomes))} did not "
                                     f"return within {limit_s} s") from None
            assert ok, f"rank {rank}:\n{value}"
            outcomes[rank] = value
    finally:
        for p in processes:
            p.join(timeout=0.5)
            if p.is_alive():
                p.kill()
                p.join()
    assert processes[lost].exitcode == 3
    return outcomes


@pytest.mark.parametrize("phase", PHASES)
def test_a_peer_that_exits_in_the_token_exchange_is_named_within_seconds(phase):
    outcomes = run_with_exiting_peer(3, phase, lost=1, timeout_s=60.0)
    assert sorted(outcomes) == [0, 2]
    for rank, (kind, message, _, elapsed) in outcomes.items():
        assert kind == "EPError", (rank, message)
        assert message.startswith(f"{phase}: waiting for tokens from rank 1 failed"), (rank, message)
        assert elapsed < EXIT_NOTICED_S, (rank, elapsed, message)


def test_a_peer_that_exits_before_the_combine_is_named_within_seconds():
    outcomes = run_with_exiting_peer(3, "combine_headers", lost=1, timeout_s=60.0)
    assert sorted(outcomes) == [0, 2]
    for rank, (kind, message, peer, elapsed) in outcomes.items():
        assert kind == "EPAbortError" and peer == 1, (rank, message)
        assert message.startswith("combine: waiting for status: rank 1 failed") and "ended" in message, message
        assert elapsed < EXIT_NOTICED_S, (rank, elapsed, message)


# -- a peer that hangs: the pool's processes, a group of their own that the timeouts break ---------------------------

def case_hung_peer(rank, world_size, members, phase, lost, timeout_s):
    """A buffer on the group of global ranks `members` (group rank i is global rank members[i], where this torch can
    order a group so); group rank `lost` hangs in `phase`'s token exchange (it sends nothing) until after the others
    gave up. Returns (the group's global ranks in group-rank order, `lost_peer_call`'s outcome or None)."""
    group, members = new_group_in_order(members)
    if rank not in members:
        return members, None
    buffer = Buffer(group, timeout_s=timeout_s)
    group_rank = members.index(rank)
    assert (buffer.rank, buffer.group_size) == (group_rank, len(members))
    if group_rank == lost:
        lose_peer(buffer, phase, "hang", hang_s=timeout_s + 1.0)
    return members, lost_peer_call(buffer, group_rank, len(members), phase, lost)


@pytest.mark.parametrize("phase", PHASES)
def test_a_peer_that_hangs_in_the_token_exchange_is_named_at_timeout_s(phase):
    timeout_s, lost = 2.0, 1
    # (the pool's own limit: a wait that ignores timeout_s is caught in seconds, not at gloo's 30 minutes)
    results = gloo_pool(4).run(case_hung_peer, [3, 0, 2], phase, lost, timeout_s, timeout_s=timeout_s + 30)
    members = results[0][0]  # [3, 0, 2]: group rank 1 (the hung one) is global rank 0
    assert results[1][1] is None and results[members[lost]][1] is None  # global 1 is no member
    for rank in set(members) - {members[lost]}:
        kind, message, peer, elapsed = results[rank][1]
        assert kind == "EPTimeoutError" and peer == lost, (rank, message)
        assert message.startswith(f"{phase}: waiting for tokens from rank {lost} (no answer within timeout_s=2)"), \
            (rank, message)
        assert timeout_s <= elapsed <= timeout_s + MARGIN_S, (rank, elapsed)
