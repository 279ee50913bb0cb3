"""The SM-push NVLink transport: kernels compile for sm_90 (CPU), and on 2+ GPUs dispatch/combine
match an independent computation from all ranks' inputs."""

import inspect
import os
import re

import pytest
import torch
import torch.distributed as dist

from smsplit import ptx
from smsplit.ep import nvlink, nvlink_plan
from smsplit.ep.kernels import rows as kernel_rows
from smsplit.ep.kernels.common import CTX_TIMEOUT
from smsplit.ep import transport as nvlink_transport
from ep_harness import misaligned_copy, spawn
from smsplit.launch import free_port
from smsplit.ep.transport import all_gather_into_tensor
from smsplit.fp8 import quantize_1x128


# The kernels' argument types for compiling them on the CPU (`ptx.compile_for_sm90`): pointers and H compiled as
# multiples of 16, as Triton specializes them at launch; an absent tensor is None (compiled as a constant).
DISPATCH_SIGNATURE = {"x_ptr": "*i32", "scales_ptr": "*fp32", "topk_ptr": "*i64", "weights_ptr": "*fp32",
                      "pos_ptr": "*i32", "layout_ptr": "*i32", "ctx_ptr": "*i64", "state_ptr": "*i32", "T": "i32",
                      "H": "i32", "K": "i32", "rank": "i32", "R": "i32", "num_local_experts": "i32",
                      "num_worst": "i32", "trace_ptr": "*i64", "trace_tag": "i32"}
COMBINE_SIGNATURE = {"y_ptr": "*i32", "yw_ptr": "*fp32", "layout_ptr": "*i32", "pos_ptr": "*i32", "ctx_ptr": "*i64",
                     "cx_ptr": "*bf16", "split_ptr": "*i32", "out_ptr": "*bf16", "out_w_ptr": "*fp32", "T": "i32",
                     "H": "i32", "K": "i32", "R": "i32", "rank": "i32", "max_tokens": "i32", "y_rows": "i32",
                     "trace_ptr": "*i64", "trace_tag": "i32"}
# the shapes of bench/ep.py (DeepSeek-V3: hidden 7168, top-8) on 2 ranks
DISPATCH_SHAPE = {"GATE": False, "GROUPS": 64, "KP": 8, "RP": 2}


def compile_kernel(kernel, signature, constexprs, absent=("trace_ptr",), **types):
    """``ptx.compile_for_sm90`` of an NVLink kernel with 16 warps (as the transport launches them); ``absent``: the
    pointers passed as None; ``types``: argument types that differ from the signature's."""
    params = inspect.signature(kernel.fn).parameters  # (each kernel takes the signature's arguments it needs)
    sig = {name: types.get(name, kind) for name, kind in signature.items() if name not in absent and name in params}
    aligned = [name for name, kind in sig.items() if kind.startswith("*") or name.startswith("off_")] + ["H"]
    return ptx.compile_for_sm90(kernel, sig, {**constexprs, **{name: None for name in absent}}, num_warps=16,
                                aligned=aligned)


def waits(text):
    """Bounded waits (`ptx.wait_geq_sys`) in a kernel's PTX."""
    return text.count(ptx.INSTRUCTIONS["wait_geq_sys"])


@pytest.mark.compile
def test_dispatch_kernel_pushes_16_byte_vectors_and_waits_for_every_source():
    text, cubin = compile_kernel(nvlink.dispatch_kernel, DISPATCH_SIGNATURE, DISPATCH_SHAPE,
                                 absent=("scales_ptr", "trace_ptr"))
    for name in ("ld_global_nc_v4", "st_global_na_v4", "ld_acquire_sys", "atom_add_release_sys", "fence_acq_rel_sys"):
        assert ptx.INSTRUCTIONS[name] in text, name
    assert cubin[:4] == b"\x7fELF"
    assert waits(text) == 1  # for the peers' arrivals; no copies to wait for
    # a cached dispatch (no count exchange before it) waits for every peer's start signal before storing into it
    gated, _ = compile_kernel(nvlink.dispatch_kernel, DISPATCH_SIGNATURE, dict(DISPATCH_SHAPE, GATE=True),
                              absent=("scales_ptr", "trace_ptr"))
    assert waits(gated) == 2
    # FP8 input with its scales: the same 16-byte moves, e4m3 rows
    fp8, _ = compile_kernel(nvlink.dispatch_kernel, DISPATCH_SIGNATURE, DISPATCH_SHAPE)
    assert ptx.INSTRUCTIONS["st_global_na_v4"] in fp8 and waits(fp8) == 1
    assert not re.search(r"st\.global(\.\w+)*\.b8", fp8)
    # traced: the program's record at the end (SM id and the global timer)
    traced, _ = compile_kernel(nvlink.dispatch_kernel, DISPATCH_SIGNATURE, DISPATCH_SHAPE, absent=("scales_ptr",))
    assert "%smid" in traced and "%smid" not in text


@pytest.mark.compile
def test_fp8_dispatch_kernel_quantizes_packed_words_and_stores_16_byte_vectors():
    sig = {name: kind for name, kind in DISPATCH_SIGNATURE.items() if name != "scales_ptr"}
    text, _ = compile_kernel(nvlink.dispatch_fp8_kernel, sig, DISPATCH_SHAPE, x_ptr="*bf16")
    # FP8 quantization fused into the dispatch, on packed bf16 words
    for name in ("bf16x8_absmax_bits", "e4m3x4_from_bf16x4"):
        assert ptx.INSTRUCTIONS[name] in text, name
    # each thread loads its 16 adjacent values (the second load of each sector from L1) and stores their e4m3 bytes
    # as one 16-byte vector: no 8-byte halves, not one byte at a time
    assert ptx.INSTRUCTIONS["ld_global_nc_l1_v4"] in text and ptx.INSTRUCTIONS["st_global_na_v4"] in text
    assert ptx.INSTRUCTIONS["st_global_na_v2"] not in text and not re.search(r"st\.global(\.\w+)*\.b8", text)
    # nothing moves between threads but the group maxima: no barrier beyond the waits' (as many as the BF16 push
    # kernel's, whose only barriers are its waits'), and the scales go out from the layout they were computed in
    # (a tl.store of them took a shared-memory round trip and 2 bar.sync per chunk)
    bf16, _ = compile_kernel(nvlink.dispatch_kernel, DISPATCH_SIGNATURE, DISPATCH_SHAPE,
                             absent=("scales_ptr", "trace_ptr"))
    assert text.count("bar.sync") == bf16.count("bar.sync") and ptx.INSTRUCTIONS["st_global_b32"] in text
    assert waits(text) == 1
    gated, _ = compile_kernel(nvlink.dispatch_fp8_kernel, sig, dict(DISPATCH_SHAPE, GATE=True), x_ptr="*bf16")
    assert waits(gated) == 2
    for dtype in ("*fp32", "*fp16"):  # other float x: loaded and quantized as fp32 values, the same stores
        other, _ = compile_kernel(nvlink.dispatch_fp8_kernel, sig, DISPATCH_SHAPE, x_ptr=dtype)
        assert ptx.INSTRUCTIONS["e4m3x4_from_bf16x4"] in other and ptx.INSTRUCTIONS["st_global_na_v4"] in other


@pytest.mark.compile
def test_copied_dispatch_kernel_waits_for_the_copies_before_it_fills_their_holes():
    sig = dict(DISPATCH_SIGNATURE, plan_ptr="*i32")
    text, _ = compile_kernel(nvlink.dispatch_copied_kernel, sig, DISPATCH_SHAPE, absent=("scales_ptr", "trace_ptr"))
    # bounded waits: for the peers' arrivals, for this rank's copies to land before it fills their holes, and for
    # the peers' copies to land here; the X_FREE words the copy streams wait for
    assert waits(text) == 3 and ptx.INSTRUCTIONS["st_release_sys"] in text
    assert ptx.INSTRUCTIONS["ld_global_nc_v4"] in text and ptx.INSTRUCTIONS["st_global_na_v4"] in text
    gated, _ = compile_kernel(nvlink.dispatch_copied_kernel, sig, dict(DISPATCH_SHAPE, GATE=True))
    assert waits(gated) == 4


def _row_moves_of_token_loop(cubin: bytes) -> str:
    """The 16-byte row loads (L) and stores (S) of the dispatch's token loop in SASS order (Triton's own nvdisasm):
    the loop (a label up to the branch back to it) with the most row loads."""
    import subprocess
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        lines = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", f.name], capture_output=True, text=True,
                               check=True).stdout.splitlines()
    starts = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and starts.get(m.group(1), i) < i:
            loops.append("".join("L" if re.search(r"LDG\.[\w.]*\.128\.CONSTANT", b) else
                                 "S" if re.search(r"STG\.E\.NA\.128", b) else "" for b in lines[starts[m.group(1)]:i]))
    return max(loops, key=lambda moves: moves.count("L"))


@pytest.mark.compile
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("copies", [False, True], ids=["push", "copied"])
def test_dispatch_issues_a_steps_row_loads_together(ranks, copies):
    """The BF16 dispatches (SM push and beside copy engines) load a step's 2 * 4 row vectors per thread one after
    another, with at most one row store between them, as launched for 4096 tokens (T a multiple of 16; one rank: R is
    the constant 1): left to ptxas, each load went just before its store and a warp waited for up to 8 load round trips
    a step (209.7 us against 158.8 at 6, one rank, 20 SMs, H100; `smsplit.ep.kernels.dispatch.push_tokens`)."""
    kernel = nvlink.dispatch_copied_kernel if copies else nvlink.dispatch_kernel
    params = inspect.signature(kernel.fn).parameters
    sig = {name: kind for name, kind in dict(DISPATCH_SIGNATURE, plan_ptr="*i32").items()
           if name in params and name not in ("scales_ptr", "trace_ptr") and not (name == "R" and ranks == 1)}
    constexprs = dict(DISPATCH_SHAPE, GATE=True, RP=ranks, scales_ptr=None, trace_ptr=None)
    if ranks == 1:
        constexprs["R"] = 1  # (Triton specializes an integer argument of 1 as a constant)
    aligned = [name for name, kind in sig.items() if kind.startswith("*")] + ["H", "T"]
    _, cubin = ptx.compile_for_sm90(kernel, sig, constexprs, num_warps=16, aligned=aligned)
    moves = _row_moves_of_token_loop(cubin)
    # all 8 loads in one run under Triton 3.6's ptxas; Triton 3.8's puts one store between the 7th and the 8th (two
    # waits a step). The serialized loop had four runs or more.
    load_runs = [run for run in moves.split("S") if run]
    assert moves.count("L") == 8 and len(load_runs) <= 2 and max(map(len, load_runs)) >= 7, moves
    assert moves.count("S") == 8 * ranks, moves


