"""Code written for DeepEP's `deep_ep.Buffer` (intranode, normal kernels) runs on `smsplit.ep.Buffer` after an
import change: its constructor (DeepEP's README's positional call and every keyword), positional calls in DeepEP's argument order (with `config`), the static
`Buffer.capture()`, tuple-style handles (read, and rebuilt by the caller), `destroy()`, the SM count through
`Buffer.set_num_sms`, `Config` and `get_dispatch_config` / `get_combine_config`, `topk_idx_t`,
`Buffer.is_sm90_compiled()`, `get_comm_stream()`, and `recv_src_idx` padded to `num_worst_tokens` rows. Checked on 2
gloo ranks against the sums a dispatch and a combine must give and the rows a dispatch must deliver."""

import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import oracles
from smsplit import ptx
from smsplit.ep import Buffer, Config, EPArgumentError, EPError, EventOverlap, topk_idx_t
from ep_harness import gloo_pool, process_pool
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

    from smsplit.ep import checks

    buffer = Buffer(dist.group.WORLD, timeout_s=30)
    originals = {name: getattr(checks, name) for name in ("check_topk_idx", "check_dispatch", "check_combine")}
    for name, check in originals.items():  # (the argument checks of every call live in smsplit.ep.checks)
        setattr(checks, name, lambda *args, _check=check, _name=name, **kwargs: (order.append(_name),
                                                                                  _check(*args, **kwargs))[1])
    try:
        calls(buffer, rank, Recording)
    finally:
        for name, check in originals.items():
            setattr(checks, name, check)
    # (the dispatch's checks include the top-k check)
    assert order == ["wait", "check_topk_idx", "wait", "check_dispatch", "check_topk_idx",
                     "wait", "check_combine"], order


def calls(buffer, rank, Recording):
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    topk_idx = torch.rand(TOKENS, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOPK]
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS, previous_event=Recording())
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                 previous_event=Recording())
    buffer.combine(recv_x, handle, previous_event=Recording())


def test_calls_wait_for_previous_event_before_reading_inputs():
    gloo_pool(2).run(previous_event_first)


@pytest.mark.parametrize("world_size", [2, 4])
def test_deepep_style_code_runs_after_an_import_change(world_size):
    received = gloo_pool(world_size).run(deepep_style_calls)
    assert all(n > 0 for n in received)


def test_deepep_only_paths_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="num_rdma_bytes: expected an int >= 0"):
        Buffer(None, num_rdma_bytes=-1)
    with pytest.raises(ValueError, match="low_latency_mode: must be False"):
        Buffer(None, low_latency_mode=True)
    with pytest.raises(ValueError, match="num_rdma_bytes: expected an int >= 0"):
        Buffer(None, 0, 16.0)  # the third positional argument is DeepEP's num_rdma_bytes, not num_sms
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
        # (here the checks of `smsplit.ep.checks` that such a call makes, with 24 SMs in the eager calls before it)
        from smsplit.ep import checks

        def captured(config):
            sms, _ = checks.call_sms(config, default.num_sms, False)
            checks.captured_sms(sms, 24)
            return sms

        assert captured(None) == 24 and captured(Config(24)) == 24
        with pytest.raises(EPArgumentError, match=r"config: a call captured in a CUDA graph runs on the SM count of "
                                                  r"the eager calls before it \(24\); this one asks 16"):
            captured(Config(16))
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


# -- topk_idx_t, is_sm90_compiled, get_comm_stream, rebuilt tuple handles, recv_src_idx with num_worst_tokens ---------

