"""Invalid arguments raise a ValueError naming the argument on every rank, before any token moves, and the
buffer stays usable; a peer that never arrives raises EPTimeoutError naming it and the phase, within the timeout."""

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from smsplit.ep import Buffer, EPArgumentError, EPError, EPTimeoutError, compute_dispatch_layout
from smsplit.ep.buffer import DEVICE_BACKENDS
from smsplit.ep.reference import ReferenceTransport
from ep_harness import gloo_pool

NUM_EXPERTS, HIDDEN, TOPK = 8, 256, 3


def valid_call(rank, world_size, seed=0, num_tokens=4, hidden=HIDDEN):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    topk = torch.rand(num_tokens, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOPK]
    weights = torch.rand(num_tokens, TOPK, generator=g)
    num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank = compute_dispatch_layout(topk, NUM_EXPERTS,
                                                                                        world_size)
    return dict(x=x, topk_idx=topk, topk_weights=weights, num_tokens_per_rank=num_tokens_per_rank,
                num_tokens_per_expert=num_tokens_per_expert, is_token_in_rank=is_token_in_rank)


def expect_rejected(argument, call):
    try:
        call()
    except EPArgumentError as error:
        assert isinstance(error, ValueError)
        assert error.argument == argument, (argument, str(error))
        assert str(error).startswith(f"{argument}: "), str(error)
        return str(error)
    raise AssertionError(f"expected a ValueError naming {argument!r}")


def round_trip(buffer, rank, world_size, seed):
    args = valid_call(rank, world_size, seed)
    recv_x, _, _, _, handle, _ = buffer.dispatch(**args)
    combined, _, _ = buffer.combine(recv_x, handle)
    copies = args["is_token_in_rank"].sum(dim=1, keepdim=True)
    assert torch.equal(combined, (args["x"].float() * copies).to(torch.bfloat16))
    return handle


