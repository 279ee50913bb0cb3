"""Dispatch and combine of the reference backend with 2 and 4 gloo processes, against a single-process oracle.

Every rank builds the inputs of all ranks from one seed, runs its part through `Buffer`, and checks its results
against `expected_dispatch` / `expected_combine`, which walk over the tokens of all ranks one by one.
"""

import pytest
import torch
import torch.distributed as dist

import oracles
from smsplit.ep import Buffer
from smsplit.ep.buffer import HEADER_WORDS
from ep_harness import gloo_pool, process_pool


# -- inputs and oracle -----------------------------------------------------------------------------------------

def make_inputs(seed, world_size, num_tokens, hidden, num_experts, num_topk, drop=0.2, only_rank=None,
                silent_rank=None, dtype=torch.bfloat16):
    """Per-rank (x, topk_idx, topk_weights). `only_rank`: every expert choice lies on that rank.
    `silent_rank`: that rank's tokens all have top-k -1 (it sends nothing)."""
    g = torch.Generator().manual_seed(seed)
    experts_per_rank = num_experts // world_size
    inputs = []
    for r in range(world_size):
        n = num_tokens[r]
        x = (torch.randn(n, hidden, generator=g) * (r + 1)).to(dtype)
        if only_rank is None:
            candidates = num_experts
            topk = torch.rand(n, candidates, generator=g).argsort(dim=1)[:, :num_topk]
        else:
            topk = torch.rand(n, experts_per_rank, generator=g).argsort(dim=1)[:, :num_topk]
            topk = topk + only_rank * experts_per_rank
        topk = topk.to(torch.int64)
        topk[torch.rand(n, num_topk, generator=g) < drop] = -1
        if silent_rank == r:
            topk[:] = -1
        weights = torch.rand(n, num_topk, generator=g)
        inputs.append((x, topk, weights))
    return inputs