def routed_inputs(rank, seed):
    """Rank ``rank``'s tokens, top-k ids and weights; any rank can make any rank's (the oracle below does). The ids
    are made as int32 and cast as DeepEP code casts them, ``topk_idx.to(deep_ep.topk_idx_t)``."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    topk_idx = torch.rand(TOKENS, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOPK].to(torch.int32)
    topk_idx[torch.rand(TOKENS, TOPK, generator=g) < 0.25] = -1
    topk_idx[rank % TOKENS] = -1  # a token that goes nowhere
    return x, topk_idx.to(topk_idx_t), torch.rand(TOKENS, TOPK, generator=g)


def expected_recv_src_idx(rank, world_size, seed):
    """The source-token index of each row rank ``rank`` receives: the rows from rank 0 first, then rank 1's, ...,
    each source's in token order; a token goes to a rank once if any of its experts is there. Walked over the
    inputs of every rank, without the library's layout code."""
    per_rank = NUM_EXPERTS // world_size
    rows = []
    for source in range(world_size):
        _, topk_idx, _ = routed_inputs(source, seed)
        rows += [t for t, ids in enumerate(topk_idx.tolist()) if any(e >= 0 and e // per_rank == rank for e in ids)]
    return rows


def tuple_handles_and_padding(rank, world_size, seed):
    """DeepEP callers rebuild the handle tuple (``tuple(handle)``, ``list(handle)``, or unpack it and pack the six
    fields again, even after dropping the handle): `combine`, a cached dispatch and autograd take it as the handle.
    A tuple that is not one of this buffer's handles is refused on every rank. With `num_worst_tokens`,
    `recv_src_idx` has `num_worst_tokens` entries, as DeepEP's, the padding -1; a cached dispatch with that handle
    gives as many rows (DeepEP's gives `recv_src_idx.size(0)`). Also: `topk_idx_t` ids go in, other dtypes are
    refused; a CPU buffer's `get_comm_stream()`."""
    buffer = Buffer(dist.group.WORLD, timeout_s=30)
    other = Buffer(dist.group.WORLD, timeout_s=30)
    x, topk_idx, topk_weights = routed_inputs(rank, seed)
    assert topk_idx_t is torch.int64 and topk_idx.dtype == topk_idx_t
    with pytest.raises(EPArgumentError, match="topk_idx: expected dtype torch.int64, got torch.int32"):
        buffer.get_dispatch_layout(topk_idx.to(torch.int32), NUM_EXPERTS)
    assert isinstance(buffer.get_comm_stream(), torch.cpu.Stream)  # gloo: CPU tensors, no CUDA stream
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, topk_weights=topk_weights)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, **layout)
    expected_src = expected_recv_src_idx(rank, world_size, seed)
    n = len(expected_src)
    assert handle.recv_src_idx.tolist() == expected_src and recv_x.size(0) == n
    expected_x = (x.float() * in_rank.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    expected_w = torch.where(topk_idx >= 0, topk_weights, torch.zeros_like(topk_weights))

    def check_combine(rows, handle_arg):
        combined, combined_w, _ = buffer.combine(rows, handle_arg, topk_weights=recv_w)
        assert torch.equal(combined, expected_x)
        assert torch.allclose(combined_w, expected_w, rtol=0, atol=1e-6)

    for rebuilt in (tuple(handle), list(handle)):
        check_combine(recv_x, rebuilt)
    # DeepEP's tests and users unpack the handle into its six fields; here the handle object is then dropped
    rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, \
        send_head = handle
    alive = weakref.ref(handle)
    del handle, rebuilt
    gc.collect()
    assert alive() is None
    rebuilt = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
               is_token_in_rank, send_head)
    check_combine(recv_x, rebuilt)
    cached, _, _, per_expert_list, cached_handle, _ = buffer.dispatch(x, rebuilt)
    assert torch.equal(cached, recv_x) and per_expert_list is None
    assert all(a is b for a, b in zip(cached_handle, rebuilt))
    y = recv_x.float().requires_grad_()  # the backward of a combine: a cached dispatch of the gradient
    combined, _, _ = buffer.combine(y, rebuilt)
    assert torch.equal(combined, expected_x.float())
    (combined * torch.arange(1.0, HIDDEN + 1)).sum().backward()
    assert torch.equal(y.grad, torch.arange(1.0, HIDDEN + 1).expand(n, HIDDEN))

    # tuples that are not a handle of this buffer: rejected on every rank, before anything moves
    _, _, _, _, foreign, _ = other.dispatch(x, **layout)
    bad = {"a copy": lambda: (rank_prefix_matrix, None, None, recv_src_idx.clone(), is_token_in_rank, None),
           "five fields": lambda: rebuilt[:5],
           "another order": lambda: (rank_prefix_matrix, None, None, recv_src_idx, None, is_token_in_rank),
           "another buffer's": lambda: tuple(foreign)}
    errors = {}
    for name, make in bad.items():
        try:
            buffer.combine(recv_x, make() if rank == 0 else rebuilt)
        except EPArgumentError as error:
            errors[name] = (error.argument, str(error))
    check_combine(recv_x, rebuilt)  # still usable

    # num_worst_tokens: recv_src_idx padded as DeepEP pads it
    worst = TOKENS * world_size + 3
    padded_x, _, padded_w, per_expert_list, padded, _ = buffer.dispatch(x, num_worst_tokens=worst, **layout)
    assert per_expert_list == [] and padded_x.size(0) == worst and padded.num_recv_tokens == n
    assert padded.recv_src_idx.dtype == torch.int32 and padded.recv_src_idx.shape == (worst,)
    assert padded.recv_src_idx.tolist() == expected_src + [-1] * (worst - n)
    assert padded[3] is padded.recv_src_idx
    again = buffer.dispatch(x, tuple(padded))[0]  # cached: recv_src_idx.size(0) rows, as DeepEP's
    assert again.size(0) == worst and torch.equal(again[:n], recv_x) and not again[n:].any()
    garbage = padded_x.clone()
    garbage[n:] = 1e4  # the combine reads no padding row
    combined, combined_w, _ = buffer.combine(garbage, list(padded), topk_weights=padded_w)
    assert torch.equal(combined, expected_x) and torch.allclose(combined_w, expected_w, rtol=0, atol=1e-6)
    return errors