def compile_combine(weights=True, copies=False, **constexprs):
    """The combine kernel (``copies``: the one beside copy engines, its rows in four chunks) compiled with the
    bench's shape on 2 ranks (top-k weights or none), ``constexprs`` changed."""
    absent = ("trace_ptr",) if weights else ("trace_ptr", "yw_ptr", "out_w_ptr")
    kernel = nvlink.combine_copied_kernel if copies else nvlink.combine_kernel
    shape = {"HB": 8192, "KP": 8 if weights else 1, "RP": 2, **({"CHUNKS": 4} if copies else {}), **constexprs}
    return compile_kernel(kernel, COMBINE_SIGNATURE, shape, absent=absent)


@pytest.mark.compile
def test_combine_kernel_compiles_with_its_ptx():
    text, _ = compile_combine()
    assert ptx.INSTRUCTIONS["st_global_na_v4"] in text and ptx.INSTRUCTIONS["ld_acquire_sys"] in text
    # two bounded waits (every peer has summed the previous combine; every peer's rows are in) and two signals
    # (rows pushed; sum done)
    assert waits(text) == 2 and text.count(ptx.INSTRUCTIONS["atom_add_release_sys"]) == 2
    assert re.search(r"ld\.global\.cg\.v4", text)  # the rows that came back are read 16 bytes at a time
    assert not re.search(r"ld\.global(\.\w+)*\.b16", text)
    # copy engines return the rows: more bounded waits, for their chunks' copy-done flags
    copied, _ = compile_combine(copies=True)
    assert waits(copied) > waits(text) and re.search(r"ld\.global\.cg\.v4", copied)
    # the counter bump after a copy chain never waits (a spinning kernel there could hold an SM a peer's combine
    # needs); a combine's copies wait for the peers' sums by stream memory operations
    plain, _ = ptx.compile_for_sm90(nvlink.bump_kernel, {"counter_ptr": "*i32"}, {}, num_warps=1)
    assert ptx.INSTRUCTIONS["wait_geq_sys"] not in plain


def test_per_call_values_do_not_recompile():
    """The values that change from call to call (a trace's tag, a receive size) are not specialized on (the
    kernels' parameter counts: tests/test_ep_kernel_params.py)."""
    kernels = (nvlink.dispatch_kernel, nvlink.dispatch_fp8_kernel, nvlink.dispatch_copied_kernel,
               nvlink.combine_kernel, nvlink.combine_copied_kernel)
    for kernel in kernels:
        assert "trace_tag" in [p.name for p in kernel.params if p.do_not_specialize], kernel.fn.__name__
    assert "y_rows" in [p.name for p in nvlink.combine_kernel.params if p.do_not_specialize]


