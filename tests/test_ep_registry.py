"""The registry's choice of a transport per call (`smsplit.ep.registry.choose`), checked on the CPU with the real
transports' capabilities in a GPU environment described by hand and with made-up capabilities, the handle's record of
the transport that ran, and the header word of the SM count."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from smsplit.ep import Buffer, EPArgumentError, registry
from smsplit.ep.header import H_NUM_SMS, H_NUM_TOKENS, OP_INIT, init_header, new_header
from smsplit.ep.transport import Environment, Move
from ep_harness import gloo_pool

MB = 1 << 20
GPU = Environment(cuda=True, one_node=True, num_ranks=2, num_nvl_bytes=512 * MB, device_sms=132, device="cuda:0")
CPU = Environment(cuda=False, one_node=True, num_ranks=2, num_nvl_bytes=0, device_sms=0)
BF16, FP32, E4M3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn


def dispatch(dtype=BF16, **kw):
    return Move("dispatch", dtype, **{"hidden": 7168, "num_topk": 8, "max_tokens": 4096, "num_sms": 20, **kw})


def combine(layout_of, dtype=BF16, **kw):
    return Move("combine", dtype, **{"hidden": 7168, "num_topk": 8, "num_sms": 20, "layout_of": layout_of,
                                     "layout_hidden": 7168, **kw})


def test_the_registry_lists_every_transport_fastest_first():
    assert registry.ORDER == ("nvlink_copy_engine", "nvlink", "copy_engine", "hierarchical", "reference")
    assert set(registry.BACKENDS) == set(registry.ORDER) | {"auto"}
    assert registry.BACKENDS[-1] == "hierarchical"  # (a name's index is its code in the header: new names go last)
    assert registry.DEVICE_BACKENDS == ("nvlink", "copy_engine", "nvlink_copy_engine")


def test_auto_takes_the_fastest_transport_that_can_move_the_call():
    choose = registry.choose
    assert choose("auto", dispatch(), GPU) == "nvlink_copy_engine"
    assert choose("auto", dispatch(E4M3), GPU) == "nvlink_copy_engine"  # FP8 input
    assert choose("auto", dispatch(FP32, quantize=True), GPU) == "nvlink_copy_engine"  # quantized in the kernel
    assert choose("auto", dispatch(FP32), GPU) == "reference"  # fp32 values: the kernels move bf16 and e4m3 only
    assert choose("auto", dispatch(torch.float16), GPU) == "reference"
    assert choose("auto", dispatch(), CPU) == "reference"  # gloo: no device transport
    assert choose("auto", dispatch(), GPU._replace(num_nvl_bytes=0)) == "reference"  # no buffer
    assert choose("auto", dispatch(), GPU._replace(one_node=False)) == "reference"
    assert choose("auto", dispatch(), GPU._replace(num_nvl_bytes=150 * MB)) == "reference"  # too small
    assert choose("auto", dispatch(hidden=200), GPU) == "reference"  # not a multiple of 128
    assert choose("auto", dispatch(num_topk=17), GPU) == "reference"
    assert choose("auto", dispatch(num_sms=200), GPU) == "reference"  # more SMs than the GPU has
    # a cached dispatch or a combine reuses its layout: the transport that made it, else the reference
    nodes = GPU._replace(num_nodes=2)  # the hierarchical transport's layouts exist only where nodes are several
    assert choose("auto", dispatch(layout_of="hierarchical", layout_hidden=7168), nodes) == "hierarchical"
    assert choose("auto", combine("hierarchical", FP32), nodes) == "hierarchical"
    assert choose("auto", combine("hierarchical", None), nodes) == "hierarchical"
    for maker in (name for name in registry.ORDER if name != "hierarchical"):
        assert choose("auto", dispatch(layout_of=maker, layout_hidden=7168), GPU) == maker
        assert choose("auto", combine(maker), GPU) == maker
        assert choose("auto", combine(maker, FP32), GPU) == "reference"  # the kernels sum bf16 only
        assert choose("auto", combine(maker, None), GPU) == "reference"  # weights only
    assert choose("auto", combine("nvlink", hidden=4096), GPU) == "reference"  # other rows than its dispatch's
    # captured in a CUDA graph: no host synchronization
    captured = dict(captured=True, worst=8192)
    assert choose("auto", dispatch(**captured), GPU) == "nvlink"  # nvlink_copy_engine plans from a handle
    assert choose("auto", dispatch(worst=8192), GPU) == "nvlink"  # eagerly too: the warm-up of a capture
    assert choose("nvlink_copy_engine", dispatch(worst=8192), GPU) == "nvlink_copy_engine"
    assert choose("auto", dispatch(layout_of="nvlink_copy_engine", layout_hidden=7168, **captured),
                  GPU) == "nvlink_copy_engine"
    assert choose("auto", combine("nvlink_copy_engine", captured=True), GPU) == "nvlink_copy_engine"
    with pytest.raises(EPArgumentError) as caught:
        choose("auto", dispatch(**captured), CPU)
    assert caught.value.argument == "backend" and "cannot run inside a CUDA graph capture" in str(caught.value)


def test_an_explicit_backend_that_cannot_move_a_call_names_one_that_can():
    with pytest.raises(EPArgumentError) as caught:
        registry.choose("nvlink", dispatch(FP32), GPU)
    assert caught.value.argument == "x"
    assert str(caught.value).startswith("x: the nvlink backend moves bfloat16 and float8_e4m3fn values")
    assert str(caught.value).endswith("; backend='reference' can")
    with pytest.raises(EPArgumentError, match="combines bfloat16 rows, got torch.float32; backend='reference' can"):
        registry.choose("nvlink_copy_engine", combine("nvlink_copy_engine", FP32), GPU)
    with pytest.raises(EPArgumentError, match=r"^handle: the nvlink backend moves only layouts its own dispatches "
                                              r"made; this handle's dispatch ran on reference; backend='reference'"):
        registry.choose("nvlink", dispatch(layout_of="reference", layout_hidden=7168), GPU)
    # one that is not there yet: the reference refuses a capture, naming the backends that can
    with pytest.raises(EPArgumentError, match="the backends that can: nvlink_copy_engine, nvlink; "
                                              "backend='nvlink' can"):
        registry.choose("reference", dispatch(captured=True, worst=8192), GPU)
    # a backward pass (internal) takes the reference where the explicit backend cannot move its gradients
    assert registry.choose("nvlink", combine("nvlink", FP32), GPU, internal=True) == "reference"
    assert registry.choose("nvlink", combine("nvlink"), GPU, internal=True) == "nvlink"
    assert registry.choose("reference", dispatch(), GPU) == "reference"


def test_the_choice_follows_the_declared_capabilities():
    """Made-up capabilities: a fastest transport that moves no bf16 leaves bf16 calls to the next one, and one that
    moves fp32 takes fp32 calls from the reference."""
    real = registry.capabilities

    def fake(name):
        caps = real(name)
        if name == "nvlink_copy_engine":
            return dataclasses.replace(caps, moves=frozenset({E4M3}), quantizes=frozenset())
        if name == "copy_engine":
            return dataclasses.replace(caps, moves=caps.moves | {FP32})
        return caps

    assert registry.choose("auto", dispatch(), GPU, capabilities_of=fake) == "nvlink"
    assert registry.choose("auto", dispatch(E4M3), GPU, capabilities_of=fake) == "nvlink_copy_engine"
    assert registry.choose("auto", dispatch(FP32), GPU, capabilities_of=fake) == "copy_engine"
    with pytest.raises(EPArgumentError, match="; backend='copy_engine' can$"):
        registry.choose("nvlink", dispatch(FP32), GPU, capabilities_of=fake)


def test_the_choice_is_remembered_but_a_refusal_is_raised_afresh(monkeypatch):
    """Every eager call chooses (a cached dispatch once, an uncached one twice): the registered capabilities never
    change, so a choice is remembered, bounded; a refusal is not (each call raises an error of its own, which the
    header exchange marks as every rank's); made-up capabilities are never remembered."""
    monkeypatch.setattr(registry, "_CHOSEN", {})
    monkeypatch.setattr(registry, "_CHOSEN_MAX", 3)
    moves = [dispatch(), dispatch(E4M3), combine("nvlink"), dispatch(FP32)]
    expected = ["nvlink_copy_engine", "nvlink_copy_engine", "nvlink", "reference"]
    for _ in range(2):
        assert [registry.choose("auto", move, GPU) for move in moves] == expected
        assert len(registry._CHOSEN) <= 3
    assert registry._CHOSEN[("auto", dispatch(FP32), GPU, False)] == "reference"
    # the same move in another environment or from another backend is chosen afresh
    assert registry.choose("auto", dispatch(), GPU._replace(num_nvl_bytes=0)) == "reference"
    assert registry.choose("nvlink", combine("nvlink", FP32), GPU, internal=True) == "reference"
    refusals = []
    for _ in range(2):
        with pytest.raises(EPArgumentError, match="backend='reference' can$") as caught:
            registry.choose("nvlink", dispatch(FP32), GPU)
        refusals.append(caught.value)
    assert refusals[0] is not refusals[1]
    assert ("nvlink", dispatch(FP32), GPU, False) not in registry._CHOSEN

    def only_e4m3(name):  # device transports that move no bf16
        caps = registry.capabilities(name)
        return dataclasses.replace(caps, moves=frozenset({E4M3}), quantizes=frozenset()) if caps.needs_cuda else caps

    assert registry.choose("auto", dispatch(), GPU, capabilities_of=only_e4m3) == "reference"
    assert registry.choose("auto", dispatch(), GPU) == "nvlink_copy_engine"


def test_size_hints_of_auto_fit_every_transport():
    args = (4, 4096, 7168, 8, BF16, False, BF16)
    sizes = {name: registry.size_hint(name, *args) for name in registry.ORDER}
    assert registry.size_hint("auto", *args) == max(sizes.values())
    assert Buffer.get_buffer_size_hint(4096, 7168, 4, 8, backend="auto") == max(sizes.values())
    assert Buffer.get_buffer_size_hint(4096, 7168, 4, 8) == sizes["reference"]


def test_the_init_header_carries_the_sm_count_in_its_own_word():
    header = init_header(new_header(3, OP_INIT, 1, False), 1 << 20, 24, 2, None)
    assert (header[:, H_NUM_SMS] == 24).all() and (header[:, H_NUM_TOKENS] == 0).all()


def case_handles_record_their_transport(rank, world_size):
    """On gloo, "auto" and "reference" run the reference transport, and the handle says so; the header of the
    constructor carries each rank's SM count in `H_NUM_SMS`."""
    from smsplit.ep.reference import ReferenceTransport

    sent = []
    exchange = ReferenceTransport.exchange_headers
    ReferenceTransport.exchange_headers = lambda self, op, what, rows: (sent.append(rows.clone()),
                                                                        exchange(self, op, what, rows))[1]
    try:
        buffers = [Buffer(dist.group.WORLD, num_sms=12, timeout_s=10),
                   Buffer(dist.group.WORLD, backend="reference", timeout_s=10)]
    finally:
        ReferenceTransport.exchange_headers = exchange
    init_rows = [rows for rows in sent if int(rows[0, 0]) == OP_INIT]
    assert [int(rows[0, H_NUM_SMS]) for rows in init_rows] == [12, Buffer.num_sms]
    assert all(int(rows[0, H_NUM_TOKENS]) == 0 for rows in init_rows)
    x = torch.randn(4, 256).to(torch.bfloat16)
    topk = torch.tensor([[0, 1], [2, 3], [1, -1], [3, 0]])
    made = []
    for buffer in buffers:
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, 4)
        recv_x, _, _, _, handle, _ = buffer.dispatch(x.float(), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                     num_tokens_per_expert=per_expert, topk_idx=topk)
        made.append((buffer.backend, handle.transport, type(handle.transport_state).__name__))
        buffer.combine(recv_x, handle)
    return made