def case_argument_errors(rank, world_size):
    buffer = Buffer(dist.group.WORLD, timeout_s=10)
    other = Buffer(dist.group.WORLD, timeout_s=10)
    last = world_size - 1
    bad_here = rank == last  # most corruptions happen on one rank only; every rank must still raise

    def dispatch_with(everywhere=False, **changes):
        args = valid_call(rank, world_size)
        if bad_here or everywhere:
            args.update(changes)
        return lambda: buffer.dispatch(**args)

    scenarios = [
        ("x", dispatch_with(x=torch.zeros(4, HIDDEN, dtype=torch.int32))),
        ("x", dispatch_with(x=torch.zeros(4, HIDDEN, 1, dtype=torch.bfloat16))),
        ("x", dispatch_with(x=torch.zeros(4, HIDDEN, dtype=torch.bfloat16, device="meta"))),
        ("is_token_in_rank", dispatch_with(x=torch.zeros(5, HIDDEN, dtype=torch.bfloat16))),  # x has 5 rows
        ("x", dispatch_with(x=torch.zeros(4, 2 * HIDDEN, dtype=torch.bfloat16))),  # hidden differs across ranks
        ("topk_idx", dispatch_with(topk_idx=torch.full((4, TOPK), NUM_EXPERTS, dtype=torch.int64))),
        ("topk_idx", dispatch_with(topk_idx=torch.full((4, TOPK), -2, dtype=torch.int64))),
        ("topk_idx", dispatch_with(topk_idx=torch.zeros(4, TOPK, dtype=torch.int32))),
        ("topk_weights", dispatch_with(topk_weights=torch.zeros(4, TOPK + 1))),
        ("topk_weights", dispatch_with(topk_weights=torch.zeros(4, TOPK, dtype=torch.float64))),
        ("is_token_in_rank", dispatch_with(is_token_in_rank=torch.zeros(4, world_size + 1, dtype=torch.bool))),
        ("num_tokens_per_rank", dispatch_with(num_tokens_per_rank=torch.full((world_size,), 99, dtype=torch.int32))),
        ("num_tokens_per_rdma_rank", dispatch_with(num_tokens_per_rdma_rank=torch.zeros(1, dtype=torch.int32))),
        ("num_tokens_per_expert",  # experts not divisible by ranks, on every rank
         dispatch_with(num_tokens_per_expert=torch.zeros(2 * world_size + 1, dtype=torch.int32), everywhere=True)),
        ("num_worst_tokens", dispatch_with(num_worst_tokens=1)),  # rank `last` receives more than 1 token
        ("num_worst_tokens", dispatch_with(num_worst_tokens=-1)),
        ("num_worst_tokens", dispatch_with(num_worst_tokens=2**63)),  # (beyond the int64 header)
        ("num_worst_tokens", dispatch_with(num_worst_tokens=2**31)),  # (beyond int32 row indices)
        # no tokens on one rank, its expert counts stale: its (empty) topk_idx chooses no expert
        ("num_tokens_per_expert", dispatch_with(x=torch.zeros(0, HIDDEN, dtype=torch.bfloat16),
                                                topk_idx=torch.zeros(0, TOPK, dtype=torch.int64),
                                                topk_weights=torch.zeros(0, TOPK),
                                                is_token_in_rank=torch.zeros(0, world_size, dtype=torch.bool),
                                                num_tokens_per_rank=torch.zeros(world_size, dtype=torch.int32))),
        ("expert_alignment", dispatch_with(expert_alignment=0)),
        ("dequantize", dispatch_with(dequantize=True)),
        ("x", dispatch_with(fp8=True, x=torch.zeros(4, 200, dtype=torch.bfloat16))),
    ]
    messages = []
    for round_index, (argument, call) in enumerate(scenarios):
        messages.append(expect_rejected(argument, call))
        if round_index % 5 == 4:
            round_trip(buffer, rank, world_size, round_index)  # the ranks are still in step

    handle = round_trip(buffer, rank, world_size, 99)
    args = valid_call(rank, world_size, 99)
    foreign = round_trip(other, rank, world_size, 99)
    expect_rejected("handle", lambda: buffer.dispatch(args["x"], handle=foreign if bad_here else handle))
    expect_rejected("topk_idx", lambda: buffer.dispatch(args["x"], handle=handle, topk_idx=args["topk_idx"]))
    expect_rejected("handle", lambda: buffer.dispatch(args["x"][:3], handle=handle))
    rows = handle.num_recv_tokens
    expect_rejected("x", lambda: buffer.combine(torch.zeros(rows + bad_here, HIDDEN, dtype=torch.bfloat16), handle))
    expect_rejected("bias", lambda: buffer.combine(torch.zeros(rows, HIDDEN, dtype=torch.bfloat16), handle,
                                                   bias=torch.zeros(1, HIDDEN, dtype=torch.bfloat16)))
    expect_rejected("topk_weights", lambda: buffer.combine(torch.zeros(rows, HIDDEN, dtype=torch.bfloat16), handle,
                                                           topk_weights=torch.zeros(rows + 1, TOPK)))
    # a combine's top-k width differs between ranks: named after its topk_weights
    expect_rejected("topk_weights", lambda: buffer.combine(torch.zeros(rows, HIDDEN, dtype=torch.bfloat16), handle,
                                                           topk_weights=torch.zeros(rows, TOPK + 2 * bad_here)))
    without_topk = {k: v for k, v in args.items() if k not in ("topk_idx", "topk_weights")}
    if bad_here:  # no topk_idx: each count within [0, num_tokens]
        without_topk["num_tokens_per_expert"] = torch.full((NUM_EXPERTS,), 5, dtype=torch.int32)
    expect_rejected("num_tokens_per_expert", lambda: buffer.dispatch(**without_topk))
    round_trip(buffer, rank, world_size, 5)

    # Local checks of get_dispatch_layout (no communication).
    expect_rejected("previous_event", lambda: buffer.get_dispatch_layout(args["topk_idx"], NUM_EXPERTS,
                                                                         previous_event="not an event"))
    from_numpy_int = buffer.get_dispatch_layout(args["topk_idx"], np.int64(NUM_EXPERTS))  # an int, as in DeepEP
    from_int = buffer.get_dispatch_layout(args["topk_idx"], NUM_EXPERTS)
    assert all(torch.equal(from_numpy_int[i], from_int[i]) for i in (0, 2, 3))
    # numpy ints reach the handle (and with it the device kernels' launches, which take Python ints) as ints
    worst = 4 * world_size
    plain = buffer.dispatch(**args, num_worst_tokens=worst, expert_alignment=2)
    numpy = buffer.dispatch(**args, num_worst_tokens=np.int64(worst), expert_alignment=np.int64(2))
    assert type(numpy[4].num_worst_tokens) is int and torch.equal(numpy[0], plain[0]) and numpy[3] == plain[3]
    hint = Buffer.get_buffer_size_hint(np.int64(4), np.int64(HIDDEN), world_size, TOPK)
    assert type(hint) is int and hint == Buffer.get_buffer_size_hint(4, HIDDEN, world_size, TOPK)
    expect_rejected("num_experts", lambda: buffer.get_dispatch_layout(args["topk_idx"], 2 * world_size + 1))
    expect_rejected("topk_idx", lambda: buffer.get_dispatch_layout(args["topk_idx"] + NUM_EXPERTS, NUM_EXPERTS))

    # A buffer too small for the worst case; the hint is exactly enough.
    hint = Buffer.get_buffer_size_hint(4, HIDDEN, world_size, TOPK)
    small = Buffer(dist.group.WORLD, num_nvl_bytes=hint - 16)
    message = expect_rejected("num_nvl_bytes", lambda: small.dispatch(**valid_call(rank, world_size)))
    exact = Buffer(dist.group.WORLD, num_nvl_bytes=hint)
    round_trip(exact, rank, world_size, 7)
    expect_rejected("num_nvl_bytes", lambda: Buffer(dist.group.WORLD, num_nvl_bytes=hint + rank))
    return messages + [message]