def _spill_bytes(ptx_text: str) -> int:
    """Bytes of register spill stores ``ptxas -v`` reports for sm_90a (Triton's own ptxas, no GPU needed)."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx_text)
        f.flush()
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    return int(re.search(r"(\d+) bytes spill stores", report).group(1))


@pytest.mark.compile
def test_combine_kernel_does_not_spill_with_two_ranks():
    """The combine beside copy engines (the fastest transport's) at its 8 tokens a step on 2 ranks, with and without
    top-k weights, keeps its registers (with weights in the rows' loop it spilled 76 bytes and a weighted combine
    took 258 us against 204 without, at 20 SMs on 2 H200; BENCHMARKS.md §2)."""
    for weights in (False, True):
        text, _ = compile_combine(weights, copies=True)
        assert _spill_bytes(text) == 0, f"weights {weights}"


def test_a_timed_out_wait_is_named_by_what_it_waited_for():
    """Each status code the kernels write names its wait in the EPTimeoutError (rank, peer, counts); codes 4 and 10
    (this rank's or a peer's receive size passed num_worst_tokens) are ValueErrors. The host side alone, on the CPU."""
    transport = nvlink.NvlinkTransport.__new__(nvlink.NvlinkTransport)
    transport.rank, transport.timeout_s = 0, 5.0
    transport.status = torch.zeros(4, dtype=torch.int32)  # (pinned on a GPU machine; the kernels write it)
    transport._status_words = transport.status.numpy()
    for code, text in nvlink.WAITS.items():
        transport.status.copy_(torch.tensor([code, 1, 41, 42]))
        with pytest.raises(nvlink.EPTimeoutError) as caught:
            transport.raise_if_failed()
        assert caught.value.peer == 1 and caught.value.phase == text.format(peer=1) + " (saw 41, expected 42)"
        assert str(caught.value).startswith("rank 0: ") and "timeout_s=5" in str(caught.value)
    assert len({text.split(":")[0] for text in nvlink.WAITS.values()}) == 3  # notify, dispatch, combine
    transport.status.copy_(torch.tensor([4, 9000, 8192, 0]))
    with pytest.raises(ValueError, match="num_worst_tokens: rank 0 receives 9000 tokens, more than num_worst_tokens=8192"):
        transport.raise_if_failed()
    transport.status.copy_(torch.tensor([10, 1, 0, 0]))  # a peer's receive passed its num_worst_tokens
    with pytest.raises(ValueError, match="rank 1 received more tokens than its num_worst_tokens, so rank 0's combine"):
        transport.raise_if_failed()
    transport.status.zero_()
    transport.raise_if_failed()


# --- on GPUs --------------------------------------------------------------------------------------------

def _init_nccl(rank, world, port):
    """This process as rank `rank` of an NCCL group on cuda:rank; returns the device."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    return dev


def _warm_up(step):
    """``step()`` once on a side stream, outside any capture (it compiles kernels, allocates buffers, plans copies),
    then every stream synchronized; returns what it returned."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        result = step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return result


def _capture(step, rank):
    """Once every rank has got here, ``step()`` captured in a CUDA graph: ``(graph, what the captured step returned)``."""
    dist.barrier(device_ids=[rank])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


def expected_dispatch(xs, topks, weights, in_ranks, rank, num_local):
    """Rows this rank receives, computed from every rank's inputs: by source rank, then token."""
    rows_x, rows_k, rows_w, rows_src = [], [], [], []
    for x, topk, w, in_rank in zip(xs, topks, weights, in_ranks):
        idx = torch.nonzero(in_rank[:, rank]).flatten()
        rows_x.append(x[idx])
        local = topk[idx] - rank * num_local
        rows_k.append(torch.where((topk[idx] >= 0) & (local >= 0) & (local < num_local), local, -1))
        rows_w.append(w[idx])
        rows_src.append(idx.to(torch.int32))
    return torch.cat(rows_x), torch.cat(rows_k), torch.cat(rows_w), torch.cat(rows_src)


def expected_combine(x, in_rank, factor=1.0):
    """What a combine returns when every rank d sends back the rows it received of ``x`` scaled by ``(d + 1) *
    factor`` in bf16 (as the workers make them): per token, the fp32 sum of those bf16 rows over the ranks it went
    to (``in_rank``), rounded once to bf16."""
    acc = torch.zeros(x.shape, device=x.device)
    for d in range(in_rank.size(1)):
        sel = in_rank[:, d]
        acc[sel] += (x[sel].float() * (d + 1) * factor).to(torch.bfloat16).float()
    return acc.to(torch.bfloat16)


def received_order(in_ranks, rank):
    """Which row of `expected_dispatch` each received row is with bulk="copy_engine": per source, the rows of its
    copied prefix stay, its first tokens after the prefix fill the prefix's holes (`prefix_plan`, checked
    against a loop on the CPU); the source's own rank keeps token order."""
    order, first = [], 0
    for source, in_rank in enumerate(in_ranks):
        flags = in_rank[:, rank].cpu().numpy()
        sent = flags.sum()
        if source == rank:
            order += range(first, first + sent)
        else:
            _, pos = nvlink_plan.prefix_plan(flags)
            index = torch.full((sent,), -1, dtype=torch.int64)
            index[torch.from_numpy(pos[flags]).long()] = torch.arange(first, first + sent)
            order += index.tolist()
        first += sent
    return torch.tensor(order, dtype=torch.int64)


SMS = 8  # the SM count of the tests' calls, where they do not vary it
# the SM counts of `_transport_rounds`' calls, by case: each call passes its own (the combine's copy chunks follow:
# three below 20 SMs, four from 20 on)
CASE_SMS = (8, 20, 3, 16, 24, 8, 32, 5, 20, 12)


def _shorten_timeout(transport, seconds):
    """The transport's later waits give up after ``seconds`` (the NVLink kernels read it from the context table)."""
    transport.timeout_s, transport.timeout_ns = seconds, int(seconds * 1e9)
    if hasattr(transport, "ctx"):
        transport.ctx[CTX_TIMEOUT.value] = transport.timeout_ns


def _worker(rank, world, port, cases, kind="nvlink"):
    """Dispatch/combine rounds of the `kind` transport ("nvlink", "nvlink_copy_engine" or "copy_engine") against
    the oracle, one rank per GPU."""
    dev = _init_nccl(rank, world, port)
    _transport_rounds(rank, world, dist.group.WORLD, dev, cases, kind)
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


def _transport_rounds(rank, world, group, dev, cases, kind, peer_timeout=True):
    """`_worker`'s rounds on ``group``. Then, with ``peer_timeout``, a peer that never arrives: the other ranks skip
    a dispatch, rank 0 must raise naming one."""
    H, E, max_tokens = 2048, 32 // world * world, 512  # (32 experts for 2, 4 and 8 ranks)
    if kind in ("nvlink", "nvlink_copy_engine"):
        transport = nvlink.NvlinkTransport(group, dev, max_tokens=max_tokens, hidden=H, max_topk=9, timeout_s=20,
                                           bulk="sm" if kind == "nvlink" else "copy_engine")
        poison_from = transport.offsets["x"]
    else:
        from smsplit.ep.copy_engine import CopyEngineTransport

        transport = CopyEngineTransport(group, dev, max_tokens=max_tokens, hidden=H, max_topk=9, num_chunks=3,
                                        timeout_s=20)
        poison_from = transport.offsets["sx"]
        pooled = {torch.cuda.Stream(dev).cuda_stream for _ in range(70)}  # every stream torch's pool hands out
        assert not pooled & {s.cuda_stream for s in transport.copy_streams}, "a copy stream is a pooled stream"
    num_local = E // world
    for case, (T_all, K, quantize, worst) in enumerate(cases):
        g = torch.Generator(device="cpu").manual_seed(1000 + case)
        xs = [torch.randn(T_all[r], H, generator=g).to(dev, torch.bfloat16) for r in range(world)]
        topks = []
        for r in range(world):
            t = torch.randint(0, E, (T_all[r], K), generator=g)
            t[torch.rand(T_all[r], K, generator=g) < 0.2] = -1  # dropped choices
            if case == 1:
                t[:] = torch.where(t >= 0, t % num_local, t)  # every token to rank 0
            topks.append(t.to(dev))
        ws = [torch.rand(T_all[r], K, generator=g).to(dev) for r in range(world)]
        in_ranks = []
        for t in topks:
            hit = torch.zeros(t.size(0), world, dtype=torch.bool, device=dev)
            for r in range(world):
                hit[:, r] = ((t >= r * num_local) & (t < (r + 1) * num_local)).any(1)
            in_ranks.append(hit)
        sms = CASE_SMS[case % len(CASE_SMS)]
        # poison the receive area between rounds
        transport.buffer[poison_from:].fill_(0x7F)
        x_in, scales_in = quantize_1x128(xs[rank]) if quantize == "input" else (xs[rank], None)
        rx, rs, rk, rw, rsrc, layout = transport.dispatch(
            x_in, scales_in, topks[rank], ws[rank], in_ranks[rank], num_local, num_sms=sms, quantize=quantize is True,
            num_worst_tokens=worst)
        torch.cuda.synchronize()
        transport.raise_if_failed()
        if kind == "nvlink_copy_engine":  # one copy per peer of the first rows of x (FP8 made here: none, pushed)
            split = layout.splits["dispatch"]
            assert [(d, m) for d, m, _ in split.copies] == [
                (d, m) for d in range(world) if d != rank
                for m in [nvlink_plan.prefix_plan(in_ranks[rank][:, d].cpu().numpy())[0]] if m]
        ex, ek, ew, esrc = expected_dispatch(xs, topks, ws, in_ranks, rank, num_local)
        n = ex.size(0)
        if kind == "nvlink_copy_engine":  # a source's rows: holes of its copied prefix filled by later tokens
            order = received_order(in_ranks, rank)
            ex, ek, ew, esrc = ex[order], ek[order], ew[order], esrc[order]
        assert int(torch.as_tensor(layout.num_recv_tokens).item()) == n
        assert rx.size(0) == (worst if worst else n)
        if quantize:  # the fused quantization is smsplit.fp8.quantize_1x128, bit for bit; FP8 input moves as is
            ref_q, ref_s = quantize_1x128(ex)
            assert torch.equal(rx[:n].view(torch.uint8), ref_q.view(torch.uint8))
            assert torch.equal(rs[:n], ref_s)
        else:
            assert torch.equal(rx[:n], ex)
        assert torch.equal(rk[:n], ek) and torch.equal(rw[:n], ew) and torch.equal(rsrc[:n], esrc)
        if worst:
            assert (rk[n:] == -1).all() and (rw[n:] == 0).all() and (rsrc[n:] == -1).all()
            assert (rx[n:].view(torch.uint8) == 0).all() and (rs is None or (rs[n:] == 0).all())  # zero rows
        # combine: each rank scales what it received by (rank + 1)
        y = torch.zeros(rx.size(0), H, dtype=torch.bfloat16, device=dev)
        y[:n] = (ex.float() * (rank + 1)).to(torch.bfloat16)
        yw = torch.zeros(rx.size(0), K, device=dev)
        yw[:n] = ew * (rank + 1)
        out, out_w = transport.combine(y, yw, layout, num_sms=sms)
        torch.cuda.synchronize()
        transport.raise_if_failed()
        if kind == "nvlink_copy_engine":  # the combine's copies in the chunks of this call's SM count
            assert ("combine", nvlink_plan.default_combine_chunks(sms)) in layout.splits
        acc_w = torch.zeros(T_all[rank], K, device=dev)
        for d in range(world):
            acc_w[in_ranks[rank][:, d]] += ws[rank][in_ranks[rank][:, d]] * (d + 1)
        assert torch.equal(out, expected_combine(xs[rank], in_ranks[rank])), f"case {case}: combine differs"
        torch.testing.assert_close(out_w, acc_w, rtol=1e-6, atol=1e-6)
    # a peer that never arrives: the other ranks skip the dispatch, rank 0 must raise, naming one of them
    _shorten_timeout(transport, 2)
    if rank == 0 and peer_timeout:
        x = torch.randn(layout.num_tokens, H, device=dev, dtype=torch.bfloat16)
        in_rank = torch.ones(layout.num_tokens, world, dtype=torch.bool, device=dev)
        try:  # the copy-engine transport's layout is a collective: reuse the last one
            transport.dispatch(x, None, None, None, in_rank, num_local, num_sms=SMS,
                               cached=layout if kind == "copy_engine" else None)
            torch.cuda.synchronize()
            transport.raise_if_failed()
        except nvlink.EPTimeoutError as e:
            assert 0 < e.peer < world and ("notify" in e.phase or "enter the dispatch" in e.phase), str(e)
        else:
            raise AssertionError("no timeout raised")


# Rounds of `_worker`: (tokens on each rank, top-k, FP8: False (BF16), True (quantized in the dispatch) or "input"
# (x quantized before, dispatched with its scales), num_worst_tokens); each transport's test adds its own.
DISPATCH_CASES = [
    ((300, 200), 8, False, 0),     # random top-8 with drops
    ((256, 100), 6, False, 0),     # every token to rank 0
    ((0, 300), 9, False, 0),       # rank 0 sends nothing
    ((400, 512), 8, True, 0),      # FP8 fused quantization
    ((128, 64), 1, False, 1024),   # top-1, padded to num_worst_tokens
    ((333, 222), 4, True, 1024),   # FP8, padded
    ((512, 512), 9, False, 0),     # reuse after padding, full size
]
# FP8 input (DeepEP's `dispatch((x_fp8, scales), ...)`), appended after each test's own cases: with
# bulk="copy_engine" a copy engine moves the e4m3 rows of the peers whose prefixes have few holes
FP8_INPUT_CASES = [
    ((300, 257), 8, "input", 0),
    ((400, 350), 8, "input", 1024),  # padded: zero rows and scales past the received ones
]


# The rounds of both nvlink transports' tests; top-1 over 512 tokens: with bulk="copy_engine" a copied prefix would be
# half holes, the SMs move the rows
NVLINK_CASES = DISPATCH_CASES + [((512, 480), 1, False, 0)] + FP8_INPUT_CASES


@pytest.mark.gpu
@pytest.mark.multigpu
def test_nvlink_dispatch_combine_match_reference_on_two_gpus():
    spawn(_worker, args=(2, free_port(), NVLINK_CASES), nprocs=2, join=True)
    # the same with a copy engine moving the runs of rows (FP8 quantized in the dispatch: pushed by the kernel)
    spawn(_worker, args=(2, free_port(), NVLINK_CASES, "nvlink_copy_engine"), nprocs=2, join=True)


def _gather_rank_and_transport_hooks(rank, world, group):
    gathered = [None] * world
    dist.all_gather_object(gathered, rank * 10, group=group)
    # the transports' calls, as they make them on NCCL: a barrier with device_ids, an all-gather into [R, ...]
    dist.barrier(group=group, device_ids=[0])
    out = torch.empty(world, 2, 3, dtype=torch.int64)
    work = all_gather_into_tensor(out, torch.full((2, 3), rank, dtype=torch.int64), group=group, async_op=True)
    assert work.is_completed()
    return gathered, out[:, 1, 2].tolist(), nvlink.symmetric_buffer is not nvlink_transport.symmetric_buffer


def test_ranks_on_one_gpu_share_a_group_with_the_transports_hooks_in_place():
    from ep_harness import run_ranks_on_one_gpu

    assert run_ranks_on_one_gpu(3, _gather_rank_and_transport_hooks) == [([0, 10, 20], [0, 1, 2], True)] * 3


def _fails_on_rank_2(rank, world, group):
    if rank == 2:
        raise ValueError("rank 2 gives up")
    return rank


def _rank_1_never_returns(rank, world, group):
    if rank == 1:
        import time
        time.sleep(60)
    return rank


def _rank_1_exits(rank, world, group):
    if rank == 1:
        os._exit(3)
    return rank


def _rank_2_fails_rank_1_never_returns(rank, world, group):
    return _rank_1_never_returns(rank, world, group) if rank == 1 else _fails_on_rank_2(rank, world, group)


def test_ranks_on_one_gpu_report_a_failing_or_missing_rank_without_hanging(monkeypatch):
    import ep_harness as testing
    from ep_harness import run_ranks_on_one_gpu

    with pytest.raises(AssertionError, match=r"(?s)--- rank 2 ---.*ValueError: rank 2 gives up"):
        run_ranks_on_one_gpu(3, _fails_on_rank_2, timeout_s=60)
    monkeypatch.setattr(testing, "AFTER_FAILURE_S", 2.0)  # once rank 2 has failed, rank 1 gets 2 s, not 60
    with pytest.raises(AssertionError, match=r"(?s)ValueError: rank 2 gives up.*"
                                             r"ranks \[1\] did not return within 2.0 s of rank 2's failure"):
        run_ranks_on_one_gpu(3, _rank_2_fails_rank_1_never_returns, timeout_s=60)
    with pytest.raises(AssertionError, match=r"ranks \[1\] did not return within 3"):
        run_ranks_on_one_gpu(2, _rank_1_never_returns, timeout_s=3)  # (counted from when every rank has joined)
    with pytest.raises(AssertionError, match=r"--- rank 1 ---\nthe process ended with exit code 3"):
        run_ranks_on_one_gpu(2, _rank_1_exits, timeout_s=60)


def cases_for_ranks(world, cases):
    """``cases`` (rounds of `_transport_rounds` for 2 ranks) for ``world`` ranks: ranks 0 and 1 keep their token
    counts, the others get counts from them (0 to 512); a padded case pads to every token of every rank. Each case
    keeps its index, and with it the per-index settings of `_transport_rounds` (for ``NVLINK_CASES``, those of the
    2-GPU test: FP8 input moved by SMs and by a copy engine)."""
    out = []
    for (a, b), K, quantize, worst in cases:
        tokens = tuple([a, b] + [(a * (r + 1) + b * r) % 513 for r in range(2, world)])
        out.append((tokens, K, quantize, world * 512 if worst else 0))
    return out


def _rounds_on_one_gpu(rank, world, group, kind, cases):
    # the missing-peer case for `nvlink` only: the copy-engine transports leave unbounded copy-stream waits for the
    # peers that skipped the call, which this rank's final synchronize would wait on (a 2-GPU rank ends without one)
    _transport_rounds(rank, world, group, torch.device("cuda", 0), cases, kind, peer_timeout=kind == "nvlink")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("world", [3, 4, 8])
@pytest.mark.parametrize("kind", ["nvlink", "nvlink_copy_engine", "copy_engine"])
def test_transports_with_more_ranks_than_gpus(kind, world):
    """`_transport_rounds` with 3, 4 and 8 ranks sharing one GPU (`run_ranks_on_one_gpu`): the kernels' paths for
    more than 2 ranks, which the 2-GPU tests do not take, against the same oracle."""
    from ep_harness import run_ranks_on_one_gpu

    run_ranks_on_one_gpu(world, _rounds_on_one_gpu, kind, cases_for_ranks(world, NVLINK_CASES),
                         timeout_s=150)


def _every_ranks_tokens(seed, world, dev, T, H, E, K):
    """Every rank's tokens, top-k expert ids (uniform, no drops) and destination ranks, drawn from one seed, so that
    each rank can compute any rank's expected result."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    num_local = E // world
    xs = [torch.randn(T, H, generator=g).to(dev, torch.bfloat16) for _ in range(world)]
    topks = [torch.randint(0, E, (T, K), generator=g).to(dev) for _ in range(world)]
    in_ranks = [torch.stack([((t >= r * num_local) & (t < (r + 1) * num_local)).any(1) for r in range(world)], 1)
                for t in topks]
    return xs, topks, in_ranks


def _two_gpu_case(rank, world, port, T, H, seed, bulk):
    """A process's NCCL group, an 8-SM transport (``bulk``) for T tokens of hidden H (32 experts, top-8), and every
    rank's inputs from ``seed`` (`_every_ranks_tokens`): ``(dev, transport, num_local, xs, topks, in_ranks)``."""
    dev = _init_nccl(rank, world, port)
    E, K = 32, 8
    transport = nvlink.NvlinkTransport(dist.group.WORLD, dev, max_tokens=T, hidden=H, max_topk=K, timeout_s=20,
                                       bulk=bulk)
    return (dev, transport, E // world, *_every_ranks_tokens(seed, world, dev, T, H, E, K))


def _combines_in_a_row_worker(rank, world, port, bulk):
    """Combines of one dispatch queued back to back (no dispatch, no host synchronization between) while rank 1's
    GPU is slowed by a GEMM on another stream: each result must still be its own inputs' sum (a combine must not
    overwrite the rows a peer still sums for the previous one)."""
    dev, transport, num_local, xs, topks, in_ranks = _two_gpu_case(rank, world, port, 1024, 7168, 7, bulk)
    rx, _, _, _, rsrc, layout = transport.dispatch(xs[rank], None, topks[rank], None, in_ranks[rank], num_local,
                                                   num_sms=SMS)
    torch.cuda.synchronize()
    n = int(torch.as_tensor(layout.num_recv_tokens).item())
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream(dev)
    scales = (1.0, -2.0, 3.0, 0.5)
    for round_ in range(3):
        ys = [(rx[:n].float() * (rank + 1) * f).to(torch.bfloat16) for f in scales]
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        if rank == 1:  # slows this rank's sums: the other rank finishes each combine first
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(4):
                    a @ a
        outs = [transport.combine(y, None, layout, num_sms=SMS)[0] for y in ys]
        torch.cuda.synchronize()
        transport.raise_if_failed()
        for f, out in zip(scales, outs):
            assert torch.equal(out, expected_combine(xs[rank], in_ranks[rank], f)), \
                f"rank {rank}, round {round_}: combine x{f} differs"
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("bulk", ["sm", "copy_engine"])
def test_combines_in_a_row_keep_each_ones_rows(bulk):
    spawn(_combines_in_a_row_worker, args=(2, free_port(), bulk), nprocs=2, join=True)


def _pooled_streams_worker(rank, world, port):
    """Cached dispatches and their combines, each round on the next of torch's pooled streams
    (``torch.cuda.Stream()`` hands out the same 32 per priority in turn), new rows each round, the round trip
    checked: in session 17 the copy stream was one of those streams, and a dispatch run on it waited for its own
    copies, queued behind it there, until its timeout."""
    dev, transport, num_local, xs, topks, in_ranks = _two_gpu_case(rank, world, port, 256, 2048, 13, "copy_engine")
    pooled = {torch.cuda.Stream(dev).cuda_stream for _ in range(70)}
    assert len(pooled) < 70  # pooled: handed out again
    assert transport.copy_stream.cuda_stream not in pooled and transport.reset_stream.cuda_stream not in pooled
    *_, layout = transport.dispatch(xs[rank], None, topks[rank], None, in_ranks[rank], num_local, num_sms=SMS)
    torch.cuda.synchronize()
    n = int(torch.as_tensor(layout.num_recv_tokens).item())
    for round_ in range(40):
        f = (-2.0) ** (round_ % 4)  # exact in bf16: each round's rows differ, stale ones would show
        x = xs[rank] * f
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            rx, *_ = transport.dispatch(x, None, topks[rank], None, in_ranks[rank], num_local, num_sms=SMS,
                                        cached=layout)
            y = (rx[:n].float() * (rank + 1)).to(torch.bfloat16)
            out, _ = transport.combine(y, None, layout, num_sms=SMS)
        stream.synchronize()
        transport.raise_if_failed()
        assert torch.equal(out, expected_combine(x, in_ranks[rank])), f"rank {rank}, round {round_}: round trip differs"
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_calls_on_any_pooled_stream_never_wait_for_their_own_copies():
    spawn(_pooled_streams_worker, args=(2, free_port()), nprocs=2, join=True)


def _late_copies_worker(rank, world, port):
    """A combine whose copies start late (a sleep queued on the copy stream first), eager and replayed from a CUDA
    graph, while its kernel sums at once: each block of tokens must wait for the flag of the last copied chunk that
    holds one of its rows before it sums. At 8 SMs every row received from the peer comes back in three chunks (0.5,
    0.8, 1.0 of them), and the blocks of 8 tokens each hold rows of one or two chunks."""
    dev, transport, num_local, xs, topks, in_ranks = _two_gpu_case(rank, world, port, 512, 2048, 11, "copy_engine")
    assert nvlink_plan.default_combine_chunks(SMS) == (0.5, 0.8, 1.0)
    rx, _, _, _, _, layout = transport.dispatch(xs[rank], None, topks[rank], None, in_ranks[rank], num_local,
                                                num_sms=SMS)
    torch.cuda.synchronize()
    n = int(torch.as_tensor(layout.num_recv_tokens).item())
    for round_, f in enumerate((1.0, -2.0, 3.0, 0.5)):  # new rows each round: stale ones would show
        y = (rx[:n].float() * (rank + 1) * f).to(torch.bfloat16)
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        with torch.cuda.stream(transport.copy_stream):
            torch.cuda._sleep(2_000_000)  # about a millisecond before this rank's copies may start
        out, _ = transport.combine(y, None, layout, num_sms=SMS)
        torch.cuda.synchronize()
        transport.raise_if_failed()
        assert torch.equal(out, expected_combine(xs[rank], in_ranks[rank], f)), \
            f"rank {rank}, round {round_}: combine differs"
    # the same replayed from a CUDA graph: no host between the kernel's start and the copies'
    y = torch.empty(n, transport.hidden, dtype=torch.bfloat16, device=dev)

    def step():
        transport.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(transport.copy_stream):
            torch.cuda._sleep(2_000_000)
        return transport.combine(y, None, layout, num_sms=SMS)[0]
    _warm_up(step)
    graph, out = _capture(step, rank)
    for round_, f in enumerate((-1.0, 2.0, 0.25)):
        y.copy_((rx[:n].float() * (rank + 1) * f).to(torch.bfloat16))
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        graph.replay()
        torch.cuda.synchronize()
        transport.raise_if_failed()
        assert torch.equal(out, expected_combine(xs[rank], in_ranks[rank], f)), \
            f"rank {rank}, replay {round_}: combine differs"
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_combine_sums_no_row_before_its_chunk_lands():
    spawn(_late_copies_worker, args=(2, free_port()), nprocs=2, join=True)


def in_reference_order(t, handle, rank):
    """Rows ``t`` received with ``handle`` sorted by (source rank, source token index) (the rows past the received
    tokens stay): the order of the reference backend."""
    prefix = handle.rank_prefix_matrix[:, rank].long()
    src = handle.recv_src_idx.long()
    n = src.numel()
    source = torch.searchsorted(prefix, torch.arange(n, device=src.device), right=True)
    order = torch.argsort(source * (1 << 32) + src)
    return torch.cat([t[:n][order], t[n:]])


def _cached_dispatches_worker(rank, world, port, bulk, quantize):
    """Cached dispatches queued back to back (no host synchronization between) while rank 1 reads each one's
    results late (a sleep queued before its copy of them): a dispatch must not write into a peer's receive area
    before that peer has started it (so has read the previous results), or rank 1 copies the next dispatch's rows.
    Then a cached dispatch that rank 1 never makes: rank 0 raises EPTimeoutError naming rank 1 and the dispatch,
    and its copy stream (waiting for rank 1's start) does not hang. ``quantize``: False (BF16) or "pushed" (FP8
    quantized in the dispatch, its rows pushed by the kernel)."""
    from smsplit.fp8 import quantize_1x128

    dev, transport, num_local, xs, topks, in_ranks = _two_gpu_case(rank, world, port, 256, 2048, 5, bulk)
    quantize = bool(quantize)
    *_, layout = transport.dispatch(xs[rank], None, topks[rank], None, in_ranks[rank], num_local, num_sms=SMS,
                                    quantize=quantize)
    torch.cuda.synchronize()
    transport.raise_if_failed()
    order = received_order(in_ranks, rank) if bulk == "copy_engine" else slice(None)
    scales = (2.0, -1.0, 0.5, 3.0)
    for round_ in range(2):
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        got = []
        for f in scales:
            x = (xs[rank].float() * f).to(torch.bfloat16)
            rx, rs, *_ = transport.dispatch(x, None, topks[rank], None, in_ranks[rank], num_local, num_sms=SMS,
                                            quantize=quantize, cached=layout)
            if rank == 1:
                torch.cuda._sleep(2_000_000)  # about a millisecond before it reads what it received
            got.append((rx.clone(), rs.clone() if rs is not None else None))
        torch.cuda.synchronize()
        transport.raise_if_failed()
        for f, (rx, rs) in zip(scales, got):
            ex = expected_dispatch([(x.float() * f).to(torch.bfloat16) for x in xs], topks, topks, in_ranks, rank,
                                   num_local)[0][order]
            n = ex.size(0)
            if quantize:
                ref_q, ref_s = quantize_1x128(ex)
                ok = torch.equal(rx[:n].view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(rs[:n], ref_s)
            else:
                ok = torch.equal(rx[:n], ex)
            assert ok, f"rank {rank}, round {round_}: the dispatch of x{f} received other rows"
    _shorten_timeout(transport, 2)
    if rank == 0:  # rank 1 never makes this dispatch
        transport.dispatch(xs[rank], None, topks[rank], None, in_ranks[rank], num_local, num_sms=SMS,
                           quantize=quantize, cached=layout)
        torch.cuda.synchronize()
        try:
            transport.raise_if_failed()
        except nvlink.EPTimeoutError as e:
            assert e.peer == 1 and "dispatch" in e.phase, str(e)
        else:
            raise AssertionError("no timeout raised")
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("bulk, quantize", [("sm", False), ("sm", "pushed"), ("copy_engine", False),
                                            ("copy_engine", "pushed")])
def test_cached_dispatches_in_a_row_wait_for_each_peer_to_read_the_last(bulk, quantize):
    spawn(_cached_dispatches_worker, args=(2, free_port(), bulk, quantize), nprocs=2, join=True)


def _routed_tokens(g, n, H, E, K, dev):
    """``n`` random bf16 tokens of hidden size ``H``, their top-``K`` of ``E`` experts (about a fifth dropped: -1)
    and their weights, from generator ``g``."""
    x = torch.randn(n, H, generator=g).to(dev, torch.bfloat16)
    topk = torch.randint(0, E, (n, K), generator=g)
    topk[torch.rand(n, K, generator=g) < 0.2] = -1
    return x, topk.to(dev), torch.rand(n, K, generator=g).to(dev)


def _layout_kwargs(buf, topk, weights, E, **extra):
    """`Buffer.dispatch`'s layout keywords for ``topk`` (from `buf.get_dispatch_layout`), the top-k and ``extra``."""
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk, topk_weights=weights, **extra)


def _assert_outputs_equal(got, expected, label):
    for i, (a, b) in enumerate(zip(got, expected)):
        if isinstance(a, list):
            assert a == b, f"{label}: output {i}: {a} != {b}"
        else:
            assert torch.equal(a, b), f"{label}: output {i} differs"


def _poison_device_buffers(buf, rank):
    """Every device transport of ``buf`` filled with 0x7F from its receive area ("x", else "sx") on, between two
    barriers: the first once every peer is done with the last call's rows, the second before any peer writes again."""
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])  # (every peer done with them)
    from smsplit.ep.device import DeviceTransport

    for transport in buf._transports.values():
        for engine in transport.engines() if isinstance(transport, DeviceTransport) else ():
            engine.buffer[engine.offsets["x" if "x" in engine.offsets else "sx"]:].fill_(0x7F)
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])