def test_handles_record_the_transport_that_ran():
    for made in gloo_pool(2).run(case_handles_record_their_transport):
        assert made == [("auto", "reference", "ReferenceState"), ("reference", "reference", "ReferenceState")]


class FakeEngine:
    """An engine with the device engines' contract (`NvlinkTransport` / `CopyEngineTransport`: constructor, per-call
    SM count, `plan`, `buffer_bytes`), recording its calls: what the protocol-level device transports do with an
    engine, checked without a GPU."""

    def __init__(self, group, device, max_tokens, hidden, max_topk=16, timeout_s=60.0, **options):
        self.max_tokens, self.hidden, self.options, self.calls = max_tokens, hidden, options, []

    @staticmethod
    def buffer_bytes(num_ranks, max_tokens, hidden, max_topk=16):
        return 1000 * num_ranks * max_tokens + hidden

    def dispatch(self, x, scales, topk_idx, topk_weights, is_token_in_rank, num_local_experts, *, num_sms,
                 quantize=False, num_worst_tokens=0, cached=None, num_recv_tokens=None, trace=None):
        self.calls.append(("dispatch", num_sms, quantize, cached is not None, num_recv_tokens))
        layout = cached or SimpleNamespace(rank_prefix_matrix=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
        rows = max(num_worst_tokens, x.size(0))
        return x, scales, topk_idx, topk_weights, torch.arange(rows, dtype=torch.int32), layout

    def combine(self, y, y_weights, layout, *, num_sms, trace=None):
        self.calls.append(("combine", num_sms))
        return y * 2, y_weights

    def plan(self, layout, is_token_in_rank, *, num_sms):
        self.calls.append(("plan", num_sms))

    def raise_if_failed(self):
        pass


@pytest.mark.parametrize("kind", ["nvlink", "nvlink_copy_engine", "copy_engine"])
def test_device_transports_drive_their_engines_per_call(kind):
    from smsplit.ep.device import DeviceState
    from smsplit.ep.layout import DispatchHandle
    from smsplit.ep.transport import Tokens

    base = registry.transport_class(kind)
    fake = type("Fake", (base,), {"engine_class": classmethod(lambda cls: FakeEngine)})
    group = SimpleNamespace(rank=lambda: 0, size=lambda: 2)
    transport = fake(group, torch.device("cpu"), 5.0, 37_000 + 256)
    assert not transport.prepared(256)
    x = torch.randn(4, 256).to(torch.bfloat16)
    in_rank = torch.ones(4, 2, dtype=torch.bool)
    handle = DispatchHandle(0, 0, 2, in_rank, torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32),
                            num_recv_tokens=4, num_worst_tokens=0, num_local_experts=2, hidden=256, transport=kind)
    counts = [[4, 4], [0, 3]]
    got = transport.dispatch(handle, Tokens(x, num_local_experts=2, counts=counts), num_sms=12)
    engine = transport.engines()[0]
    assert transport.prepared(256) and engine.max_tokens == 18 and engine.hidden == 256  # 1000 * 2 * 18 + 256 fits
    assert engine.options == ({"bulk": "copy_engine"} if kind == "nvlink_copy_engine" else {})
    state = handle.transport_state
    assert isinstance(state, DeviceState) and state.engine is engine and state.last_num_sms == 12
    assert handle.recv_src_idx.tolist() == [0, 1, 2, 3]
    expected_prefix = [[4, 4], [4, 7]] if kind == "copy_engine" else [[1, 2], [3, 4]]  # from counts, or the kernels'
    assert handle.rank_prefix_matrix.tolist() == expected_prefix
    assert torch.equal(got.values, x) and (got.values is not x) == (kind != "copy_engine")  # views cloned
    transport.dispatch(handle, Tokens(x, quantize=True, num_local_experts=2), num_sms=8)  # cached: same layout
    out, _ = transport.combine(handle, x, None, num_sms=6)
    assert torch.equal(out, x * 2) and state.last_num_sms == 6 and len(transport.engines()) == 1
    planned = [("plan", 12)] if kind == "nvlink_copy_engine" else []
    assert engine.calls == [("dispatch", 12, False, False, 4), *planned, ("dispatch", 8, True, True, None),
                            ("combine", 6)]