def case_peer_never_arrives(rank, world_size, timeout_s, backend="gloo"):
    """The last rank never calls dispatch: the others raise EPTimeoutError naming it and the phase, and the buffer
    is unusable after it. ``backend``: "gloo" (CPU tensors), or "nccl" (CUDA tensors: the reference backend polls
    NCCL's work against the deadline)."""
    group = dist.new_group(backend=backend)  # its connections break on timeout; the pool's group stays intact
    buffer = Buffer(group, timeout_s=timeout_s)
    absent = world_size - 1
    if rank == absent:
        return None
    args = {k: v.to(buffer.device) for k, v in valid_call(rank, world_size).items()}
    start = time.monotonic()
    with pytest.raises(EPTimeoutError) as caught:
        buffer.dispatch(**args)
    elapsed = time.monotonic() - start
    assert caught.value.peer == absent
    assert f"dispatch: waiting for counts from rank {absent}" in str(caught.value)
    assert caught.value.phase == f"dispatch: waiting for counts from rank {absent}"
    with pytest.raises(EPError, match="unusable"):
        buffer.dispatch(**args)
    return elapsed


def case_ranks_out_of_step(rank, world_size):
    group = dist.new_group(backend="gloo")
    buffer = Buffer(group, timeout_s=10)
    handle = round_trip(buffer, rank, world_size, 3)
    args = valid_call(rank, world_size, 3)
    with pytest.raises(EPError) as caught:
        if rank == 0:
            buffer.dispatch(**args)
        else:
            buffer.combine(torch.zeros(handle.num_recv_tokens, HIDDEN, dtype=torch.bfloat16), handle)
    assert "rank 1 is in combine" in str(caught.value) or "rank 0 is in dispatch" in str(caught.value)


def case_through_the_group(rank, world_size, case, *args):
    """`case` with the headers exchanged through the gloo group instead of host shared memory."""
    ReferenceTransport.host_headers_allowed = False
    try:
        return case(rank, world_size, *args)
    finally:
        ReferenceTransport.host_headers_allowed = True