def _buffer_worker(rank, world, port, backend="nvlink", H=2048, K=6, routing="random"):
    """Buffer(backend=backend) against Buffer(backend="reference") on the same inputs: hidden size H, top-K, tokens
    routed at random ("random"), every token to rank 0 ("one_rank"), or rank 0 sending none ("silent_rank")."""
    from smsplit.ep import Buffer

    dev = _init_nccl(rank, world, port)
    group = dist.group.WORLD
    T, E = 256, 16
    hint = Buffer.get_buffer_size_hint(T, H, world, K, backend=backend)
    fast = Buffer(group, num_nvl_bytes=hint, num_sms=8, backend=backend, timeout_s=30)
    ref = Buffer(group, backend="reference", timeout_s=30)
    for seed in range(3):
        # the last seed's rows in the device buffer poisoned: this seed's results must not read any of them
        _poison_device_buffers(fast, rank)
        g = torch.Generator(device="cpu").manual_seed(100 * seed + rank)
        x, topk, w = _routed_tokens(g, T - 17 * rank - 30 * seed, H, E, K, dev)
        if routing == "one_rank":
            topk = torch.where(topk >= 0, topk % (E // world), topk)
        elif routing == "silent_rank" and rank == 0:
            topk = torch.full_like(topk, -1)
        biases = [torch.randn(x.shape, generator=g).to(dev, torch.bfloat16) for _ in range(2)]
        grad_out = torch.randn(x.shape, generator=g).to(dev)
        outs, with_bias = {}, {}
        for name, buf in ((backend, fast), ("reference", ref)):
            common = _layout_kwargs(buf, topk, w, E)
            bf16 = buf.dispatch(misaligned_copy(x), **common)  # the kernels read 16-byte vectors: the Buffer realigns
            q = buf.dispatch(x, **common, fp8=True, num_worst_tokens=world * T - 8 * seed)
            q32 = buf.dispatch(x.float() * 3.0, **common, fp8=True, dequantize=True)  # fp32 quantized in the kernel
            qin = buf.dispatch(quantize_1x128(x * 2), **common)  # FP8 input, DeepEP's (x_fp8, scales)
            cached = buf.dispatch(x * 2, handle=bf16[4])[0]  # cached: new values along a layout made before
            cached_q = buf.dispatch(x * 3, handle=q[4], fp8=True)[0]
            xg = x.clone().requires_grad_(True)
            recv, _, _, _, handle, _ = buf.dispatch(xg, **common)
            back, _, _ = buf.combine((recv.float() * (rank + 2)).to(torch.bfloat16), handle)
            back.float().pow(2).sum().backward()
            combined, combined_w, _ = buf.combine(misaligned_copy(bf16[0]), bf16[4], topk_weights=bf16[2])
            # fp32 rows: the device backends combine bf16 only, so an explicit one refuses them, naming the backend
            # that can (backend="auto" would take it); what such a handle sends through the reference transport
            # (the weights-only backward passes) follows the rows where the device transport put them
            if name == backend:
                from smsplit.ep import EPArgumentError

                with pytest.raises(EPArgumentError, match="backend='reference' can") as refused:
                    buf.combine(bf16[0].float() * 3.0, bf16[4], topk_weights=bf16[2])
                assert refused.value.argument == "x", str(refused.value)
            wr = w.clone().requires_grad_(True)
            recv_r, _, recv_wr, _, _, _ = buf.dispatch(x, **{**common, "topk_weights": wr})
            (recv_wr * recv_r.float().sum(1, keepdim=True)).sum().backward()  # a combine of the weights only
            cw = bf16[2].clone().requires_grad_(True)
            cw_out = buf.combine(bf16[0], bf16[4], topk_weights=cw)[1]
            (cw_out * torch.arange(1.0, K + 1, device=dev)).pow(2).sum().backward()  # a dispatch of the weights only
            cw_grad = in_reference_order(cw.grad, bf16[4], rank) if name == "nvlink_copy_engine" else cw.grad
            # a combine with two biases, differentiable in the rows and both biases
            cb = bf16[0].clone().requires_grad_(True)
            bias_g = tuple(b.clone().requires_grad_(True) for b in biases)
            with_bias[name] = buf.combine(cb, bf16[4], bias=bias_g)[0]
            (with_bias[name].float() * grad_out).sum().backward()
            cb_grad = in_reference_order(cb.grad, bf16[4], rank) if name == "nvlink_copy_engine" else cb.grad
            if name == backend and seed == 0:  # wider than the peers' weight slots: rejected on every rank
                with pytest.raises(ValueError, match="topk_weights"):
                    buf.combine(bf16[0], bf16[4], topk_weights=torch.rand(bf16[0].size(0), 17, device=dev))
            bf16_rows, q_rows, q32_rows = bf16[:3], (q[0][0].view(torch.uint8), q[0][1], q[1]), q32[0]
            qin_rows = (qin[0][0].view(torch.uint8), qin[0][1], qin[1])
            cached_rows = (cached, cached_q[0].view(torch.uint8), cached_q[1])
            if name == "nvlink_copy_engine":  # received rows in source, then token order, as the reference has them
                cached_rows = (in_reference_order(cached, bf16[4], rank),
                               *(in_reference_order(t, q[4], rank) for t in cached_rows[1:]))
                bf16_rows = [in_reference_order(t, bf16[4], rank) for t in bf16_rows]
                q_rows = [in_reference_order(t, q[4], rank) for t in q_rows]
                q32_rows = in_reference_order(q32_rows, q32[4], rank)
                qin_rows = [in_reference_order(t, qin[4], rank) for t in qin_rows]
            outs[name] = (*bf16_rows, bf16[3], *q_rows, combined, combined_w, back, xg.grad, q32_rows, *qin_rows,
                          wr.grad, cw_grad, cb_grad, *(b.grad for b in bias_g), *cached_rows)
        _assert_outputs_equal(outs[backend], outs["reference"], f"seed {seed}")
        # the device kernels round the sum to bf16 before the biases are added: one rounding more (half a unit in
        # the last place of the sum); a wrong row or bias would be off by about 1
        torch.testing.assert_close(with_bias[backend].float(), with_bias["reference"].float(), rtol=2 ** -7,
                                   atol=2 ** -4)
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


def _buffer_rounds_worker(rank, world, port, backend):
    """One device Buffer through rounds that change what moves (hidden size, top-k, token count, BF16 / FP8
    quantized in the call / FP8 input, num_worst_tokens, expert_alignment), its buffers poisoned before each round,
    some rounds with their input written late on another stream (given as `previous_event`, DeepEP's
    `EventOverlap(EventHandle())`) and `async_finish`: every round's results equal the reference backend's. Between
    rounds, calls that one rank makes wrongly (an expert id out of range, a CPU tensor, more tokens than
    `num_nvl_bytes` holds) raise EPArgumentError naming that argument on every rank, and the buffer stays usable."""
    from smsplit.ep import Buffer, EPArgumentError
    from smsplit.ep.event import EventHandle, EventOverlap

    dev = _init_nccl(rank, world, port)
    group = dist.group.WORLD
    T, E, last = 192, 16, world - 1
    # (hidden, top-k, what a second dispatch moves, expert_alignment, input written late on another stream)
    rounds = [(2048, 1, "fp8", 1, False), (4096, 9, "fp8_input", 8, True), (2048, 4, "fp8_worst", 4, True),
              (4096, 6, "fp8_worst", 2, False), (2048, 9, "fp8_input", 1, True)]
    nbytes = max(Buffer.get_buffer_size_hint(T, H, world, K, fp8=fp8, backend=backend)
                 for H, K, *_ in rounds for fp8 in (False, True))
    fast = Buffer(group, num_nvl_bytes=nbytes, num_sms=8, backend=backend, timeout_s=30)
    ref = Buffer(group, backend="reference", timeout_s=30)
    side = torch.cuda.Stream(dev)

    def poisoned(t):  # bytes 0x7F: NaN in e4m3, about 3.4e38 in bf16 and fp32
        p = torch.empty_like(t)
        p.view(torch.uint8).fill_(0x7F)
        return p

    def parts(t):  # a tensor, or DeepEP's (x_fp8, scales), as a tuple of tensors
        return (t,) if isinstance(t, torch.Tensor) else t

    def rejected(argument, call):
        with pytest.raises(EPArgumentError) as caught:
            call()
        assert caught.value.argument == argument, (rank, argument, str(caught.value))

    for r, (H, K, second, align, late) in enumerate(rounds):
        _poison_device_buffers(fast, rank)  # the last round's rows poisoned
        g = torch.Generator(device="cpu").manual_seed(500 + 10 * r + rank)
        x, topk, w = _routed_tokens(g, T - 11 * rank - 7 * r, H, E, K, dev)
        if r == 1:  # wrong on the last rank only; every rank raises, before anything moves
            common = _layout_kwargs(fast, topk, w, E)
            wrong_ids = torch.where(topk >= 0, E, topk) if rank == last else topk
            rejected("topk_idx", lambda: fast.dispatch(x, **{**common, "topk_idx": wrong_ids}))
            rejected("x", lambda: fast.dispatch(x.cpu() if rank == last else x, **common))
            many = 3 * T if rank == last else x.size(0)  # more than the buffer holds at this hidden size
            xm, topkm, wm = _routed_tokens(g, many, H, E, K, dev)
            rejected("num_nvl_bytes", lambda: fast.dispatch(xm, **_layout_kwargs(fast, topkm, wm, E)))
        outs = {}
        # a late round's calls first with their inputs as they are (every kernel compiled, every copy plan made: a
        # compilation would outlast the sleep below), then again with them written late
        passes = [(backend, fast, False)] + [(backend, fast, True)] * late + [("reference", ref, False)]
        for name, buf, written_late in passes:
            common = _layout_kwargs(buf, topk, w, E, expert_alignment=align)
            inputs = {"bf16": x, "fp8": x, "fp8_worst": x, "fp8_input": quantize_1x128(x)}
            previous = None
            if written_late:  # the inputs poisoned, then written on `side` after a sleep: the calls must wait for
                # them
                written = {kind: (poisoned(t) if isinstance(t, torch.Tensor) else tuple(map(poisoned, t)))
                           for kind, t in inputs.items()}
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch.cuda._sleep(int(2e8))  # about 0.1 s
                    for kind, t in inputs.items():
                        for dst, src in zip(parts(written[kind]), parts(t)):
                            dst.copy_(src)
                    previous = EventOverlap(EventHandle())
                inputs = written
            bf16 = buf.dispatch(inputs["bf16"], **common, previous_event=previous, async_finish=written_late)
            bf16[5].current_stream_wait()
            extra = {"fp8": dict(fp8=True), "fp8_worst": dict(fp8=True, num_worst_tokens=world * T),
                     "fp8_input": {}}[second]
            q = buf.dispatch(inputs[second], **common, **extra, previous_event=previous, async_finish=written_late)
            q[5].current_stream_wait()
            combined, combined_w, event = buf.combine(bf16[0], bf16[4], topk_weights=bf16[2],
                                                      async_finish=written_late)
            event.current_stream_wait()
            bf16_rows = bf16[:3]
            q_rows = (q[0][0].view(torch.uint8), q[0][1], q[1], q[2])
            if name == "nvlink_copy_engine":  # received rows in source, then token order, as the reference has them
                bf16_rows = [in_reference_order(t, bf16[4], rank) for t in bf16_rows]
                q_rows = [in_reference_order(t, q[4], rank) for t in q_rows]
            outs[name, written_late] = (*bf16_rows, bf16[3], *q_rows, q[3], combined, combined_w,
                                        bf16[4].rank_prefix_matrix, q[4].rank_prefix_matrix)
        for written_late in (False, True)[:1 + late]:
            _assert_outputs_equal(outs[backend, written_late], outs["reference", False],
                                  f"round {r}" + ", inputs written late" * written_late)
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


def _buffer_sms_worker(rank, world, port, backend):
    """A Buffer made without num_sms follows `Buffer.set_num_sms` and each call's `config.num_sms`: its kernels run
    that many programs (the count each of its transport calls gets) and every result equals the reference backend's."""
    from smsplit.ep import Buffer, Config

    sms_seen = []  # the num_sms of every transport call, as the calls pass it
    for name in ("dispatch", "combine"):
        def spy(self, *args, _original=getattr(nvlink.NvlinkTransport, name), **kwargs):
            sms_seen.append(kwargs["num_sms"])
            return _original(self, *args, **kwargs)
        setattr(nvlink.NvlinkTransport, name, spy)
    dev = _init_nccl(rank, world, port)
    group = dist.group.WORLD
    T, E, K, H = 256, 16, 6, 2048
    fast = Buffer(group, num_nvl_bytes=Buffer.get_buffer_size_hint(T, H, world, K, backend=backend),
                  backend=backend, timeout_s=30)
    ref = Buffer(group, backend="reference", timeout_s=30)
    for step, (set_to, config, expected) in enumerate([(None, None, 20), (None, Config(12), 12), (16, None, 16),
                                                        (None, Config(8, 6, 256, 6, 128), 8), (24, None, 24)]):
        if set_to is not None:
            Buffer.set_num_sms(set_to)
        g = torch.Generator(device="cpu").manual_seed(300 + 10 * step + rank)
        x, topk, w = _routed_tokens(g, T - 13 * rank - 7 * step, H, E, K, dev)
        outs = {}
        for name, buf in ((backend, fast), ("reference", ref)):
            sms_seen.clear()
            common = _layout_kwargs(buf, topk, w, E, config=config)
            bf16 = buf.dispatch(x, **common)
            q = buf.dispatch(x, **common, fp8=True)
            combined, combined_w, _ = buf.combine(bf16[0], bf16[4], topk_weights=bf16[2], config=config)
            if name != "reference":
                assert len(sms_seen) == 3 and set(sms_seen) == {expected}, (step, sms_seen)
            rows = [bf16[0], q[0][0].view(torch.uint8), q[0][1]]
            if name == "nvlink_copy_engine":
                rows = [in_reference_order(rows[0], bf16[4], rank)] + [in_reference_order(t, q[4], rank)
                                                                      for t in rows[1:]]
            outs[name] = (*rows, combined, combined_w)
        _assert_outputs_equal(outs[backend], outs["reference"], f"step {step}")
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["nvlink", "nvlink_copy_engine"])
def test_buffer_sm_count_follows_set_num_sms_and_config(backend):
    spawn(_buffer_sms_worker, args=(2, free_port(), backend), nprocs=2, join=True)


@pytest.mark.gpu
@pytest.mark.multigpu
# 7168: DeepSeek-V3's width; 2176: 17 groups of 128, a partial last chunk in the FP8 quantization
@pytest.mark.parametrize("hidden", [2048, 2176, 7168])
def test_buffer_nvlink_backend_equals_reference_backend(hidden):
    spawn(_buffer_worker, args=(2, free_port(), "nvlink", hidden), nprocs=2, join=True)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["nvlink", "nvlink_copy_engine", "copy_engine"])