class ShuffledEngine(FakeEngine):
    """An engine that really moves rows (through the reference transport's messages, on the CPU) and, as
    nvlink_copy_engine may, places each source's rows out of token order (reversed): `Buffer`'s device paths,
    driven through it, must give the reference backend's results on the rows `recv_src_idx` names."""

    def __init__(self, group, device, max_tokens, hidden, max_topk=16, timeout_s=60.0, **options):
        from smsplit.ep.reference import ReferenceTransport

        super().__init__(group, device, max_tokens, hidden, max_topk, timeout_s, **options)
        self.group, self.ref = group, ReferenceTransport(group, device, timeout_s)

    @staticmethod
    def buffer_bytes(num_ranks, max_tokens, hidden, max_topk=16):
        return max_tokens

    def dispatch(self, x, scales, topk_idx, topk_weights, is_token_in_rank, num_local_experts, *, num_sms,
                 quantize=False, num_worst_tokens=0, cached=None, num_recv_tokens=None, trace=None):
        from smsplit.ep.layout import DispatchHandle
        from smsplit.ep.rows import to_local_expert_ids
        from smsplit.fp8 import quantize_1x128

        self.calls.append(("dispatch", num_sms, quantize, cached is not None, num_recv_tokens))
        if quantize:
            x, scales = quantize_1x128(x)
        layout = cached
        if layout is None:
            counts = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
            dist.all_gather(counts, is_token_in_rank.sum(0), group=self.group)
            counts = [c.tolist() for c in counts]
            rank = self.group.rank()
            handle = DispatchHandle(0, rank, 2, is_token_in_rank, torch.empty(0), torch.empty(0, dtype=torch.int32),
                                    sum(row[rank] for row in counts), num_worst_tokens, num_local_experts)
            self.ref._state(handle, counts)
            ends = handle.rank_prefix_matrix[:, rank].tolist()
            order = torch.cat([torch.arange(end - 1, start - 1, -1) for start, end in zip([0] + ends[:-1], ends)])
            layout = SimpleNamespace(handle=handle, order=order, rank_prefix_matrix=handle.rank_prefix_matrix)
        handle, order, n = layout.handle, layout.order, layout.order.numel()
        fields = [t for t in (x, scales, topk_idx, topk_weights) if t is not None]
        fields.append(torch.arange(x.size(0), dtype=torch.int32).view(-1, 1))
        got = iter(torch.cat([t[:n][order], t[n:]]) for t in self.ref.move_rows("test", handle, fields,
                                                                                 handle.transport_state))
        recv = [next(got) if t is not None else None for t in (x, scales, topk_idx, topk_weights)]
        src = next(got)[:, 0].contiguous()
        src[n:] = -1
        if recv[2] is not None:
            recv[2][n:] = -1
            recv[2] = to_local_expert_ids(recv[2], handle.rank, num_local_experts)
        return (*recv, src, layout)

    def combine(self, y, y_weights, layout, *, num_sms, trace=None):
        self.calls.append(("combine", num_sms))
        n, back = layout.order.numel(), torch.empty_like(layout.order)
        back[layout.order] = torch.arange(n)
        rows = [t[:n][back] if t is not None else None for t in (y, y_weights)]
        out, weights = self.ref.sum_rows("test", layout.handle, rows, layout.handle.transport_state)
        return out.to(y.dtype), weights


