"""Trace files from synthetic records (CPU) and from real kernels (GPU)."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from smsplit import ptx
from smsplit.copy import persistent_copy_kernel, sm_copy
from smsplit.apps.trace import comm_beside_gemm
from smsplit.trace import Trace, _probe_kernel, _spin_kernel


def synthetic_trace():
    rng = np.random.default_rng(0)
    tags = [("dispatch", "comm"), ("gemm", "compute"), ("probe", "probe")]
    rows = []
    for sm in range(24):
        start = int(rng.integers(0, 1000))
        rows.append((sm, start, start + 5000, 0))
    for sm in range(24, 132):
        rows.append((sm, 200, 9000, 1))
    rows.append((3, 0, 10, 2))
    return Trace.from_records(rows, tags)


def test_sm_sets_and_sharing_from_records():
    trace = synthetic_trace()
    assert trace.sms(kind="comm") == set(range(24))
    assert trace.sms("gemm") == set(range(24, 132))
    assert trace.shared_sms() == set()
    assert trace.sms(kind="probe") == {3}


def test_shared_sms_are_those_that_ran_comm_and_compute():
    tags = [("dispatch", "comm"), ("gemm", "compute"), ("probe", "probe")]
    rows = [(sm, 0, 100, 0) for sm in range(4)] + [(sm, 50, 300, 1) for sm in (2, 3, 9)] + [(1, 0, 10, 2)]
    trace = Trace.from_records(rows, tags)
    assert trace.shared_sms() == {2, 3}  # a probe on comm SM 1 is not compute
    assert trace.shared_sms("comm", "probe") == {1}


def test_png_opens_and_has_a_size(tmp_path):
    path = tmp_path / "trace.png"
    synthetic_trace().save_png(path, title="synthetic", num_sms=132)
    with Image.open(path) as image:
        assert image.format == "PNG"
        width, height = image.size
        assert width > 500 and height > 300


def test_chrome_trace_is_valid_trace_event_json(tmp_path):
    path = tmp_path / "trace.json"
    trace = synthetic_trace()
    trace.save_chrome(path)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    meta = [e for e in events if e["ph"] == "M"]
    assert len(complete) == len(trace.records())
    assert {e["tid"] for e in meta} == {e["tid"] for e in complete}
    for e in complete:
        assert set(e) >= {"name", "cat", "ph", "ts", "dur", "pid", "tid"}
        assert e["dur"] >= 0 and e["ts"] >= 0
    gemm = [e for e in complete if e["name"] == "gemm"]
    assert len(gemm) == 108 and all(abs(e["dur"] - 8.8) < 1e-9 for e in gemm)
    # times in us from the first record's start (the probe's, at 0 ns): the gemm started at 200 ns
    assert all(abs(e["ts"] - 0.2) < 1e-9 for e in gemm)
    starts = {int(r[0]): r[1] for r in trace.records() if r[3] == 0}  # dispatch records, one per SM 0..23
    for e in complete:
        if e["name"] == "dispatch":
            assert abs(e["ts"] - starts[e["tid"]] / 1e3) < 1e-9, e


def test_a_kind_that_tags_cannot_have_is_an_error_not_an_empty_set():
    trace = synthetic_trace()
    for call in (lambda: trace.sms(kind="compte"), lambda: trace.shared_sms("comm", "compte")):
        with pytest.raises(ValueError, match="kind must be one of"):
            call()
    assert trace.sms(kind="probe") == {3}


def test_an_empty_trace_reads_as_no_records():
    trace = Trace()
    assert trace.records().shape == (0, 4) and trace.sms() == set()
    assert trace.to_chrome()["traceEvents"] == []


def test_slots_refuse_a_count_below_one_and_keep_their_place():
    trace = Trace("cpu", capacity=8)
    for bad in (-3, 0, 2.0, True):
        with pytest.raises(ValueError, match="n_programs must be an int >= 1"):
            trace.slots(bad, "x")
    view, _ = trace.slots(np.int64(3), "x")
    assert view.shape[0] == 3 and trace.slots(5, "y")[0].shape[0] == 5  # the first 3 rows, then the next 5


def test_a_picture_cut_below_the_highest_sm_is_refused(tmp_path):
    trace = Trace.from_records([[0, 0, 10, 0], [200, 5, 20, 0]], [("a", "comm")])
    with pytest.raises(ValueError, match="SM 200"):
        trace.save_png(tmp_path / "cut.png", num_sms=4)
    trace.save_png(tmp_path / "whole.png", num_sms=201)
    assert (tmp_path / "whole.png").stat().st_size > 0


def test_bad_records_are_rejected():
    with pytest.raises(ValueError, match="tag id"):
        Trace.from_records([(0, 0, 1, 5)], [("a", "comm")])
    with pytest.raises(ValueError, match="ends before it starts"):
        Trace.from_records([(0, 9, 1, 0)], [("a", "comm")])
    with pytest.raises(ValueError, match="kind must be one of"):
        Trace.from_records([(0, 0, 1, 0)], [("a", "network")])


@pytest.mark.compile
def test_traced_kernels_compile_for_sm90():
    ptx_text, _ = ptx.compile_for_sm90(_probe_kernel, {"trace_ptr": "*i64", "tag": "i32", "spin_ns": "i64"})
    assert "%smid" in ptx_text and "%globaltimer" in ptx_text
    gate_text, _ = ptx.compile_for_sm90(_spin_kernel, {"spin_ns": "i64"}, num_warps=1)
    assert "%globaltimer" in gate_text
    sig = {"src": "*i32", "dst": "*i32", "n_vec": "i64", "trace_ptr": "*i64", "tag": "i32",
           "BLOCK": "constexpr", "TRACE": "constexpr"}
    traced, _ = ptx.compile_for_sm90(persistent_copy_kernel, sig, {"BLOCK": 2048, "TRACE": True}, num_warps=8)
    plain, _ = ptx.compile_for_sm90(persistent_copy_kernel, sig, {"BLOCK": 2048, "TRACE": False}, num_warps=8)
    for text in (traced, plain):
        assert ptx.INSTRUCTIONS["ld_global_nc_v4"] in text
        assert ptx.INSTRUCTIONS["st_global_na_v4"] in text
    assert "%globaltimer" in traced and "%globaltimer" not in plain


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ldst", "tma"])
def test_copy_is_exact_and_every_program_records_itself(method):
    device = torch.device("cuda")
    src = torch.randint(-2**31, 2**31 - 1, (3 * 2**20 + 4,), dtype=torch.int32, device=device)
    dst = torch.full_like(src, 0x7FC00000)  # poison
    trace = Trace(device)
    sm_copy(dst, src, num_programs=20, trace=trace, name="copy", method=method)
    torch.testing.assert_close(dst, src, rtol=0, atol=0)
    rows = trace.records()
    assert len(rows) == 20
    assert (rows[:, 2] >= rows[:, 1]).all() and (rows[:, 1] > 0).all()
    n_sms = torch.cuda.get_device_properties(device).multi_processor_count
    assert set(rows[:, 0].tolist()) <= set(range(n_sms))


@pytest.mark.gpu
def test_records_reread_sees_a_replayed_graphs_new_records():
    device = torch.device("cuda")
    src = torch.randn(2**20, device=device)
    dst = torch.empty_like(src)
    trace = Trace(device)
    sm_copy(dst, src, num_programs=8)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sm_copy(dst, src, num_programs=8, trace=trace, name="copy")
    graph.replay()
    first = trace.records().copy()
    torch.cuda._sleep(1_000_000)  # the clock moves on between replays
    graph.replay()
    assert (trace.records() == first).all()  # what it read first
    again = trace.records(reread=True)
    assert len(again) == len(first) == 8 and (again[:, 1] > first[:, 2].max()).all()


@pytest.mark.gpu
def test_copy_rejects_bad_input_before_launch():
    src = torch.randn(100, device="cuda")
    with pytest.raises(ValueError, match="must match"):
        sm_copy(torch.empty(99, device="cuda"), src, 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        sm_copy(torch.empty(3, device="cuda"), torch.empty(3, device="cuda"), 4)
    with pytest.raises(ValueError, match="CUDA tensor"):
        sm_copy(torch.empty(100), torch.empty(100), 4)


@pytest.mark.gpu
def test_release_atomic_runs_once_per_program():
    import triton
    import triton.language as tl

    @triton.jit
    def bump(counter):
        ptx.atom_add_release_gpu(counter, 1)
        ptx.st_release_sys(counter + 1 + tl.program_id(0), 7)

    counter = torch.zeros(1 + 64, dtype=torch.int32, device="cuda")
    bump[(64,)](counter, num_warps=4)
    assert counter[0].item() == 64
    assert (counter[1:] == 7).all()


def test_a_new_trace_tag_does_not_recompile_traced_kernels():
    # Triton specializes integer arguments (0, 1, multiples of 16); a tag id is data, not shape:
    # a kernel recompiled mid-trace would stall its stream for tens of milliseconds.
    from smsplit.ep.copy_engine import pack_kernel, reduce_kernel
    from smsplit.ep.nvlink import combine_copied_kernel, combine_kernel, dispatch_kernel

    for kernel, tag in ((persistent_copy_kernel, "tag"), (_probe_kernel, "tag"),
                        (dispatch_kernel, "trace_tag"), (combine_kernel, "trace_tag"),
                        (combine_copied_kernel, "trace_tag"), (pack_kernel, "trace_tag"), (reduce_kernel, "trace_tag")):
        assert tag in [p.name for p in kernel.params if p.do_not_specialize]


def test_records_of_the_wrong_shape_or_fractional_values_are_refused_not_reread():
    # [4, 3] used to be reshaped into 3 records of 4 values, and float times cut to whole ns
    with pytest.raises(ValueError, match="rows of 4 values"):
        Trace.from_records(np.zeros((4, 3), dtype=np.int64), [("a", "comm")])
    with pytest.raises(ValueError, match="whole numbers"):
        Trace.from_records([[0, 0.4, 10.9, 0]], [("a", "comm")])
    assert Trace.from_records([[0, 0.0, 10.0, 0]], [("a", "comm")]).records().tolist() == [[0, 0, 10, 0]]
    assert Trace.from_records([], [("a", "comm")]).records().shape == (0, 4)


def test_a_probe_on_a_trace_made_from_records_says_so():
    with pytest.raises(RuntimeError, match="no device buffer"):  # not a CUDA error from the device query
        Trace.from_records([], []).probe(None, "p")


class _FakeLaunch:
    """Stands in for a Triton kernel: records the grid and the arguments instead of launching."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_copy_takes_any_contiguous_shape_whose_size_is_a_multiple_of_16(monkeypatch):
    import smsplit.copy as copy

    monkeypatch.setattr(copy, "_check_tensor", lambda t, name: None)  # CPU tensors stand in for CUDA ones
    kernel = _FakeLaunch()
    monkeypatch.setattr(copy, "persistent_copy_kernel", kernel)
    src = torch.arange(64, dtype=torch.bfloat16).reshape(64, 1)  # 128 bytes; 2 bytes a row
    dst = torch.empty_like(src)
    copy.sm_copy(dst, src, 4)
    (grid, args, _), = kernel.launches
    assert grid == (4,) and args[2] == 8  # 8 vectors of 16 bytes
    assert args[0].data_ptr() == src.data_ptr() and args[1].data_ptr() == dst.data_ptr()
    assert args[0].dtype == torch.int32 and args[0].numel() == 32