@pytest.mark.parametrize("hidden,topk,routing", [(7168, 9, "random"), (2048, 1, "random"), (4096, 4, "one_rank"),
                                                 (2048, 8, "silent_rank")])
def test_buffer_device_backends_equal_reference_for_any_top_k_and_routing(backend, hidden, topk, routing):
    spawn(_buffer_worker, args=(2, free_port(), backend, hidden, topk, routing), nprocs=2, join=True)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["nvlink", "nvlink_copy_engine", "copy_engine"])
def test_one_buffer_through_rounds_of_other_shapes_and_rejected_calls(backend):
    spawn(_buffer_rounds_worker, args=(2, free_port(), backend), nprocs=2, join=True)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_buffer_nvlink_copy_engine_backend_equals_reference_backend():
    # the same rows (compared in source, token order: the copies fill holes with later tokens), sums and gradients
    spawn(_buffer_worker, args=(2, free_port(), "nvlink_copy_engine", 7168), nprocs=2, join=True)


def _small_buffer_dispatched(rank, world, port, backend, timeout_s, seed):
    """This process as rank `rank` of an NCCL group, a Buffer of `backend` (8 SMs) and one uncached dispatch of 128
    random tokens (hidden 2048, top-4 of 16 experts): ``(buffer, x, received rows, handle)``."""
    from smsplit.ep import Buffer

    dev = _init_nccl(rank, world, port)
    T, H, E, K = 128, 2048, 16, 4
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=Buffer.get_buffer_size_hint(T, H, world, K, backend=backend),
                 num_sms=8, backend=backend, timeout_s=timeout_s)
    g = torch.Generator(device="cpu").manual_seed(seed + rank)
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    topk = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
    recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert, topk_idx=topk)
    return buf, x, recv, handle