def case_device_paths_of_the_buffer(rank, world_size):
    """`Buffer` on its device paths, with the engines replaced by `ShuffledEngine` and the environment by a GPU's,
    against a reference buffer: "auto" takes nvlink_copy_engine for bf16 and FP8 (quantized in the engine) and its
    combine, the reference (in the device layout's row order) for an fp32 combine, a cached fp32 dispatch and the
    weights-only backward passes; an explicit nvlink_copy_engine refuses the fp32 combine, naming the reference."""
    from smsplit.ep.device import DeviceState
    from smsplit.ep.reference import ReferenceState

    device_names = ("nvlink_copy_engine", "nvlink", "copy_engine")
    saved = {name: registry._CLASSES[name] for name in device_names}
    for name in device_names:
        registry._CLASSES[name] = type("Shuffled", (saved[name],),
                                       {"engine_class": classmethod(lambda cls: ShuffledEngine)})
    try:
        ref = Buffer(dist.group.WORLD, backend="reference", timeout_s=10)
        auto, explicit = (Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20, timeout_s=10) for _ in range(2))
        explicit.backend = "nvlink_copy_engine"  # (a gloo group refuses it when the buffer is made)
        for buffer in (auto, explicit):  # (a GPU's environment; the tensors stay on the CPU)
            buffer._env = buffer._env._replace(cuda=True, device_sms=132)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(6, 256, generator=g).to(torch.bfloat16)
        topk = torch.randint(0, 4, (6, 2), generator=g)
        topk[0] = -1
        w = torch.rand(6, 2, generator=g)

        def calls(buffer):
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, 4)
            layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                          topk_idx=topk)
            recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(x, topk_weights=w, **layout)
            (q, s), *_ = buffer.dispatch(x.float(), **layout, fp8=True)
            y = recv_x * 2
            order = in_order(handle)
            rows = [t[order] for t in (recv_x, recv_idx, recv_w, q.view(torch.uint8), s)]
            cached32 = buffer.dispatch(x.float() * 3, handle=handle)[0][order]
            combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w)
            combined32 = buffer.combine(y.float(), handle)[0]
            wr = w.clone().requires_grad_(True)
            recv_r, _, recv_wr, *_ = buffer.dispatch(x, topk_weights=wr, **layout)
            (recv_wr * recv_r.float().sum(1, keepdim=True)).sum().backward()  # a combine of the weights only
            return [*rows, counts, cached32, combined, combined_w, combined32, wr.grad], handle

        expected, ref_handle = calls(ref)
        got, handle = calls(auto)
        for i, (a, b) in enumerate(zip(got, expected)):
            assert (a == b) if isinstance(a, list) else torch.equal(a, b), i
        assert ref_handle.transport == "reference" and isinstance(ref_handle.transport_state, ReferenceState)
        assert handle.transport == "nvlink_copy_engine" and isinstance(handle.transport_state, DeviceState)
        assert isinstance(handle.reference_state, ReferenceState)  # (the fp32 calls' plan of the device layout)
        engine = handle.transport_state.engine  # (the FP8 dispatch quantized in it; every layout planned)
        assert ("plan", Buffer.num_sms) in engine.calls and ("dispatch", Buffer.num_sms, True, False, 4) not in \
            engine.calls and any(call[:3] == ("dispatch", Buffer.num_sms, True) for call in engine.calls)
        per_rank, _, per_expert, in_rank, _ = explicit.get_dispatch_layout(topk, 4)
        recv_x, _, _, _, handle, _ = explicit.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=per_expert, topk_idx=topk)
        with pytest.raises(EPArgumentError, match="backend='reference' can$") as refused:
            explicit.combine(recv_x.float(), handle)
        assert refused.value.argument == "x" and handle.transport == "nvlink_copy_engine"
        assert torch.equal(explicit.combine(recv_x * 2, handle)[0], expected[7])  # (the buffer stays usable)
    finally:
        registry._CLASSES.update(saved)
    return True