def test_rebuilt_tuple_handles_and_padded_recv_src_idx_as_deepep():
    results = gloo_pool(2).run(tuple_handles_and_padding, 41)
    for rank, errors in enumerate(results):
        assert list(errors) == ["a copy", "five fields", "another order", "another buffer's"], errors
        assert {argument for argument, _ in errors.values()} == {"handle"}, errors
        for name, (_, message) in errors.items():
            if rank == 1:
                assert "rejected on rank 0" in message, message
            elif name == "another buffer's":
                assert "expected a handle returned by a dispatch of this buffer" in message, message
            else:
                assert "is not a handle of this buffer" in message and "not copies" in message, message
        assert ("a tuple of 5" in errors["five fields"][1]) == (rank == 0)


@triton.jit
def _fp8_cast(src, out):
    tl.store(out, tl.load(src).to(tl.float8e4nv).to(tl.bfloat16))


def test_is_sm90_compiled_says_whether_the_kernels_build_for_sm90(monkeypatch):
    """DeepEP's static `is_sm90_compiled()` tells its callers whether its kernels carry Hopper's features (FP8, TMA),
    from how it was built, whatever GPU is present. Here the kernels are built by Triton's NVIDIA backend for sm_90,
    on this machine without a GPU too; without that backend the answer is False."""
    assert Buffer.is_sm90_compiled() is True
    ptx_text, _ = ptx.compile_for_sm90(_fp8_cast, {"src": "*bf16", "out": "*bf16"})
    assert ".target sm_90" in ptx_text and "e4m3" in ptx_text
    import triton.backends

    monkeypatch.setattr(triton.backends, "backends",
                        {name: b for name, b in triton.backends.backends.items() if name != "nvidia"})
    assert Buffer.is_sm90_compiled() is False


def comm_stream_and_device_handles(rank, world_size):
    """On one GPU: `get_comm_stream()` is the budget's comm stream where the buffer has a budget, else the current
    stream of the call; the nvlink kernels' dispatch with `num_worst_tokens` pads `recv_src_idx` with -1, and a
    tuple rebuilt from its handle (the handle dropped) combines through them."""
    group = dist.group.WORLD
    plain = Buffer(group, timeout_s=30)
    assert plain.get_comm_stream() == torch.cuda.current_stream()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert plain.get_comm_stream() == side
    budget = SimpleNamespace(comm_sms=8, comm_stream=torch.cuda.Stream())
    assert Buffer(group, budget=budget, timeout_s=30).get_comm_stream() is budget.comm_stream

    T, H, E, K = 32, 256, 8, 2
    fast = Buffer(group, num_nvl_bytes=Buffer.get_buffer_size_hint(T, H, 1, K, backend="nvlink"), num_sms=4,
                  backend="nvlink", timeout_s=30)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    topk_idx = torch.randint(0, E, (T, K), generator=g)
    topk_idx[torch.rand(T, K, generator=g) < 0.4] = -1
    topk_idx = topk_idx.to(topk_idx_t).cuda()
    sent = (topk_idx >= 0).any(dim=1)
    per_rank, _, per_expert, in_rank, _ = fast.get_dispatch_layout(topk_idx, E)
    worst = T + 5
    recv_x, _, _, _, handle, _ = fast.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                               num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                               num_worst_tokens=worst)
    n = int(sent.sum())
    src = handle.recv_src_idx
    assert src.shape == (worst,) and handle.num_recv_tokens == n
    assert sorted(src[:n].tolist()) == torch.nonzero(sent).flatten().tolist() and (src[n:] == -1).all()
    fields = tuple(handle)
    del handle
    gc.collect()
    combined, _, _ = fast.combine(recv_x, fields)
    assert torch.equal(combined, torch.where(sent[:, None], x, torch.zeros_like(x)))


@pytest.mark.gpu
def test_comm_stream_and_padded_handles_on_a_gpu():
    process_pool(1, "nccl").run(comm_stream_and_device_handles)