def case_device_backend_checks(rank, world_size):
    """The checks only the device backends make, raised on every rank before any kernel: a hidden size that is not
    a multiple of 128, a receive buffer smaller than their layout needs, more than 16 top-k columns. Run on a gloo
    group: a reference buffer whose `backend` is set to a device backend's after construction (the checks read the
    backend name and the sizes only; no device transport is made before they pass)."""
    messages = []
    for backend in DEVICE_BACKENDS:
        need = Buffer.get_buffer_size_hint(4, HIDDEN, world_size, TOPK, backend=backend)
        buffer = Buffer(dist.group.WORLD, num_nvl_bytes=need, timeout_s=10)
        buffer.backend = backend
        messages.append(expect_rejected("x", lambda: buffer.dispatch(**valid_call(rank, world_size, hidden=200))))
        small = Buffer(dist.group.WORLD, num_nvl_bytes=need - 16, timeout_s=10)
        small.backend = backend
        messages.append(expect_rejected("num_nvl_bytes", lambda: small.dispatch(**valid_call(rank, world_size))))
        wide = valid_call(rank, world_size)
        extra = torch.full((wide["x"].size(0), 17 - TOPK), -1, dtype=torch.int64)
        wide["topk_idx"] = torch.cat([wide["topk_idx"], extra], dim=1)
        wide["topk_weights"] = torch.cat([wide["topk_weights"], torch.zeros(extra.shape)], dim=1)
        messages.append(expect_rejected("topk_idx", lambda: buffer.dispatch(**wide)))
    return messages


def run_case(world_size, headers, case, *args):
    if headers == "group":
        return gloo_pool(world_size).run(case_through_the_group, case, *args)
    return gloo_pool(world_size).run(case, *args)


HEADER_PATHS = [(2, "shared_memory"), (4, "shared_memory"), (2, "group")]


@pytest.mark.parametrize("world_size,headers", HEADER_PATHS)
def test_invalid_arguments_rejected_on_every_rank(world_size, headers):
    messages = run_case(world_size, headers, case_argument_errors)
    last = world_size - 1
    # The rank with the bad argument explains it; the others name the rank.
    assert "int32" in messages[last][0] and f"rejected on rank {last}" in messages[0][0]
    assert "[-1, 8)" in messages[last][5]
    assert "get_buffer_size_hint" in messages[0][-1]


@pytest.mark.parametrize("world_size,headers", HEADER_PATHS)
def test_missing_peer_raises_timeout_naming_rank_and_phase(world_size, headers):
    elapsed = run_case(world_size, headers, case_peer_never_arrives, 1.5)
    waited = [e for e in elapsed if e is not None]
    assert len(waited) == world_size - 1
    assert all(1.4 <= e < 6.0 for e in waited), waited


@pytest.mark.parametrize("headers", ["shared_memory", "group"])
def test_ranks_calling_different_operations_raise(headers):
    run_case(2, headers, case_ranks_out_of_step)


def test_local_argument_errors_need_no_group():
    with pytest.raises(ValueError, match="backend"):
        Buffer(None, backend="nvlink-someday")
    for bad in (0, -1.0, float("nan"), float("inf"), 366 * 24 * 3600.0, True, "60"):
        with pytest.raises(ValueError, match="timeout_s"):
            Buffer(None, timeout_s=bad)
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        Buffer(None, num_nvl_bytes=-1)
    for argument, bad in (("backend", dict(backend="nvlnk")), ("num_max_tokens_per_rank", dict(num_max_tokens_per_rank=-4)),
                          ("hidden", dict(hidden=0)), ("num_ranks", dict(num_ranks=2.0)), ("num_topk", dict(num_topk=-1))):
        kwargs = dict(num_max_tokens_per_rank=4, hidden=HIDDEN, num_ranks=2, num_topk=TOPK, backend="nvlink")
        kwargs.update(bad)
        with pytest.raises(EPArgumentError) as caught:
            Buffer.get_buffer_size_hint(**kwargs)
        assert caught.value.argument == argument