@pytest.mark.parametrize("kwargs,message", [(dict(block=1000), "block must be a power of two"),
                                            (dict(num_warps=3), "num_warps must be a power of two"),
                                            (dict(num_programs=2.5), "num_programs must be an int"),
                                            (dict(num_programs=True), "num_programs must be an int"),
                                            (dict(method="tma", stages=2.5), "stages must be an int")])
def test_copy_arguments_triton_would_reject_are_value_errors_first(kwargs, message):
    # (before the device check: on a GPU these were Triton's CompilationError / AssertionError / launch errors)
    kwargs.setdefault("num_programs", 4)
    with pytest.raises(ValueError, match=message):
        sm_copy(torch.empty(64), torch.empty(64), **kwargs)


def concurrency_trace():
    """Copies on SMs 0-1 and a GEMM span on SMs 2-3, hand-made (ns): the copies run 100-300, 250-400 (SM 1)
    and 900-1000; the GEMM 200-800; a probe on SM 0 at 0-1000 that counts as neither."""
    tags = [("copy", "comm"), ("gemm", "compute"), ("gemm probe", "probe")]
    rows = [(0, 100, 300, 0), (1, 250, 400, 0), (0, 900, 1000, 0), (2, 200, 800, 1), (3, 200, 800, 1),
            (0, 0, 1000, 2)]
    return Trace.from_records(rows, tags)