def _buffer_runs_ahead_worker(rank, world, port, backend):
    """A combine called while the GPU still runs work queued after its dispatch (a 0.5 s sleep, as an expert's
    GEMMs would be): the call waits for the peers' headers, not for the GPU (neither the sleep nor this rank's
    dispatch kernels), so the host has queued it before the sleep ends; its result is that of the same calls made
    with the GPU idle."""
    import time

    buf, x, recv, handle = _small_buffer_dispatched(rank, world, port, backend, timeout_s=30, seed=7)
    expected_out, _, _ = buf.combine(recv, handle)
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    again, *_ = buf.dispatch(x, handle=handle)
    torch.cuda._sleep(int(1e9))  # about 0.5 s at Hopper's clocks
    t0 = time.perf_counter()
    out, _, _ = buf.combine(again, handle)
    queued_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert queued_s < 0.25, f"rank {rank}: the combine took {queued_s:.3f} s on the host: it waited for the sleep"
    assert torch.equal(again, recv) and torch.equal(out, expected_out)
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["nvlink", "nvlink_copy_engine"])
def test_a_buffer_combine_does_not_wait_for_work_queued_after_its_dispatch(backend):
    spawn(_buffer_runs_ahead_worker, args=(2, free_port(), backend), nprocs=2, join=True)


def _buffer_kernel_timeout_worker(rank, world, port, backend):
    """A kernel wait that times out is reported by the first Buffer call after it, on every rank, without any call
    waiting for the GPU: rank 1's GPU sleeps about 3 s before a cached dispatch, so rank 0's dispatch kernel gives
    up waiting for it (timeout_s=1). Both ranks then call combine every 0.25 s: the calls made before the timeout
    go through (no host wait for the failed kernel), and the first one after it raises EPError naming rank 0 and,
    there, the wait that timed out."""
    import time

    from smsplit.ep import EPError

    buf, x, recv, handle = _small_buffer_dispatched(rank, world, port, backend, timeout_s=1, seed=11)
    # every kernel compiled and every copy plan made before the sleep: a first launch loads a module, and a plan
    # reads the layout, both waiting for the GPU (a host held up past timeout_s fails the header exchange instead)
    buf.combine(recv, handle)
    buf.dispatch(x, handle=handle)
    buf.combine(recv, handle)
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    if rank == 1:
        torch.cuda._sleep(int(6e9))  # about 3 s at Hopper's clocks
    buf.dispatch(x, handle=handle)
    raised_at, message = None, ""
    for call in range(40):
        time.sleep(0.25)
        try:
            buf.combine(recv, handle)
        except EPError as e:
            raised_at, message = call, str(e)
            break
    torch.cuda.synchronize()
    assert raised_at is not None, f"rank {rank}: no call raised within 10 s of the timeout"
    assert raised_at >= 1, f"rank {rank}: the first call raised: it waited for the failed kernel ({message})"
    assert "rank(s) [0]" in message and "timed out in an earlier call" in message, message
    if rank == 0:
        assert "dispatch: waiting for rank 1" in message, message
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["nvlink", "nvlink_copy_engine", "copy_engine"])  # (session 21, before the
# NVLink kernels queued behind a failed one did nothing: nvlink_copy_engine hung, most likely a copy stream's wait)
def test_a_kernel_timeout_is_raised_by_the_next_call_on_every_rank_without_waiting(backend):
    spawn(_buffer_kernel_timeout_worker, args=(2, free_port(), backend), nprocs=2, join=True)