def case_handles_of_different_calls(rank, world_size):
    """Two dispatches with layouts of the same counts; then each rank passes the handle of another call."""
    buffer = Buffer(dist.group.WORLD, timeout_s=10)
    first = buffer.dispatch(**valid_call(rank, world_size, seed=1))
    second = buffer.dispatch(**valid_call(rank, world_size, seed=2))
    mine = first if rank == 0 else second
    x = valid_call(rank, world_size, seed=3)["x"]
    messages = [expect_rejected("handle", lambda: buffer.dispatch(x, handle=mine[4])),
                expect_rejected("handle", lambda: buffer.combine(mine[0], mine[4]))]
    round_trip(buffer, rank, world_size, seed=4)  # still usable, and so are the handles passed consistently
    combined, _, _ = buffer.combine(first[0], first[4])
    args = valid_call(rank, world_size, seed=1)
    assert torch.equal(combined, (args["x"].float() * args["is_token_in_rank"].sum(1, keepdim=True)).to(torch.bfloat16))
    return messages


def test_handles_of_different_dispatch_calls_are_rejected_on_every_rank():
    messages = gloo_pool(2).run(case_handles_of_different_calls)
    assert all("the dispatch call that made the handle (call numbers) differs between ranks" in m
               for per_rank in messages for m in per_rank), messages


def case_bias_of_a_wrong_type(rank, world_size):
    buffer = Buffer(dist.group.WORLD, timeout_s=10)
    recv_x, _, _, _, handle, _ = buffer.dispatch(**valid_call(rank, world_size))
    start = time.monotonic()
    try:
        buffer.combine(recv_x, handle, bias=5 if rank == 1 else None)
    except EPArgumentError as error:
        return error.argument, str(error), time.monotonic() - start
    return None


def test_a_bias_of_a_wrong_type_on_one_rank_is_rejected_on_every_rank_at_once():
    results = gloo_pool(2).run(case_bias_of_a_wrong_type)
    assert all(r is not None and r[0] == "bias" and r[2] < 5.0 for r in results), results
    assert "got int" in results[1][1] and "rejected on rank 1" in results[0][1]


def case_layout_of_other_routing(rank, world_size):
    """A layout computed for one routing, passed with the top-k ids of another: every rank refuses it."""
    buffer = Buffer(dist.group.WORLD, timeout_s=10)
    args = valid_call(rank, world_size)
    stale = valid_call(rank, world_size, seed=9)
    results = []
    for name in ("is_token_in_rank", "num_tokens_per_expert"):
        bad = dict(args)
        if rank == world_size - 1:
            if name == "is_token_in_rank":  # both layout tensors of the other routing: the ranks differ
                bad.update(is_token_in_rank=stale["is_token_in_rank"], num_tokens_per_rank=stale["num_tokens_per_rank"])
            else:  # the ranks agree, the expert counts do not
                bad["num_tokens_per_expert"] = args["num_tokens_per_expert"].flip(0)
        results.append(expect_rejected(name, lambda: buffer.dispatch(**bad)))
    round_trip(buffer, rank, world_size, seed=5)
    return results


def case_repeated_expert_ids(rank, world_size):
    """A token that names one expert twice counts once for it in get_dispatch_layout's layout, which the
    dispatch's check of the layout against topk_idx must accept."""
    buffer = Buffer(dist.group.WORLD, timeout_s=10)
    x = torch.randn(3, HIDDEN).to(torch.bfloat16)
    topk = torch.tensor([[0, 0, 5], [4, 4, 4], [1, 6, -1]])
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, NUM_EXPERTS)
    recv_x, _, _, counts, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert, topk_idx=topk)
    combined, _, _ = buffer.combine(recv_x, handle)
    assert torch.equal(combined, (x.float() * in_rank.sum(1, keepdim=True)).to(torch.bfloat16))
    return counts


def test_a_token_naming_an_expert_twice_is_dispatched():
    counts = gloo_pool(2).run(case_repeated_expert_ids)
    assert counts[0][0] == 2 and counts[1][0] == 2  # expert 0 (tokens 0 of both ranks), expert 4 (token 1)