def expected_dispatch(inputs, rank, world_size, num_experts):
    """The rows this rank receives, walking over every token of every rank in order."""
    local = num_experts // world_size
    rows, idx, weights, src = [], [], [], []
    per_expert = [0] * local
    for s, (x, topk, w) in enumerate(inputs):
        for t in range(x.size(0)):
            mine = [int(e) >= 0 and int(e) // local == rank for e in topk[t]]
            if not any(mine):
                continue
            rows.append(x[t])
            idx.append([int(e) - rank * local if m else -1 for e, m in zip(topk[t], mine)])
            weights.append([float(v) if m else 0.0 for v, m in zip(w[t], mine)])
            src.append((s, t))
            for e, m in zip(topk[t], mine):
                if m:
                    per_expert[int(e) - rank * local] += 1
    hidden, k = inputs[0][0].size(1), inputs[0][1].size(1)
    recv_x = torch.stack(rows) if rows else torch.empty(0, hidden, dtype=inputs[0][0].dtype)
    recv_idx = torch.tensor(idx, dtype=torch.int64).view(-1, k)
    recv_w = torch.tensor(weights, dtype=torch.float32).view(-1, k)
    return recv_x, recv_idx, recv_w, per_expert, src


def expected_combine(inputs, rank, world_size, num_experts, expert_output):
    """Sum over the ranks a token reached of `expert_output(receiving_rank, row)`, in fp32."""
    local = num_experts // world_size
    x, topk, w = inputs[rank]
    out = torch.zeros(x.shape, dtype=torch.float32)
    out_w = torch.zeros(w.shape, dtype=torch.float32)
    for t in range(x.size(0)):
        for q in range(world_size):
            mine = [int(e) >= 0 and int(e) // local == q for e in topk[t]]
            if any(mine):
                out[t] += expert_output(q, x[t].float())
                out_w[t] += torch.tensor([float(v) if m else 0.0 for v, m in zip(w[t], mine)])
    return out, out_w


def layout_args(buffer, topk, num_experts):
    num_tokens_per_rank, rdma, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk, num_experts)
    assert rdma is None
    want_per_rank, want_per_expert, want_in_rank = oracles.dispatch_layout(topk.cpu(), num_experts, buffer.group_size)
    assert num_tokens_per_rank.tolist() == want_per_rank and num_tokens_per_expert.tolist() == want_per_expert
    assert is_token_in_rank.tolist() == want_in_rank
    return dict(num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                num_tokens_per_expert=num_tokens_per_expert)


def check_round(buffer, rank, world_size, inputs, num_experts, mode, expert_alignment=1, num_worst_tokens=0):
    """One dispatch + combine on `buffer` (inputs moved to `buffer.device`), checked against the oracle on the
    CPU. Returns the handle and the call's outputs as the buffer returned them (on its device: to poison)."""
    device = buffer.device
    x, topk, w = inputs[rank]
    ref_x, ref_idx, ref_w, ref_per_expert, ref_src = expected_dispatch(inputs, rank, world_size, num_experts)
    n_recv = ref_x.size(0)
    x_in = x.to(device)
    if mode == "fp8_input":
        x_in = tuple(t.to(device) for t in oracles.quantize_1x128(x_in))
    recv_x, recv_idx, recv_w, per_expert, handle, event = buffer.dispatch(
        x_in, topk_idx=topk.to(device), topk_weights=w.to(device), expert_alignment=expert_alignment,
        num_worst_tokens=num_worst_tokens, fp8=(mode in ("fp8", "fp8_dequantize")),
        dequantize=(mode == "fp8_dequantize"), **layout_args(buffer, topk.to(device), num_experts))
    event.current_stream_wait()
    outputs = [*(recv_x if isinstance(recv_x, tuple) else (recv_x,)), recv_idx, recv_w]
    recv_x = tuple(t.cpu() for t in recv_x) if isinstance(recv_x, tuple) else recv_x.cpu()
    recv_idx, recv_w = recv_idx.cpu(), recv_w.cpu()
    rows = num_worst_tokens if num_worst_tokens else n_recv

    if mode in ("fp8", "fp8_input"):
        assert isinstance(recv_x, tuple)
        recv_fp8, recv_scales = recv_x
        assert recv_fp8.dtype == torch.float8_e4m3fn and recv_scales.dtype == torch.float32
        assert recv_fp8.shape == (rows, x.size(1)) and recv_scales.shape == (rows, x.size(1) // 128), \
            (recv_fp8.shape, recv_scales.shape, rows, x.shape)
        ref_fp8, ref_scales = oracles.quantize_1x128(ref_x)  # (tests/oracles.py: no smsplit code)
        assert torch.equal(recv_fp8[:n_recv].view(torch.uint8), ref_fp8.view(torch.uint8))
        assert torch.equal(recv_scales[:n_recv], ref_scales)
    elif mode == "fp8_dequantize":
        assert recv_x.dtype == x.dtype and recv_x.shape == (rows, x.size(1))
        assert torch.equal(recv_x[:n_recv], oracles.fake_quantize_1x128(ref_x, x.dtype))
    else:
        assert recv_x.dtype == x.dtype and recv_x.shape == (rows, x.size(1))
        assert torch.equal(recv_x[:n_recv], ref_x)
    assert torch.equal(recv_idx[:n_recv], ref_idx)
    assert torch.equal(recv_w[:n_recv], ref_w)
    assert handle.num_recv_tokens == n_recv
    # padded to num_worst_tokens rows as DeepEP pads it (-1 where DeepEP leaves memory unwritten)
    assert handle.recv_src_idx.tolist() == [t for _, t in ref_src] + [-1] * (rows - n_recv)
    assert handle.rank_prefix_matrix[:, rank].tolist() == \
        torch.tensor([sum(1 for s, _ in ref_src if s <= q) for q in range(world_size)]).tolist()
    if num_worst_tokens:
        assert per_expert == []
        assert bool((recv_idx[n_recv:] == -1).all()) and bool((recv_w[n_recv:] == 0).all())
    else:
        assert per_expert == [-(-c // expert_alignment) * expert_alignment for c in ref_per_expert]

    # Combine: each rank returns its rows scaled by (rank + 1), so the oracle can tell the copies apart.
    values = recv_x if isinstance(recv_x, torch.Tensor) else oracles.dequantize_1x128(*recv_x, torch.bfloat16)
    if mode in ("fp8", "fp8_dequantize", "fp8_input"):
        # The receivers hold the dequantized tokens; quantization is per row, so quantize every rank's x whole.
        own_inputs = [(oracles.fake_quantize_1x128(xi, values.dtype), ti, wi)
                      for xi, ti, wi in inputs]
    else:
        own_inputs = inputs
    combined, combined_w, event = buffer.combine((values * (rank + 1)).to(device), handle,
                                                 topk_weights=recv_w.to(device))
    event.current_stream_wait()
    outputs += [combined, combined_w]
    combined, combined_w = combined.cpu(), combined_w.cpu()
    ref_out, ref_out_w = expected_combine(own_inputs, rank, world_size, num_experts,
                                          lambda q, row: (row.to(values.dtype) * (q + 1)).float())
    assert combined.dtype == values.dtype and combined.shape == x.shape
    torch.testing.assert_close(combined, ref_out.to(values.dtype), rtol=0, atol=0)
    torch.testing.assert_close(combined_w, ref_out_w, rtol=1e-6, atol=1e-6)
    return handle, outputs


# -- cases (run on every rank of a pool) ---------------------------------------------------------------------

def case_dispatch_combine(rank, world_size, seed, num_tokens, hidden, num_experts, num_topk, mode, special,
                          expert_alignment, num_worst_tokens, dtype):
    buffer = Buffer(dist.group.WORLD, timeout_s=10)  # CPU tensors on gloo, CUDA tensors on NCCL
    inputs = make_inputs(seed, world_size, num_tokens, hidden, num_experts, num_topk, dtype=dtype,
                         only_rank=(world_size - 1 if special == "one_rank" else None),
                         silent_rank=(1 if special == "silent_rank" else None),
                         drop=0.0 if special == "one_rank" else 0.25)
    check_round(buffer, rank, world_size, inputs, num_experts, mode, expert_alignment, num_worst_tokens)


def case_reuse_and_cached(rank, world_size, seed, rounds):
    """One buffer, many rounds with changing layouts and shapes; outputs of earlier rounds are poisoned in place
    (a transport that aliased them into the next round would be caught); cached-handle dispatches in between.
    Gloo (CPU tensors) or NCCL (CUDA tensors of the current device)."""
    hint = Buffer.get_buffer_size_hint(12, 4096, world_size, 9, torch.float32)
    # (the reference named: on NCCL, "auto" may take a device transport for a buffer this size)
    buffer = Buffer(dist.group.WORLD, num_nvl_bytes=hint, backend="reference", timeout_s=10)
    g = torch.Generator().manual_seed(seed)
    previous = []
    for round_index in range(rounds):
        hidden = [2048, 4096, 256, 7168 // 2][round_index % 4]
        num_topk = [1, 9, 4, 2, 6][round_index % 5]
        num_experts = 36 if world_size == 4 else 18
        num_tokens = torch.randint(0, 12, (world_size,), generator=g).tolist()
        dtype = torch.float32 if round_index % 3 == 0 else torch.bfloat16
        inputs = make_inputs(seed * 1000 + round_index, world_size, num_tokens, hidden, num_experts, num_topk,
                             dtype=dtype, drop=0.3)
        mode = ["bf16", "fp8", "fp8_dequantize", "fp8_input"][round_index % 4] if dtype == torch.bfloat16 \
            else "bf16"
        for t in previous:  # poison: a transport that reads or returns stale memory shows NaN or -7
            t.fill_(-7 if not t.is_floating_point() else float("nan"))
        handle, previous = check_round(buffer, rank, world_size, inputs, num_experts, mode)

        # Cached mode: new values along the same layout land in the same rows.
        x_new = torch.randn(inputs[rank][0].shape).to(dtype)  # rank-local values; `g` must stay in step
        recv_new, recv_idx, recv_w, per_expert, same_handle, _ = buffer.dispatch(x_new.to(buffer.device),
                                                                                 handle=handle)
        assert recv_idx is None and recv_w is None and per_expert is None and same_handle is handle
        # Oracle for the cached rows: the same (source, token) order as the uncached dispatch.
        _, _, _, _, src = expected_dispatch(inputs, rank, world_size, num_experts)
        gathered = [torch.empty(0)] * world_size
        dist.all_gather_object(gathered, x_new)
        expected_rows = torch.stack([gathered[s][t] for s, t in src]) if src else torch.empty(0, hidden, dtype=dtype)
        assert torch.equal(recv_new.cpu(), expected_rows)
        previous.append(recv_new)
        # a cached dispatch that quantizes: the same rows, quantized as the oracle does
        (recv_fp8, recv_scales), *_ = buffer.dispatch(x_new.to(buffer.device), handle=handle, fp8=True)
        ref_fp8, ref_scales = oracles.quantize_1x128(expected_rows)
        assert torch.equal(recv_fp8.view(torch.uint8).cpu(), ref_fp8.view(torch.uint8))
        assert torch.equal(recv_scales.cpu(), ref_scales)
        previous += [recv_fp8.view(torch.uint8), recv_scales]
    return buffer.get_buffer_size_hint(12, 4096, world_size, 9, torch.float32)


def case_subgroup(rank, world_size, seed, members):
    """A Buffer on the group of global ranks `members`, group rank i being global rank ``members[i]`` (where torch
    can order a group so): group ranks, not global ranks, address the peers; the oracle numbers the ranks by group
    rank. Returns (the group's global ranks by group rank, the rows this rank received or None)."""
    group, members = oracles.new_group_in_order(members)  # collective over the whole world
    if rank not in members:
        return members, None
    group_rank, group_size = members.index(rank), len(members)
    buffer = Buffer(group, timeout_s=10)
    assert (buffer.rank, buffer.group_size) == (group_rank, group_size)
    inputs = make_inputs(seed, group_size, [4, 6, 3, 5][:group_size], 2048, 4 * group_size, 3)
    handle, _ = check_round(buffer, group_rank, group_size, inputs, 4 * group_size, "bf16")
    check_round(buffer, group_rank, group_size, make_inputs(seed + 1, group_size, [2, 3, 1, 4][:group_size], 256,
                                                            4 * group_size, 2), 4 * group_size, "fp8")
    return members, handle.num_recv_tokens


def case_rows_placed_by_a_device_transport(rank, world_size, seed):
    """A device transport may put the rows from a source out of the source's token order (`nvlink_copy_engine`
    does; `recv_src_idx` names each row's token). What such a handle sends through the reference transport (an
    fp32 combine, a cached fp32 dispatch, the weights-only backward passes) must follow its rows: here a handle of
    the reference backend with its rows shuffled within each source's block, as a device transport's, must give
    the unshuffled handle's results on the matching rows."""
    import copy

    buffer = Buffer(dist.group.WORLD, timeout_s=10)
    num_experts = 4 * world_size
    inputs = make_inputs(seed, world_size, [9, 7, 8, 6][:world_size], 256, num_experts, 3, drop=0.1)
    x, topk, w = inputs[rank]
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=w,
                                                      **layout_args(buffer, topk, num_experts))
    n = handle.num_recv_tokens
    g = torch.Generator().manual_seed(seed + rank)
    ends = handle.rank_prefix_matrix[:, rank].tolist()
    q = torch.cat([start + torch.randperm(end - start, generator=g) for start, end in zip([0] + ends[:-1], ends)])
    assert q.numel() == n and (n < 4 or not torch.equal(q, torch.arange(n)))
    placed = copy.copy(handle)  # the same layout, rows where a device transport might have put them
    placed.recv_src_idx = handle.recv_src_idx[q]
    placed.transport_state = "rows placed by a device transport"  # (not the reference transport's own state)
    placed.transport = "nvlink_copy_engine"
    captured = copy.copy(placed)  # as a dispatch captured in a CUDA graph leaves it: padded, no host count
    captured.num_recv_tokens, captured.num_worst_tokens = -1, n + 5
    captured.recv_src_idx = torch.cat([placed.recv_src_idx, torch.randint(-1, 50, (5,), generator=g,
                                                                          dtype=torch.int32)])

    y = recv_x.float() * 3 + torch.arange(n, dtype=torch.float32)[:, None]  # an fp32 combine: the reference path
    combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w)
    combined_placed, combined_w_placed, _ = buffer.combine(y[q], placed, topk_weights=recv_w[q])
    assert torch.equal(combined_placed, combined) and torch.equal(combined_w_placed, combined_w)
    padding = torch.full((5, y.size(1)), 1e6)
    combined_captured, _, _ = buffer.combine(torch.cat([y[q], padding]), captured)
    assert torch.equal(combined_captured, buffer.combine(y, handle)[0])

    x_new = torch.randn(x.size(0), x.size(1), generator=g)  # a cached fp32 dispatch: the reference path
    recv_new = buffer.dispatch(x_new, handle=handle)[0]
    assert torch.equal(buffer.dispatch(x_new, handle=placed)[0], recv_new[q])
    recv_captured = buffer.dispatch(x_new, handle=captured)[0]
    assert torch.equal(recv_captured[:n], recv_new[q]) and not recv_captured[n:].any()

    grad_w = torch.rand(n, 3, generator=g)  # the weights-only backward of a dispatch, then of a combine
    assert torch.equal(buffer._combine(None, placed, grad_w[q], None, None, False, internal=True)[1],
                       buffer._combine(None, handle, grad_w, None, None, False, internal=True)[1])
    grad_out_w = torch.rand(x.size(0), 3, generator=g)
    fields = dict(num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                  num_tokens_per_expert=None, topk_idx=None, topk_weights=grad_out_w, expert_alignment=1,
                  num_worst_tokens=0, previous_event=None, async_finish=False, fp8=False, dequantize=False,
                  internal=True)
    assert torch.equal(buffer._dispatch(None, handle=placed, **fields)[2],
                       buffer._dispatch(None, handle=handle, **fields)[2][q])
    return n


def case_zero_hidden(rank, world_size):
    """x with hidden 0 on every rank: a ValueError naming x on every rank (it failed as a RuntimeError or an
    AttributeError in the transport's unpacking, after the tokens moved), and the buffer stays usable."""
    from smsplit.ep import EPArgumentError

    buffer = Buffer(dist.group.WORLD, timeout_s=10)
    inputs = make_inputs(rank, world_size, [4] * world_size, 256, 4 * world_size, 2)
    x, topk, w = inputs[rank]
    layout = layout_args(buffer, topk, 4 * world_size)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=w, **layout)
    calls = [lambda: buffer.dispatch(x[:, :0], topk_idx=topk, topk_weights=w, **layout),
             lambda: buffer.dispatch(x[:, :0], handle=handle),
             lambda: buffer.combine(recv_x[:, :0], handle)]
    for call in calls:
        with pytest.raises(EPArgumentError) as error:
            call()
        assert error.value.argument == "x", str(error.value)
    combined, _, _ = buffer.combine(recv_x, handle)
    assert combined.shape == x.shape
    return True


# -- tests -----------------------------------------------------------------------------------------------------


DISPATCH_CASES = [
    # world, tokens per rank, hidden, experts, topk, mode, special, alignment, worst, dtype
    (2, [5, 3], 2048, 8, 1, "bf16", None, 1, 0, torch.bfloat16),
    (2, [6, 4], 7168, 16, 9, "bf16", None, 4, 0, torch.bfloat16),
    (2, [4, 4], 4096, 8, 4, "fp8", None, 1, 0, torch.bfloat16),
    (2, [3, 5], 7168, 16, 8, "fp8_dequantize", None, 1, 0, torch.bfloat16),
    (2, [4, 2], 2048, 8, 2, "fp8_input", None, 1, 0, torch.bfloat16),
    (2, [5, 0], 2048, 8, 3, "bf16", None, 1, 0, torch.bfloat16),        # a rank with no tokens at all
    (2, [4, 6], 2048, 8, 3, "bf16", "silent_rank", 1, 0, torch.float32),  # rank 1's tokens go nowhere
    (2, [4, 6], 3072, 8, 4, "bf16", "one_rank", 8, 0, torch.bfloat16),  # every token to rank 1
    (2, [5, 3], 2048, 8, 2, "bf16", None, 1, 16, torch.bfloat16),       # padded, no host-side counts
    (2, [6, 5], 2048, 16, 5, "fp8", None, 1, 0, torch.bfloat16),
    (2, [4, 6], 7168, 16, 7, "fp8_input", None, 1, 0, torch.bfloat16),
    (4, [3, 5, 0, 4], 2048, 16, 4, "bf16", None, 1, 0, torch.bfloat16),
    (4, [2, 3, 2, 3], 7168, 36, 9, "fp8", None, 2, 0, torch.bfloat16),
    (4, [4, 1, 3, 2], 4096, 16, 1, "fp8_dequantize", None, 1, 0, torch.bfloat16),
    (4, [3, 3, 3, 3], 2048, 16, 5, "bf16", "silent_rank", 1, 0, torch.bfloat16),
    (4, [3, 2, 4, 1], 6144, 32, 8, "bf16", "one_rank", 1, 0, torch.float32),
    (4, [2, 4, 3, 2], 2048, 8, 2, "fp8_input", None, 1, 12, torch.bfloat16),
]


@pytest.mark.parametrize("case", DISPATCH_CASES, ids=lambda c: f"ep{c[0]}-h{c[2]}-k{c[4]}-{c[5]}-{c[6]}-w{c[8]}")
def test_dispatch_combine_against_oracle(case):
    world_size, *params = case
    gloo_pool(world_size).run(case_dispatch_combine, 1234 + DISPATCH_CASES.index(case), *params)


@pytest.mark.parametrize("world_size", [2, 4])
def test_buffer_reuse_many_rounds_and_cached_handles(world_size):
    hints = gloo_pool(world_size).run(case_reuse_and_cached, 77 + world_size, 10)
    # 12 tokens x (4096 fp32 values + 9 x 12 bytes of top-k + 4 bytes of source index, padded to 16) per source
    # rank, plus a (13 + world_size)-word header per rank (its 13 fixed words: smsplit.ep.buffer.HEADER_WORDS).
    row = -(-(4096 * 4 + 9 * 12 + 4) // 16) * 16
    assert HEADER_WORDS == 13
    assert hints == [world_size * (12 * row + -(-(13 + world_size) * 8 // 16) * 16)] * world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_rows_a_device_transport_placed_out_of_token_order_take_the_reference_path_in_their_order(world_size):
    received = gloo_pool(world_size).run(case_rows_placed_by_a_device_transport, 515 + world_size)
    assert all(n >= 4 for n in received)


@pytest.mark.parametrize("members", [[1, 3], [3, 0], [0, 2, 3], [2, 0, 3], [3, 1, 0, 2]],
                         ids=lambda m: "ranks" + "-".join(map(str, m)))
def test_buffer_on_a_subgroup(members):
    """Subgroups of 2, 3 and 4 of 4 ranks, in order and not: each rank's rows against the oracle by group rank."""
    results = gloo_pool(4).run(case_subgroup, 4242, members)
    order = results[0][0]
    assert order in (members, sorted(members))  # (sorted: a torch without new_group(sort_ranks=False))
    for rank, (_, received) in enumerate(results):
        assert (received is None) == (rank not in members) and (received is None or received > 0)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("case", [c for c in DISPATCH_CASES if c[0] == 2],
                         ids=lambda c: f"ep{c[0]}-h{c[2]}-k{c[4]}-{c[5]}-{c[6]}-w{c[8]}")
def test_reference_backend_on_nccl(case):
    """The same cases through NCCL on two GPUs (the reference backend as the GPU transports' oracle)."""
    world_size, *params = case
    process_pool(world_size, "nccl").run(case_dispatch_combine, 1234 + DISPATCH_CASES.index(case), *params)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_reference_backend_on_nccl_reuses_its_buffer_across_rounds():
    process_pool(2, "nccl").run(case_reuse_and_cached, 79, 6)


def test_kernel_inputs_are_made_contiguous_and_16_byte_aligned():
    """The device kernels read rows in 16-byte vectors: a view that starts mid-vector or skips elements is copied
    (`smsplit.ep.device.dense`), an aligned contiguous tensor is passed as it is."""
    from smsplit.ep.device import dense as _dense
    from ep_harness import misaligned_copy

    t = torch.randn(4, 64, dtype=torch.bfloat16)
    assert _dense(t) is t
    view = misaligned_copy(t)
    dense = _dense(view)
    assert dense.data_ptr() % 16 == 0 and torch.equal(dense, view)
    strided = t[:, ::2]
    dense = _dense(strided)
    assert dense.is_contiguous() and dense.data_ptr() % 16 == 0 and torch.equal(dense, strided)


def case_combine_rounds_once(rank, world_size):
    """Rank 0's tokens t = 0, 1, 2 each go to all three ranks; rank r sends back 1.0 for token r and 2**-8 for the
    others. Summed in fp32 and rounded once, every token is 1 + 2**-7 (a bf16 value); summed in bf16 in any fixed
    order of the ranks, a token whose 1.0 comes first or second loses both 2**-8 (each a tie, rounded to even)."""
    num_experts = 3 * world_size
    buffer = Buffer(dist.group.WORLD, timeout_s=30)
    n = 3 if rank == 0 else 2
    topk = torch.full((n, 3), -1, dtype=torch.int64)
    if rank == 0:
        topk[:] = torch.tensor([0, 3, 6])  # one expert on each rank
    x = torch.randn(n, 256).to(torch.bfloat16)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=topk)
    assert recv_x.size(0) == 3
    src = handle.recv_src_idx.long()  # each received row's token index on rank 0
    expert_out = torch.where((src == rank)[:, None], 1.0, 2.0 ** -8).expand(3, 256).to(torch.bfloat16)
    combined, _, _ = buffer.combine(expert_out.contiguous(), handle)
    return combined


def test_combine_sums_in_fp32_and_rounds_once():
    combined = gloo_pool(3).run(case_combine_rounds_once)
    assert torch.equal(combined[0], torch.full((3, 256), 1 + 2.0 ** -7, dtype=torch.bfloat16))
    assert combined[1].shape == (2, 256) and not combined[1].any()  # tokens sent nowhere combine to 0


def test_zero_hidden_size_is_an_argument_error_on_every_rank():
    assert gloo_pool(2).run(case_zero_hidden) == [True, True]


def case_all_gather_without_deprecation(rank, world_size):
    import warnings

    from smsplit.ep.transport import all_gather_into_tensor

    out = torch.full((world_size * 3,), -1, dtype=torch.int64)  # (gloo's shape: NCCL also takes [world, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # torch 2.13 deprecates all_gather_into_tensor's old name
        work = all_gather_into_tensor(out, torch.arange(3) + 10 * rank, dist.group.WORLD, async_op=True)
    work.wait()
    return out.view(world_size, 3)


@pytest.mark.versioned
def test_transports_all_gather_under_the_name_torch_keeps():
    gathered = gloo_pool(3).run(case_all_gather_without_deprecation)
    assert all(torch.equal(g, torch.arange(3) + 10 * torch.arange(3)[:, None]) for g in gathered)