def _buffer_refused_worker(rank, world, port, kwargs_of_rank, argument, words):
    """On a gloo group, Buffer(**kwargs_of_rank(rank)) must raise EPArgumentError naming `argument` on every rank."""
    from smsplit.ep import Buffer, EPArgumentError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        Buffer(dist.group.WORLD, **kwargs_of_rank(rank))
    except EPArgumentError as e:
        assert e.argument == argument and all(w in str(e) for w in words), str(e)
    else:
        raise AssertionError(f"rank {rank}: Buffer({kwargs_of_rank(rank)}) was accepted")
    finally:
        dist.destroy_process_group()


def _nvlink_on_gloo(rank):
    return {"backend": "nvlink", "num_nvl_bytes": 1 << 20}


def _nvlink_copy_engine_on_gloo(rank):
    return {"backend": "nvlink_copy_engine", "num_nvl_bytes": 1 << 20}


def _copy_engine_on_gloo(rank):
    return {"backend": "copy_engine", "num_nvl_bytes": 1 << 20}


def _num_sms_by_rank(rank):
    return {"num_sms": 20 + 4 * rank}


@pytest.mark.parametrize("kwargs_of_rank", [_nvlink_on_gloo, _nvlink_copy_engine_on_gloo, _copy_engine_on_gloo])
def test_nvlink_backend_on_a_gloo_group_is_refused_with_a_reason(kwargs_of_rank):
    spawn(_buffer_refused_worker, args=(1, free_port(), kwargs_of_rank, "backend", ["NCCL"]), nprocs=1,
             join=True)


@pytest.mark.compile
def test_notify_kernel_compiles_with_its_flags():
    sig = {"counts_ptr": "*i32", "ctx_ptr": "*i64", "state_ptr": "*i32", "layout_ptr": "*i32", "rank": "i32",
           "R": "i32", "num_worst": "i32", "RP": "constexpr"}
    text, cubin = ptx.compile_for_sm90(nvlink.notify_kernel, sig, {"RP": 8}, num_warps=1)
    for name in ("atom_add_release_sys", "fence_acq_rel_sys", "wait_geq_sys"):
        assert ptx.INSTRUCTIONS[name] in text, name
    assert cubin[:4] == b"\x7fELF"


def test_ranks_with_different_num_sms_all_refuse_the_buffer():
    # the NVLink kernels wait for as many programs from every peer as they run themselves
    spawn(_buffer_refused_worker, args=(2, free_port(), _num_sms_by_rank, "num_sms", ["[20, 24]"]), nprocs=2,
             join=True)


def _graph_worker(rank, world, port, bulk="sm"):
    """NvlinkTransport with num_worst_tokens: dispatch, an "expert", and combine captured in one CUDA graph
    (no host synchronization inside), replayed with new inputs every round, checked against the oracle.
    With bulk="copy_engine" the routing stays that of the warm-up call (a cached layout: the copies are
    planned on the host) and the tokens and weights change."""
    dev = _init_nccl(rank, world, port)
    group = dist.group.WORLD
    T, H, E, K = 192, 2048, 16, 4
    num_local, worst = E // world, world * T
    transport = nvlink.NvlinkTransport(group, dev, max_tokens=T, hidden=H, max_topk=K, timeout_s=20, bulk=bulk)
    x = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    topk = torch.empty(T, K, dtype=torch.int64, device=dev)
    w = torch.empty(T, K, dtype=torch.float32, device=dev)
    in_rank = torch.empty(T, world, dtype=torch.bool, device=dev)

    def fill(seed):
        route = torch.Generator(device="cpu").manual_seed((seed if bulk == "sm" else 0) * 10 + rank)
        t = torch.randint(0, E, (T, K), generator=route)
        t[torch.rand(T, K, generator=route) < 0.2] = -1
        if bulk == "copy_engine":  # most tokens to the peer too: its rows are copied, a few holes filled after
            peer_expert = (rank + 1) % world * num_local + t[:, 0] % num_local
            t[:, 0] = torch.where(torch.arange(T) % 8 == 5, t[:, 0], peer_expert)
        g = torch.Generator(device="cpu").manual_seed(seed * 10 + rank + 5)
        x.copy_(torch.randn(T, H, generator=g))
        topk.copy_(t)
        w.copy_(torch.rand(T, K, generator=g))
        for r in range(world):
            in_rank[:, r] = ((topk >= r * num_local) & (topk < (r + 1) * num_local)).any(1)

    cached = None

    def step():
        rx, _, rk, rw, rsrc, layout = transport.dispatch(x, None, topk, w, in_rank, num_local, num_sms=SMS,
                                                         num_worst_tokens=worst, cached=cached)
        y = (rx.float() * (rank + 1)).to(torch.bfloat16)  # the "expert"
        rx, rk, rw, rsrc = rx.clone(), rk.clone(), rw.clone(), rsrc.clone()  # (the FP8 dispatch below reuses the
        # receive area)
        out, out_w = transport.combine(y, rw, layout, num_sms=SMS)
        # the same tokens quantized in the dispatch (bulk="copy_engine": pushed by the kernel onto the copy's rows)
        qx, qs, *_ = transport.dispatch(x, None, topk, w, in_rank, num_local, num_sms=SMS, quantize=True,
                                        num_worst_tokens=worst, cached=layout)
        return rx, rk, rw, rsrc, layout, out, out_w, qx.clone(), qs.clone()

    fill(0)
    *_, warm_layout, _, _, _, _ = _warm_up(step)
    if bulk == "copy_engine":
        cached = warm_layout
        assert set(cached.splits) == {"dispatch", ("combine", nvlink_plan.default_combine_chunks(SMS))}
        split = cached.splits["dispatch"]
        assert split.copies and split.plan[world] < T  # the rows go in one copy, and some holes are filled after it
    graph, (rx, rk, rw, rsrc, layout, out, out_w, qx, qs) = _capture(step, rank)
    for round_ in range(1, 4):
        fill(round_)
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        for t in (out, qs):  # poison what the replay must overwrite
            t.fill_(float("nan"))
        qx.view(torch.uint8).fill_(0x7F)
        graph.replay()
        torch.cuda.synchronize()
        transport.raise_if_failed()
        inputs = [[torch.empty_like(t) for _ in range(world)] for t in (x, topk, w, in_rank)]
        for gathered, t in zip(inputs, (x, topk, w, in_rank)):
            dist.all_gather(gathered, t)
        ex, ek, ew, esrc = expected_dispatch(*inputs, rank, num_local)
        n = ex.size(0)
        assert int(layout.num_recv_tokens.item()) == n
        if bulk == "copy_engine":  # the rows of the copy (the FP8 dispatch puts them on the same rows)
            order = received_order(inputs[3], rank)
            ex, ek, ew, esrc = ex[order], ek[order], ew[order], esrc[order]
        ref_q, ref_s = quantize_1x128(ex)
        assert torch.equal(rx[:n], ex) and torch.equal(rk[:n], ek) and torch.equal(rw[:n], ew)
        assert torch.equal(rsrc[:n], esrc)
        assert torch.equal(qx[:n].view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(qs[:n], ref_s)
        acc_w = torch.zeros(T, K, device=dev)
        for d in range(world):
            acc_w[in_rank[:, d]] += w[in_rank[:, d]]  # the weights go back unscaled
        assert torch.equal(out, expected_combine(x, in_rank)), f"round {round_}: combine differs after replay"
        torch.testing.assert_close(out_w, acc_w, rtol=1e-6, atol=1e-6)
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("bulk", ["sm", "copy_engine"])
def test_nvlink_dispatch_combine_replay_in_a_cuda_graph(bulk):
    spawn(_graph_worker, args=(2, free_port(), bulk), nprocs=2, join=True)


def _overflow_worker(rank, world, port, peer_sends):
    """A captured dispatch + combine with num_worst_tokens, replayed once with rank 0's receive past it: rank 0 raises
    the count, with no fault (its y has num_worst_tokens rows: nothing is read past them; that it sums nothing cannot
    be seen here: its output's memory may be a temporary of the graph's that the replay writes before the combine,
    which made the first version of this test fail on the GPU). peer_sends: every token
    on rank 0's experts (rank 0 receives world * T rows, num_worst_tokens = T), so rank 1's tokens past rank 0's T
    rows did not come back and rank 1 raises too; else num_worst_tokens = T / 2, rank 0's own T tokens stay home and
    rank 1 drops all of its (top-k -1): rank 1 lost nothing and raises nothing."""
    dev = _init_nccl(rank, world, port)
    T, H, E, K = 128, 2048, 16, 2
    num_local = E // world
    worst = T if peer_sends else T // 2
    transport = nvlink.NvlinkTransport(dist.group.WORLD, dev, max_tokens=T, hidden=H, max_topk=K, timeout_s=20,
                                       bulk="sm")
    g = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    w = torch.rand(T, K, generator=g).to(dev)
    topk = torch.empty(T, K, dtype=torch.int64, device=dev)
    in_rank = torch.empty(T, world, dtype=torch.bool, device=dev)

    def route(target, n):  # tokens 0 .. n-1 to two experts of rank target, the rest dropped
        local = torch.stack([torch.arange(T) % num_local, (torch.arange(T) + 1) % num_local], 1)
        topk.copy_(torch.where(torch.arange(T)[:, None] < n, target * num_local + local, -1))
        in_rank.zero_()
        in_rank[:n, target] = True

    def step():
        rx, _, _, rw, _, layout = transport.dispatch(x, None, topk, w, in_rank, num_local, num_sms=SMS,
                                                     num_worst_tokens=worst)
        y = (rx.float() * (rank + 1)).to(torch.bfloat16)
        return transport.combine(y, rw, layout, num_sms=SMS)[0]

    route(rank, worst)  # each rank's tokens stay home: num_worst_tokens rows received
    _warm_up(step)
    graph, out = _capture(step, rank)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    transport.raise_if_failed()
    assert torch.equal(out, expected_combine(x, in_rank))
    dist.barrier(device_ids=[rank])
    if peer_sends:
        route(0, T)
    else:
        route(rank, T if rank == 0 else 0)
    out.fill_(float("nan"))  # (rank 1 without peer_sends: every token dropped, all rows must be written, zeros)
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    graph.replay()
    torch.cuda.synchronize()  # no fault
    received = world * T if peer_sends else T
    if rank == 0:
        with pytest.raises(ValueError, match=f"rank 0 receives {received} tokens, more than num_worst_tokens={worst}"):
            transport.raise_if_failed()
    elif peer_sends:
        with pytest.raises(ValueError, match=f"rank 0 received more tokens than its num_worst_tokens, so rank {rank}'s"):
            transport.raise_if_failed()
    else:
        transport.raise_if_failed()
        assert torch.equal(out, torch.zeros_like(out))  # every token dropped
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("peer_sends", [True, False])
def test_a_replay_whose_receive_passes_num_worst_tokens_raises_where_rows_are_lost(peer_sends):
    spawn(_overflow_worker, args=(2, free_port(), peer_sends), nprocs=2, join=True)


def _buffer_graph_worker(rank, world, port, fp8=False):
    """Buffer(backend="nvlink") with num_worst_tokens: get_dispatch_layout, dispatch (BF16, or FP8 quantized in it
    with ``fp8``), an "expert" and combine captured in one CUDA graph, replayed with new tokens and routing, equal to
    Buffer(backend="reference") run eagerly on the same inputs; a reference buffer refuses to be captured, naming the
    backend."""
    from smsplit.ep import Buffer, EPArgumentError
    from smsplit.fp8 import dequantize_1x128

    dev = _init_nccl(rank, world, port)
    group = dist.group.WORLD
    T, H, E, K = 128, 2048, 16, 4
    worst = world * T
    fast = Buffer(group, num_nvl_bytes=Buffer.get_buffer_size_hint(T, H, world, K, backend="nvlink"), num_sms=8,
                  backend="nvlink", timeout_s=30)
    ref = Buffer(group, backend="reference", timeout_s=30)
    x = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    topk = torch.empty(T, K, dtype=torch.int64, device=dev)
    w = torch.empty(T, K, dtype=torch.float32, device=dev)

    def fill(seed):
        g = torch.Generator(device="cpu").manual_seed(seed * 10 + rank)
        t = torch.randint(0, E, (T, K), generator=g)
        t[torch.rand(T, K, generator=g) < 0.2] = -1
        topk.copy_(t)
        x.copy_(torch.randn(T, H, generator=g))
        w.copy_(torch.rand(T, K, generator=g))

    def step(buf):
        """(*received rows, recv_topk_idx, recv_topk_weights, per-expert list, handle, combined, combined weights)"""
        recv_x, recv_k, recv_w, per_expert_list, handle, _ = buf.dispatch(
            x, **_layout_kwargs(buf, topk, w, E, num_worst_tokens=worst), fp8=fp8)
        values = dequantize_1x128(*recv_x, torch.float32) if fp8 else recv_x.float()
        y = (values * (rank + 1)).to(torch.bfloat16)  # the "expert"
        out, out_w, _ = buf.combine(y, handle, topk_weights=recv_w)
        rows = (recv_x[0].view(torch.uint8), recv_x[1]) if fp8 else (recv_x,)
        return (*rows, recv_k, recv_w, per_expert_list, handle, out, out_w)

    fill(0)
    _warm_up(lambda: step(fast))  # the eager call first: it allocates the symmetric buffer and compiles
    graph, captured = _capture(lambda: step(fast), rank)
    compared = [i for i in range(len(captured)) if i not in (len(captured) - 4, len(captured) - 3)]
    for round_ in range(1, 4):
        fill(round_)
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        for i in compared:  # poison what the replay must overwrite
            t = captured[i]
            t.fill_(float("nan") if t.is_floating_point() else (0x7F if t.dtype == torch.uint8 else -7))
        graph.replay()
        fast.check_kernels()
        expected = step(ref)
        for i in compared:
            assert torch.equal(captured[i], expected[i]), f"round {round_}: output {i} differs"
        assert captured[-4] == expected[-4] == []
        assert torch.equal(captured[-3].rank_prefix_matrix, expected[-3].rank_prefix_matrix)
    other = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(other):
            step(ref)
    except EPArgumentError as e:
        assert e.argument == "backend" and "reference" in str(e), str(e)
    else:
        raise AssertionError("a reference buffer was captured")
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


def _buffer_graph_cached_worker(rank, world, port):
    """Buffer(backend="nvlink_copy_engine"): an eager dispatch makes the handle (and every copy plan), then cached
    BF16 and FP8 dispatches, an "expert" and the combine are captured in one CUDA graph and replayed with new tokens
    on the same routing, equal to the reference backend's cached calls on the same inputs (rows compared in its
    order); without a handle a capture is refused, naming it."""
    from smsplit.ep import Buffer, EPArgumentError

    dev = _init_nccl(rank, world, port)
    group = dist.group.WORLD
    T, H, E, K = 128, 2048, 16, 4
    worst = world * T
    fast = Buffer(group, num_nvl_bytes=Buffer.get_buffer_size_hint(T, H, world, K, backend="nvlink_copy_engine"),
                  num_sms=8, backend="nvlink_copy_engine", timeout_s=30)
    ref = Buffer(group, backend="reference", timeout_s=30)
    g = torch.Generator(device="cpu").manual_seed(rank)
    topk = torch.randint(0, E, (T, K), generator=g)
    topk[torch.rand(T, K, generator=g) < 0.1] = -1
    topk, w = topk.to(dev), torch.rand(T, K, generator=g).to(dev)
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    handles = {}
    for name, buf in (("fast", fast), ("ref", ref)):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
        _, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w,
                                                  num_worst_tokens=worst)
        handles[name] = (handle, recv_w)
    split = handles["fast"][0].transport_state.layout.splits[("dispatch", 1.0)]
    assert split.copies and split.fill_from < T  # the copy engines move a prefix with holes

    def step(buf, handle, recv_w):
        recv_x, *_ = buf.dispatch(x, handle=handle)
        (q, scales), *_ = buf.dispatch(x, handle=handle, fp8=True)
        y = (recv_x.float() * (rank + 1)).to(torch.bfloat16)  # the "expert"
        out, out_w, _ = buf.combine(y, handle, topk_weights=recv_w)
        return recv_x, q.view(torch.uint8), scales, out, out_w

    _warm_up(lambda: step(fast, *handles["fast"]))
    graph, captured = _capture(lambda: step(fast, *handles["fast"]), rank)
    for round_ in range(1, 4):
        x.copy_(torch.randn(T, H, generator=g))
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        for t in captured:  # poison what the replay must overwrite
            t.view(torch.uint8).fill_(0x7F)
        graph.replay()
        fast.check_kernels()
        expected = step(ref, *handles["ref"])
        for i, (a, b) in enumerate(zip(captured, expected)):
            if i < 3:
                a = in_reference_order(a, handles["fast"][0], rank)
            assert torch.equal(a, b), f"round {round_}: output {i} differs"
    other = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(other):
            per_rank, _, per_expert, in_rank, _ = fast.get_dispatch_layout(topk, E)
            fast.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                          topk_idx=topk, topk_weights=w, num_worst_tokens=worst)
    except EPArgumentError as e:
        assert e.argument == "handle", str(e)
    else:
        raise AssertionError("an uncached nvlink_copy_engine dispatch was captured")
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_buffer_nvlink_copy_engine_replays_cached_calls_in_a_cuda_graph():
    spawn(_buffer_graph_cached_worker, args=(2, free_port()), nprocs=2, join=True)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("fp8", [False, True])