def test_concurrent_and_alone_time_from_hand_made_records():
    trace = concurrency_trace()
    assert trace.busy_intervals("comm") == [(100, 400), (900, 1000)]
    assert trace.busy_ns("comm") == 400 and trace.busy_ns("compute") == 600
    assert trace.concurrent_ns() == 200  # 200-400
    assert trace.alone_ns() == 200  # 100-200 and 900-1000
    assert trace.alone_ns("compute", "comm") == 400  # 400-800
    assert trace.concurrent_ns("comm", "probe") == 400  # probes are a kind of their own
    line = trace.timing_line()
    assert "both at once 0.00 ms" in line  # ns shown in ms
    big = Trace.from_records([(r[0], r[1] * 10_000, r[2] * 10_000, r[3]) for r in trace.records()], trace.tags)
    assert big.timing_line() == ("comm ran 4.00 ms, compute 6.00 ms; both at once 2.00 ms, comm alone 2.00 ms")
    with pytest.raises(ValueError, match="kind must be one of"):
        trace.busy_ns("network")


def test_concurrent_time_of_random_records_matches_a_time_grid():
    rng = np.random.default_rng(5)
    rows = []
    for _ in range(40):
        start = int(rng.integers(0, 500))
        rows.append((int(rng.integers(0, 8)), start, start + int(rng.integers(0, 80)), int(rng.integers(0, 2))))
    trace = Trace.from_records(rows, [("c", "comm"), ("g", "compute")])
    grid = np.zeros((2, 600), dtype=bool)
    for _, start, end, tag in rows:
        grid[tag, start:end] = True
    assert trace.concurrent_ns() == (grid[0] & grid[1]).sum()
    assert trace.alone_ns() == (grid[0] & ~grid[1]).sum()
    assert trace.busy_ns("compute") == grid[1].sum()