def test_a_layout_that_is_not_the_top_k_ids_is_rejected_on_every_rank():
    results = gloo_pool(2).run(case_layout_of_other_routing)
    assert "does not match topk_idx" in results[1][0] and "rejected on rank 1" in results[0][0]
    assert "does not match topk_idx" in results[1][1] and "rejected on rank 1" in results[0][1]


def case_constructor_error_on_one_rank(rank, world_size, argument):
    bad = {"num_sms": dict(num_sms=0), "backend": dict(backend="nvlink"), "num_rdma_bytes": dict(num_rdma_bytes=-1),
           "ranks_per_node": dict(ranks_per_node=0),
           "num_nvl_bytes": dict(num_nvl_bytes="big"), "timeout_s": dict(timeout_s=-1.0),
           "num_nvl_bytes too big": dict(num_nvl_bytes=2**64)}[argument]  # (beyond the int64 header)
    start = time.monotonic()
    try:
        Buffer(dist.group.WORLD, **{"timeout_s": 10, **(bad if rank == world_size - 1 else {})})
    except EPArgumentError as error:
        return error.argument, str(error), time.monotonic() - start
    return None


@pytest.mark.parametrize("argument", ["num_sms", "backend", "num_rdma_bytes", "num_nvl_bytes", "timeout_s",
                                      "num_nvl_bytes too big", "ranks_per_node"])
def test_a_constructor_argument_rejected_on_one_rank_is_raised_on_every_rank_at_once(argument):
    results = gloo_pool(2).run(case_constructor_error_on_one_rank, argument)
    name = argument.split()[0]
    assert all(r is not None and r[0] == name and r[2] < 5.0 for r in results), results
    assert "rejected on rank 1" in results[0][1] and results[1][1].startswith(f"{name}: ")


def test_a_device_combine_rejects_weights_its_slots_cannot_hold():
    """The device transports' combine writes the weights into slots of max_topk columns on the peers: a wider,
    shorter, non-float32 or strided tensor is a ValueError naming topk_weights before any kernel (a 17-column one
    would have been written past the peer's buffer)."""
    from smsplit.ep.transport import check_combine_weights

    check_combine_weights(None, 5, 16)
    check_combine_weights(torch.rand(5, 16), 5, 16)
    check_combine_weights(torch.rand(0, 3), 0, 16)
    bad = {"wider": torch.rand(5, 17), "over this transport's max": torch.rand(5, 10),
           "fewer rows": torch.rand(4, 8), "bf16": torch.rand(5, 8).bfloat16(), "1-D": torch.rand(5),
           "no columns": torch.rand(5, 0), "strided": torch.rand(8, 5).t()}
    for what, weights in bad.items():
        with pytest.raises(ValueError, match="topk_weights") as error:
            check_combine_weights(weights, 5, 9)
        assert "float32 [5, k] with 1 <= k <= 9" in str(error.value) or what == "strided", what


@pytest.mark.parametrize("world_size", [2, 4])
def test_device_backend_checks_are_raised_on_every_rank_before_any_kernel(world_size):
    for messages in gloo_pool(world_size).run(case_device_backend_checks):
        for i, backend in enumerate(DEVICE_BACKENDS):
            hidden, size, topk = messages[3 * i: 3 * i + 3]
            assert f"the {backend} backend needs a hidden size that is a multiple of 128, got 200" in hidden
            assert "need" in size and f"backend={backend!r}" in size
            assert f"the {backend} backend moves up to 16 top-k columns, got 17" in topk


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("headers", ["shared_memory", "group"])
def test_missing_peer_on_nccl_raises_timeout_naming_rank_and_phase(headers):
    from ep_harness import ProcessPool

    pool = ProcessPool(2, "nccl")  # its own processes: the abandoned NCCL work stays there
    try:
        if headers == "group":
            elapsed = pool.run(case_through_the_group, case_peer_never_arrives, 1.5, "nccl", timeout_s=60)
        else:
            elapsed = pool.run(case_peer_never_arrives, 1.5, "nccl", timeout_s=60)
    finally:
        pool.close(graceful=False)
    assert elapsed[1] is None and 1.4 <= elapsed[0] < 6.0, elapsed
