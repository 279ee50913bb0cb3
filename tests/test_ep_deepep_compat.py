"""Code written for DeepEP's `deep_ep.Buffer` (intranode, normal kernels) runs on `smsplit.ep.Buffer` after an
import change: its constructor (DeepEP's README's positional call and every keyword), positional calls in DeepEP's argument order (with `config`), the static
`Buffer.capture()`, tuple-style handles, `destroy()`, and the SM count through `Buffer.set_num_sms`, `Config` and
`get_dispatch_config` / `get_combine_config`. Checked on 2 gloo ranks against the sums a dispatch and a combine must
give."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

import oracles
from smsplit.ep import Buffer, Config, EPArgumentError, EPError, EventOverlap
from ep_harness import gloo_pool
from smsplit.ep.utils import EventHandle  # where DeepEP code imports it from (deep_ep.utils)

NUM_EXPERTS, HIDDEN, TOPK, TOKENS = 8, 256, 3, 6


def deepep_style_calls(rank, world_size):
    g = torch.Generator().manual_seed(31 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    topk_idx = torch.rand(TOKENS, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOPK]
    topk_idx[0, 1] = -1  # a dropped selection
    topk_weights = torch.rand(TOKENS, TOPK, generator=g)

    # as DeepEP's README builds its buffer: sizes from the configs' hints, then Buffer(group, nvl, rdma) by position
    num_nvl_bytes, num_rdma_bytes = 0, 0
    hidden_bytes = HIDDEN * max(x.element_size(), 2)
    for config in (Buffer.get_dispatch_config(world_size), Buffer.get_combine_config(world_size)):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, world_size), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, world_size), num_rdma_bytes)
    buffer = Buffer(dist.group.WORLD, num_nvl_bytes, num_rdma_bytes)
    assert buffer.num_rdma_bytes == 0 and buffer.num_nvl_bytes == 0 and buffer.num_sms == Buffer.num_sms
    # every DeepEP constructor argument, its first seven by position
    Buffer(dist.group.WORLD, 0, 0, False, 24, True, False, use_fabric=False, explicitly_destroy=True,
           enable_shrink=False, comm=None)
    previous = EventOverlap(EventHandle())  # DeepEP's way to make a call wait for the current stream's work
    assert isinstance(Buffer.capture(), EventOverlap) and isinstance(buffer.capture(), EventOverlap)
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event = \
        buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS, previous_event=previous, async_finish=True,
                                   allocate_on_comm_stream=False)
    # DeepEP's positional order: ..., expert_alignment, num_worst_tokens, config, previous_event, async_finish
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = buffer.dispatch(
        x, None, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
        topk_weights, 1, 0, None, event, True)
    event.current_stream_wait()
    keyword = buffer.dispatch(x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                              num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
                              topk_weights=topk_weights, config=object())
    assert torch.equal(recv_x, keyword[0]) and torch.equal(recv_topk_idx, keyword[1])
    assert torch.equal(recv_topk_weights, keyword[2]) and counts == keyword[3]

    # the handle read as DeepEP's tuple
    assert len(handle) == 6
    rank_prefix_matrix, channel_prefix, recv_channel_prefix, recv_src_idx, in_rank, send_head = handle
    assert rank_prefix_matrix is handle.rank_prefix_matrix and handle[0] is handle.rank_prefix_matrix
    assert recv_src_idx is handle.recv_src_idx and in_rank is handle.is_token_in_rank
    assert channel_prefix is None and recv_channel_prefix is None and send_head is None
    with pytest.raises(IndexError):
        handle[6]
    sources = rank_prefix_matrix[:, rank]
    assert int(sources[-1]) == recv_x.size(0)

    # combine, positional in DeepEP's order: x, handle, topk_weights, bias, config, previous_event, async_finish
    combined, combined_weights, event = buffer.combine(recv_x, handle, recv_topk_weights, None, None, Buffer.capture(),
                                                       True)
    event.current_stream_wait()
    copies = is_token_in_rank.sum(dim=1, keepdim=True)
    assert torch.equal(combined, (x.float() * copies).to(torch.bfloat16))
    expected_weights = torch.where(topk_idx >= 0, topk_weights, torch.zeros_like(topk_weights))
    assert torch.allclose(combined_weights, expected_weights, rtol=0, atol=1e-6)
    cached = buffer.dispatch(x, handle, config=None)[0]
    assert torch.equal(cached, recv_x)
    # a combine's backward as DeepEP's README writes it: a cached dispatch after an event, on the comm stream
    grad, _, _, _, _, event = buffer.dispatch(x * 2, handle=handle, async_finish=True, previous_event=event,
                                              allocate_on_comm_stream=True)
    event.current_stream_wait()
    assert torch.equal(grad, recv_x * 2)
    (grad_fp8, grad_scales), *_ = buffer.dispatch(oracles.quantize_1x128(x), handle=handle)  # DeepEP's FP8 tuple
    ref_fp8, ref_scales = oracles.quantize_1x128(recv_x)  # (tests/oracles.py: no smsplit code)
    assert torch.equal(grad_fp8.view(torch.uint8), ref_fp8.view(torch.uint8)) and torch.equal(grad_scales, ref_scales)
    (fp8_x, fp8_scales), *_ = buffer.dispatch(x, handle=handle, fp8=True)  # quantized by the buffer
    assert torch.equal(fp8_x.view(torch.uint8), ref_fp8.view(torch.uint8)) and torch.equal(fp8_scales, ref_scales)
    assert torch.equal(buffer.combine(recv_x, handle, config=None)[0], combined)

    buffer.destroy()
    for call in (lambda: buffer.dispatch(x, handle), lambda: buffer.combine(recv_x, handle),
                 lambda: buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)):
        with pytest.raises(EPError, match=f"rank {rank}: this Buffer was destroyed"):
            call()
    return int(sources[-1])


def previous_event_first(rank, world_size):
    """Each call waits for `previous_event` before it reads its inputs on the host (they may come from the stream
    the event was recorded on)."""
    order = []

    class Recording(EventOverlap):
        def current_stream_wait(self):
            order.append("wait")

    buffer = Buffer(dist.group.WORLD, timeout_s=30)
    for name in ("_check_topk_idx", "_check_dispatch", "_check_combine"):
        check = getattr(buffer, name)
        setattr(buffer, name, lambda *args, _check=check, _name=name, **kwargs: (order.append(_name),
                                                                                  _check(*args, **kwargs))[1])
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    topk_idx = torch.rand(TOKENS, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOPK]
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS, previous_event=Recording())
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                 previous_event=Recording())
    buffer.combine(recv_x, handle, previous_event=Recording())
    # (the dispatch's checks include the top-k check)
    assert order == ["wait", "_check_topk_idx", "wait", "_check_dispatch", "_check_topk_idx",
                     "wait", "_check_combine"], order


def test_calls_wait_for_previous_event_before_reading_inputs():
    gloo_pool(2).run(previous_event_first)


@pytest.mark.parametrize("world_size", [2, 4])
def test_deepep_style_code_runs_after_an_import_change(world_size):
    received = gloo_pool(world_size).run(deepep_style_calls)
    assert all(n > 0 for n in received)


def test_deepep_only_paths_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="num_rdma_bytes: must be 0"):
        Buffer(None, num_rdma_bytes=1 << 20)
    with pytest.raises(ValueError, match="low_latency_mode: must be False"):
        Buffer(None, low_latency_mode=True)
    with pytest.raises(ValueError, match="num_rdma_bytes: must be 0"):
        Buffer(None, 0, 16)  # the third positional argument is DeepEP's num_rdma_bytes, not num_sms
    with pytest.raises(ValueError, match="low_latency_mode: must be False"):
        Buffer(None, 0, 0, True)
    with pytest.raises(TypeError):
        Buffer(None, 0, 0, False, 24, True, False, False)  # past DeepEP's first seven, keywords only
    with pytest.raises(TypeError):
        Buffer(None, 0, 0, False, 24, True, False, 20)  # smsplit's own too (num_sms)


def round_trip_with(buffer, rank, config):
    """A dispatch and a combine with `config=config`: the combine gives each token times the ranks it went to."""
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    topk_idx = torch.rand(TOKENS, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOPK]
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=topk_idx, config=config)
    combined, _, _ = buffer.combine(recv_x, handle, config=config)
    copies = in_rank.sum(dim=1, keepdim=True)
    assert torch.equal(combined, (x.float() * copies).to(torch.bfloat16))


def set_num_sms_and_configs(rank, world_size):
    """DeepEP's static SM API: `Buffer.set_num_sms` changes the SM count of buffers made without one (their later
    calls too), `get_dispatch_config` / `get_combine_config` make `Config`s with it, and a call's `config.num_sms`
    must agree between ranks."""
    before = Buffer.num_sms
    try:
        default = Buffer(dist.group.WORLD, 0, timeout_s=30)
        fixed = Buffer(dist.group.WORLD, 0, num_sms=16, timeout_s=30)
        budgeted = Buffer(dist.group.WORLD, 0, budget=SimpleNamespace(comm_sms=8), timeout_s=30)
        assert (Buffer.num_sms, default.num_sms, fixed.num_sms, budgeted.num_sms) == (20, 20, 16, 8)
        Buffer.set_num_sms(24)
        assert (Buffer.num_sms, default.num_sms, fixed.num_sms, budgeted.num_sms) == (24, 24, 16, 8)
        dispatch_config, combine_config = Buffer.get_dispatch_config(world_size), Buffer.get_combine_config(world_size)
        assert isinstance(dispatch_config, Config) and (dispatch_config.num_sms, combine_config.num_sms) == (24, 24)
        # DeepEP's size hints from a config: 0 (no ring buffers; 0 bytes runs the reference backend)
        assert dispatch_config.get_nvl_buffer_size_hint(HIDDEN * 2, world_size) == 0
        assert dispatch_config.get_rdma_buffer_size_hint(HIDDEN * 2, world_size) == 0
        nvl_bytes = max(dispatch_config.get_nvl_buffer_size_hint(HIDDEN * 2, world_size), 0)
        round_trip_with(Buffer(dist.group.WORLD, nvl_bytes, timeout_s=30), rank, dispatch_config)
        round_trip_with(default, rank, Config(8, 6, 256, 6, 128))  # DeepEP's positional Config
        round_trip_with(default, rank, object())  # a config without num_sms: the buffer's count
        # invalid counts, refused where they are made
        for bad in (0, -2, "24", True, 2.0, 2 ** 70):
            with pytest.raises(EPArgumentError, match=r"num_sms: expected an int in \[1, 65536\]"):
                Buffer.set_num_sms(bad)
            with pytest.raises(EPArgumentError, match=r"num_sms: expected an int in \[1, 65536\]"):
                Config(bad)
        assert Buffer.num_sms == 24
        assert Config().num_sms == 20 and Config(np.int64(12)).num_sms == 12  # DeepEP's default; numpy ints
        round_trip_with(default, rank, Config(np.int32(10)))
        errors = []
        # a count over the budget's comm SMs, on one rank: refused on every rank before anything moves
        config = Config(16) if rank == world_size - 1 else None
        try:
            round_trip_with(budgeted, rank, config)
        except EPArgumentError as error:
            errors.append((error.argument, str(error)))
        # ranks that give different counts
        try:
            round_trip_with(default, rank, Config(20 + 2 * rank))
        except EPArgumentError as error:
            errors.append((error.argument, str(error)))
        # not an int, and one too large for the header (raised on its rank, then on every rank)
        for bad in ("many", 2 ** 70):
            try:
                round_trip_with(default, rank, SimpleNamespace(num_sms=bad) if rank == 0 else None)
            except EPArgumentError as error:
                errors.append((error.argument, str(error)))
        # a call captured in a CUDA graph exchanges nothing: it must run on the count of the eager calls before it
        # (here a stand-in for the transport those calls used)
        eager = SimpleNamespace(num_sms=24)
        assert default._captured_sms(None, eager) == 24 and default._captured_sms(Config(24), eager) == 24
        with pytest.raises(EPArgumentError, match=r"config: a call captured in a CUDA graph runs on the SM count of "
                                                  r"the eager calls before it \(24\); this one asks 16"):
            default._captured_sms(Config(16), eager)
        round_trip_with(default, rank, None)  # the buffers stay usable
        round_trip_with(budgeted, rank, Config(4))
        return errors
    finally:
        Buffer.num_sms = before


def test_set_num_sms_and_configs_as_deepep():
    results = gloo_pool(2).run(set_num_sms_and_configs)
    for rank, errors in enumerate(results):
        assert [argument for argument, _ in errors] == ["config"] * 4, errors
        over_budget, differ, not_int, too_large = (message for _, message in errors)
        assert ("exceeds the budget's 8 comm SMs" in over_budget) == (rank == 1), over_budget
        assert ("rejected on rank 1" in over_budget) == (rank == 0), over_budget
        assert "the SM count (config.num_sms, or Buffer.set_num_sms) differs between ranks: [20, 22]" in differ
        assert ("must be an int in [1, 65536], got 'many'" in not_int) == (rank == 0), not_int
        assert (f"got {2 ** 70}" in too_large) == (rank == 0) and ("rejected on rank 0" in too_large) == (rank == 1)