def test_buffer_dispatch_and_combine_replay_in_a_cuda_graph(fp8):
    spawn(_buffer_graph_worker, args=(2, free_port(), fp8), nprocs=2, join=True)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 3, 4])  # 2: packed bf16 pairs; more: fp32
def test_combine_sum_equals_fp32_sum_rounded_once(ranks):
    """`kernels.rows.sum_returned_rows` on one GPU against torch's fp32 sum from +0 rounded to bf16 (what the reference
    backend computes): rows that a token did not send (-1 positions), -0 in both rows of a token, NaN, inf,
    subnormals, sums that round; every bit of the output, and of the rows past the tokens (left alone)."""
    import triton
    import triton.language as tl

    @triton.jit
    def sum_kernel(pos_ptr, y_ptr, yw_ptr, cx_ptr, cw_ptr, out_ptr, out_w_ptr, T, self_start, slots, H, K,
                   R: tl.constexpr, rank: tl.constexpr, HB: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr,
                   TB: tl.constexpr):
        t = tl.program_id(0) * TB + tl.arange(0, TB)
        kernel_rows.sum_returned_rows(t, t < T, pos_ptr, R, rank, self_start, y_ptr, yw_ptr, cx_ptr, cw_ptr, slots,
                                        out_ptr, out_w_ptr, H, K, HB, KP, RP, TB, True)

    torch.manual_seed(ranks)
    T, H, K, rank, slots, self_start = 37, 2048, 3, 1, 64, 5
    dev = torch.device("cuda")
    pos = torch.randint(0, slots - 1, (T, ranks), dtype=torch.int32)
    pos[torch.rand(T, ranks) < 0.3] = -1
    pos[0] = -1  # a token that went nowhere: zeros
    y = (torch.randn(self_start + slots, H) * torch.logspace(-3, 3, H)).to(torch.bfloat16)
    cx = (torch.randn(ranks * slots, H) * torch.logspace(3, -3, H)).to(torch.bfloat16)
    specials = {1: (-0.0, -0.0), 2: (float("nan"), 1.0), 3: (float("inf"), -float("inf")), 4: (1e-40, 2e-40),
                5: (3.0, 2.0 ** -9), 6: (float("inf"), 5.0)}
    for t, (own, other) in specials.items():
        pos[t] = -1
        pos[t, rank], pos[t, (rank + 1) % ranks] = t, t
        y[self_start + t, :64] = own
        cx[((rank + 1) % ranks) * slots + t, :64] = other
    yw, cw = torch.randn(self_start + slots, K), torch.randn(ranks * slots, K)
    expected = torch.zeros(T, H)
    expected_w = torch.zeros(T, K)
    for t in range(T):
        for d in range(ranks):
            p = int(pos[t, d])
            if p < 0:
                continue
            row = y[self_start + p] if d == rank else cx[d * slots + p]
            expected[t] += row.float()
            expected_w[t] += yw[self_start + p] if d == rank else cw[d * slots + p]
    out = torch.full((T + 1, H), -7.0, dtype=torch.bfloat16, device=dev)  # poisoned, one row past the tokens
    out_w = torch.full((T + 1, K), -7.0, device=dev)
    TB = 4
    sum_kernel[(triton.cdiv(T, TB),)](pos.to(dev), y.to(dev), yw.to(dev), cx.to(dev), cw.to(dev), out, out_w, T,
                                      self_start, slots, H, K, R=ranks, rank=rank, HB=H, KP=4,
                                      RP=triton.next_power_of_2(ranks), TB=TB, num_warps=8)
    got = out[:T].cpu().view(torch.int16)
    want = expected.to(torch.bfloat16).view(torch.int16)
    nan = torch.isnan(expected)
    assert torch.equal(got[~nan], want[~nan])
    assert torch.isnan(out[:T].cpu().float()[nan]).all()
    assert torch.equal(out_w[:T].cpu(), expected_w)
    assert (out[T] == -7.0).all() and (out_w[T] == -7.0).all()