def in_order(handle):
    """The rows of ``handle``'s dispatch sorted by (source rank, source token): the reference transport's order."""
    ends = handle.rank_prefix_matrix[:, handle.rank].long()
    src = handle.recv_src_idx.long()
    source = torch.searchsorted(ends, torch.arange(src.numel(), device=src.device), right=True)
    return torch.argsort(source * (1 << 32) + src)


def test_the_buffer_device_paths_with_an_engine_that_places_rows_out_of_order():
    assert gloo_pool(2).run(case_device_paths_of_the_buffer) == [True, True]


def case_auto_on_one_gpu(rank, world_size):
    """One rank on a GPU (NCCL): a buffer with "auto" and `num_nvl_bytes` for every transport takes
    nvlink_copy_engine for BF16 and FP8 (quantized in the kernel) dispatches and their combine, nvlink for a new
    layout with `num_worst_tokens`, the reference for fp32 values and an fp32 combine of the device layout; each
    result equals a reference buffer's on the same inputs (rows compared in the reference's order)."""
    T, H, E, K = 64, 256, 8, 2
    group = dist.group.WORLD
    auto = Buffer(group, num_nvl_bytes=Buffer.get_buffer_size_hint(T, H, 1, K, backend="auto"), num_sms=4,
                  timeout_s=30)
    ref = Buffer(group, backend="reference", num_sms=4, timeout_s=30)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    topk = torch.randint(0, E, (T, K), generator=g)
    topk[torch.rand(T, K, generator=g) < 0.3] = -1
    topk, w = topk.cuda(), torch.rand(T, K, generator=g).cuda()

    def calls(buffer):
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=topk, topk_weights=w)
        bf16 = buffer.dispatch(x, **layout)
        (q, s), *_, q_handle, _ = buffer.dispatch(x.float(), **layout, fp8=True)
        f32 = buffer.dispatch(x.float(), **layout)
        padded = buffer.dispatch(x, **layout, num_worst_tokens=T + 3)
        handle = bf16[4]
        combined = buffer.combine(bf16[0] * 2, handle, topk_weights=bf16[2])
        combined32 = buffer.combine(bf16[0].float() * 3, handle)[0]
        order, q_order = in_order(handle), in_order(q_handle)
        padded_order = in_order(padded[4])[:padded[4].num_recv_tokens]  # (the padding rows sort last)
        made = [h.transport for h in (handle, q_handle, f32[4], padded[4])]
        return made, [bf16[0][order], bf16[2][order], q.view(torch.uint8)[q_order], s[q_order], f32[0],
                      padded[0][padded_order], combined[0], combined[1], combined32]

    made, got = calls(auto)
    made_ref, expected = calls(ref)
    assert made == ["nvlink_copy_engine", "nvlink_copy_engine", "reference", "nvlink"], made
    assert made_ref == ["reference"] * 4
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), i
    return True


@pytest.mark.gpu
def test_auto_on_a_gpu_takes_the_fastest_transport_per_call():
    from ep_harness import process_pool

    assert process_pool(1, "nccl").run(case_auto_on_one_gpu) == [True]