def test_the_picture_of_a_trace_with_both_kinds_draws(tmp_path):
    concurrency_trace().save_png(tmp_path / "both.png", title="hand-made")
    assert (tmp_path / "both.png").stat().st_size > 0


@pytest.mark.parametrize("kwargs", [dict(gemm_n=0), dict(gemms=1.5), dict(copy_mib=True), dict(gate_ns=-1)])
def test_comm_beside_gemm_refuses_bad_sizes_before_touching_the_budget(kwargs):
    with pytest.raises(ValueError, match="must be an int >= 1"):
        comm_beside_gemm(None, **kwargs)


def _budget(comm_sms):
    from smsplit.budget import SmBudget, SmBudgetError

    try:
        return SmBudget(comm_sms, mode="green")
    except SmBudgetError:  # no green contexts here: the grid split (not isolated)
        return SmBudget(comm_sms, mode="grid")


@pytest.mark.gpu
def test_the_copy_runs_beside_the_gemms_for_most_of_its_time():
    with _budget(24) as budget:
        trace = comm_beside_gemm(budget)
        isolated = budget.isolated
    comm, compute = trace.busy_ns("comm"), trace.busy_ns("compute")
    assert comm > 0 and compute > 0
    assert trace.concurrent_ns() >= 0.5 * min(comm, compute), trace.timing_line()
    if isolated:
        assert trace.shared_sms() == set()


@pytest.mark.gpu
def test_smsplit_trace_reports_the_time_both_ran_at_once(tmp_path, capsys):
    from smsplit.cli import main

    assert main(["trace", "--out", str(tmp_path), "--comm-sms", "24"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["concurrent_ms"] >= 0.5 * min(summary["comm_ms"], summary["compute_ms"]) > 0, summary
    assert "both at once" in capsys.readouterr().out
    assert (tmp_path / "sm_trace.png").stat().st_size > 0
