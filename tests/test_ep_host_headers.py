"""The header exchange through host shared memory (`smsplit.ep.host_headers`), checked against what each peer
sent (every rank can rebuild any rank's rows from its seed) and against the exchange through the gloo group; its
fallback when a rank cannot map the file; a missing peer and ranks out of step."""

import glob
import os
import time

import pytest
import torch
import torch.distributed as dist

from smsplit.ep import EPError, EPTimeoutError
from smsplit.ep import host_headers
from smsplit.ep.reference import ReferenceTransport
from ep_harness import gloo_pool


def rows_sent(sender, world_size, round_index, width):
    g = torch.Generator().manual_seed(1000 * round_index + sender)
    return torch.randint(-2**62, 2**62, (world_size, width), generator=g, dtype=torch.int64)


def new_transport(timeout_s=10.0):
    return ReferenceTransport(dist.new_group(backend="gloo"), torch.device("cpu"), timeout_s)


def case_rows_arrive(rank, world_size):
    transport = new_transport()
    widths = [1, 5, 3, 200, 7] * 6  # alternating slots, each reused with another width
    for i, width in enumerate(widths):
        got = transport.exchange_headers("test", "rows", rows_sent(rank, world_size, i, width))
        expected = torch.stack([rows_sent(q, world_size, i, width)[rank] for q in range(world_size)])
        assert torch.equal(got, expected), i
        if i % 7 == 0:  # the group's own exchange of the same rows gives the same result
            again = transport._group_headers("test", "rows", rows_sent(rank, world_size, i, width))
            assert torch.equal(again, expected), i
    assert isinstance(transport._host_headers, host_headers.HostHeaders)
    wide = host_headers.MAX_WORDS // world_size + 1  # too wide for a slot: through the group
    got = transport.exchange_headers("test", "wide rows", rows_sent(rank, world_size, 99, wide))
    assert torch.equal(got, torch.stack([rows_sent(q, world_size, 99, wide)[rank] for q in range(world_size)]))
    dist.barrier()
    return os.getpid()


def case_switched_off_or_unmappable(rank, world_size, how):
    if how == "switched_off":
        ReferenceTransport.host_headers_allowed = False
    elif how == "unmappable" and rank == world_size - 1:
        host_headers.SHM_DIR = "/nonexistent-smsplit"  # this rank cannot open rank 0's file
    elif how == "uncreatable" and rank == 0:
        host_headers.SHM_DIR = "/nonexistent-smsplit"  # rank 0 cannot create the file
    try:
        transport = new_transport()
        for i in range(4):
            got = transport.exchange_headers("test", "rows", rows_sent(rank, world_size, i, 3))
            assert torch.equal(got, torch.stack([rows_sent(q, world_size, i, 3)[rank] for q in range(world_size)]))
        assert transport._host_headers is False
        dist.barrier()
        return os.getpid()
    finally:
        ReferenceTransport.host_headers_allowed = True
        host_headers.SHM_DIR = "/dev/shm"


def case_peer_never_arrives(rank, world_size):
    transport = new_transport(timeout_s=1.0)
    transport.exchange_headers("init", "rows", rows_sent(rank, world_size, 0, 2))
    absent = world_size - 1
    if rank == absent:
        return None
    start = time.monotonic()
    with pytest.raises(EPTimeoutError) as caught:
        transport.exchange_headers("dispatch", "counts", rows_sent(rank, world_size, 1, 2))
    elapsed = time.monotonic() - start
    assert caught.value.peer == absent and caught.value.phase == f"dispatch: waiting for counts from rank {absent}"
    with pytest.raises(EPError, match="unusable"):
        transport.exchange_headers("dispatch", "counts", rows_sent(rank, world_size, 2, 2))
    return elapsed


def case_peer_arrives_late(rank, world_size):
    """Rank 1 comes to a call after rank 0 gave up waiting: it raises too, naming rank 0, instead of reading
    rank 0's rows of the abandoned call and going on."""
    transport = new_transport(timeout_s=1.0)
    transport.exchange_headers("init", "rows", rows_sent(rank, world_size, 0, 2))
    if rank == 1:
        time.sleep(2.0)
    with pytest.raises(EPTimeoutError) as caught:
        transport.exchange_headers("combine", "status", rows_sent(rank, world_size, 1, 2))
    return caught.value.peer, str(caught.value)


def case_out_of_step(rank, world_size):
    transport = new_transport()
    transport.exchange_headers("init", "rows", rows_sent(rank, world_size, 0, 2))
    width = 3 if rank == 0 else 4
    with pytest.raises(EPError, match="rank (0|1) sent (6|8) words of counts") as caught:
        transport.exchange_headers("dispatch", "counts", rows_sent(rank, world_size, 1, width))
    assert "same Buffer calls in the same order" in str(caught.value)
    with pytest.raises(EPError, match="unusable"):
        transport.exchange_headers("dispatch", "counts", rows_sent(rank, world_size, 2, width))


@pytest.mark.parametrize("world_size", [2, 4])
def test_rows_arrive_through_shared_memory_and_leave_no_file(world_size):
    pids = gloo_pool(world_size).run(case_rows_arrive)
    assert not glob.glob(os.path.join("/dev/shm", f"smsplit-ep-{pids[0]}-*"))


@pytest.mark.parametrize("how", ["switched_off", "unmappable", "uncreatable"])
def test_falls_back_to_the_group(how):
    pids = gloo_pool(2).run(case_switched_off_or_unmappable, how)
    assert not glob.glob(os.path.join("/dev/shm", f"smsplit-ep-{pids[0]}-*"))


@pytest.mark.parametrize("world_size", [2, 4])
def test_missing_peer_raises_timeout_naming_it(world_size):
    elapsed = gloo_pool(world_size).run(case_peer_never_arrives)
    waited = [e for e in elapsed if e is not None]
    assert len(waited) == world_size - 1 and all(0.95 <= e < 3.0 for e in waited), waited


def test_ranks_sending_different_sizes_raise():
    gloo_pool(2).run(case_out_of_step)


def test_a_peer_that_arrives_after_the_timeout_raises_too():
    (peer0, message0), (peer1, message1) = gloo_pool(2).run(case_peer_arrives_late)
    assert peer0 == 1 and "waiting for status from rank 1" in message0
    assert peer1 == 0 and "rank 0 timed out waiting for this rank (rank 1)" in message1
