"""Code written for DeepEP's `deep_ep.Buffer` (intranode, normal kernels) runs on `smsplit.ep.Buffer` after an
import change: its constructor keywords, positional calls in DeepEP's argument order (with `config`), the static
`Buffer.capture()`, tuple-style handles and `destroy()`. Checked on 2 gloo ranks against the sums a dispatch and a
combine must give."""

import pytest
import torch
import torch.distributed as dist

from smsplit.ep import Buffer, EPError, EventOverlap
from smsplit.ep.testing import gloo_pool

NUM_EXPERTS, HIDDEN, TOPK, TOKENS = 8, 256, 3, 6


def deepep_style_calls(rank, world_size):
    g = torch.Generator().manual_seed(31 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    topk_idx = torch.rand(TOKENS, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOPK]
    topk_idx[0, 1] = -1  # a dropped selection
    topk_weights = torch.rand(TOKENS, TOPK, generator=g)

    # as DeepEP's README builds its buffer (the RDMA size by keyword: the third positional argument is num_sms)
    buffer = Buffer(dist.group.WORLD, 0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                    allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=True, comm=None)
    assert buffer.num_rdma_bytes == 0 and buffer.num_nvl_bytes == 0
    previous = Buffer.capture()
    assert isinstance(previous, EventOverlap) and isinstance(buffer.capture(), EventOverlap)
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


def test_deepep_style_code_runs_after_an_import_change():
    received = gloo_pool(2).run(deepep_style_calls)
    assert all(n > 0 for n in received)


def test_deepep_only_paths_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="num_rdma_bytes: must be 0"):
        Buffer(None, num_rdma_bytes=1 << 20)
    with pytest.raises(ValueError, match="low_latency_mode: must be False"):
        Buffer(None, low_latency_mode=True)
    with pytest.raises(TypeError):
        Buffer(None, 0, 20, None, "auto", 60.0, 0)  # DeepEP's keywords are keyword-only here
