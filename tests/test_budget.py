"""SmBudget arithmetic and argument checks (CPU) and the SM partition itself (GPU)."""

import pytest
import torch

from smsplit.budget import SmBudget, plan_split
from smsplit.trace import Trace


# --- arithmetic ----------------------------------------------------------------------------------

@pytest.mark.parametrize("asked,granted", [(1, 8), (8, 8), (9, 16), (20, 24), (24, 24), (31, 32), (120, 120)])
def test_hopper_rounds_comm_sms_up_to_groups_of_eight(asked, granted):
    plan = plan_split(asked, total_sms=132, min_partition=8, alignment=8)
    assert (plan.requested_comm_sms, plan.comm_sms, plan.compute_sms) == (asked, granted, 132 - granted)


def test_plan_without_granularity_is_exact():
    plan = plan_split(20, 132)
    assert (plan.comm_sms, plan.compute_sms, plan.total_sms) == (20, 112, 132)


@pytest.mark.parametrize("bad", [0, -3, 132, 500])
def test_out_of_range_comm_sms_is_rejected(bad):
    with pytest.raises(ValueError, match="comm_sms must be between 1 and 131"):
        plan_split(bad, 132)


def test_rounding_that_leaves_no_compute_sm_is_rejected():
    with pytest.raises(ValueError, match="leaves no SM for compute"):
        plan_split(129, 132, min_partition=8, alignment=8)


def test_the_advice_names_the_largest_request_that_fits():
    with pytest.raises(ValueError, match="ask for at most 128$"):
        plan_split(131, 132, min_partition=8, alignment=8)
    assert plan_split(128, 132, min_partition=8, alignment=8).compute_sms == 4  # the advice holds
    with pytest.raises(ValueError, match="no request fits"):
        plan_split(3, 4, min_partition=4)


@pytest.mark.parametrize("name,args", [("total_sms", (20, "132")), ("total_sms", (20, 0)),
                                       ("min_partition", (20, 132, 0)), ("alignment", (20, 132, 1, 0)),
                                       ("alignment", (20, 132, 1, -8))])
def test_the_other_plan_arguments_are_checked(name, args):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        plan_split(*args)


@pytest.mark.parametrize("bad", [2.5, "20", None, True])
def test_comm_sms_must_be_an_int(bad):
    with pytest.raises(ValueError, match="comm_sms must be an int"):
        plan_split(bad, 132)


# --- argument checks that need no GPU --------------------------------------------------------------

def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="mode must be one of"):
        SmBudget(20, mode="hardware")


def test_non_cuda_device_is_rejected():
    with pytest.raises(ValueError, match="CUDA device"):
        SmBudget(20, device="cpu", mode="grid")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_no_gpu_is_explained():
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        SmBudget(20, mode="grid")


# --- on a GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("asked", [8, 20, 32])
def test_green_streams_run_on_disjoint_complementary_sms(asked):
    with SmBudget(asked, mode="green") as budget:
        assert budget.comm_sms >= asked and budget.comm_sms % 8 == 0
        assert budget.comm_sms + budget.compute_sms == budget.total_sms
        trace = Trace(budget.device)
        trace.probe(budget.comm_stream, "comm", programs=16 * budget.total_sms)
        trace.probe(budget.compute_stream, "compute", programs=16 * budget.total_sms)
        comm, compute = trace.sms("comm", kind="probe"), trace.sms("compute", kind="probe")
        assert len(comm) == budget.comm_sms
        assert len(compute) == budget.compute_sms
        assert not comm & compute


@pytest.mark.gpu
def test_compute_stream_around_a_cublas_gemm_reaches_no_comm_sm():
    """What a trace can show of a kernel it cannot instrument: the span's probes, launched on the compute stream
    just before and after a cuBLAS GEMM, land only off the comm SMs (the green context binds every kernel of that
    stream, cuBLAS's included, to its SMs; the GEMM's own blocks are not observed), and the GEMM is right."""
    with SmBudget(20, mode="green") as budget:
        trace = Trace(budget.device)
        a = torch.randn(2048, 2048, device=budget.device, dtype=torch.bfloat16)
        trace.probe(budget.comm_stream, "comm", programs=16 * budget.total_sms)
        with trace.span(budget.compute_stream, "gemm", kind="compute"):
            with torch.cuda.stream(budget.compute_stream):
                c = a @ a
        budget.compute_stream.synchronize()
        torch.testing.assert_close(c.float(), (a.float() @ a.float()), rtol=2e-2, atol=2.0)
        assert not trace.sms("gemm") & trace.sms("comm", kind="probe")


@pytest.mark.gpu
def test_green_streams_keep_their_partition_under_graph_capture():
    with SmBudget(16, mode="green") as budget:
        trace = Trace(budget.device)
        for stream, name in ((budget.comm_stream, "comm"), (budget.compute_stream, "compute")):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                trace.probe(stream, name, programs=16 * budget.total_sms)
            # replay from the default stream: the captured kernels keep their green context
            for _ in range(3):
                graph.replay()
        torch.cuda.synchronize()
        comm, compute = trace.sms("comm", kind="probe"), trace.sms("compute", kind="probe")
        assert len(comm) == budget.comm_sms and len(compute) == budget.compute_sms
        assert not comm & compute


@pytest.mark.gpu
def test_grid_mode_streams_share_the_whole_gpu():
    with SmBudget(20, mode="grid") as budget:
        assert (budget.comm_sms, budget.compute_sms) == (20, budget.total_sms - 20)
        assert not budget.isolated
        trace = Trace(budget.device)
        trace.probe(budget.compute_stream, "compute", programs=16 * budget.total_sms)
        assert len(trace.sms("compute", kind="probe")) == budget.total_sms


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [0, 132, 1000])
def test_out_of_range_comm_sms_fails_before_the_driver(bad):
    with pytest.raises(ValueError, match="comm_sms"):
        SmBudget(bad, mode="green")


@pytest.mark.gpu
def test_closed_budget_refuses_its_streams():
    budget = SmBudget(8, mode="green")
    budget.close()
    budget.close()
    with pytest.raises(RuntimeError, match="closed"):
        _ = budget.comm_stream


@pytest.mark.parametrize("bad", ["cuda0", "gpu:0", -1, True])
def test_a_malformed_device_is_a_value_error(bad):
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        SmBudget(20, device=bad, mode="grid")
