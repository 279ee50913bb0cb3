"""Smoke test of the MoE training demo: 2 gloo processes, EP over both, DualPipeV, a few steps."""

import json
import math
import types

import pytest

from ep_harness import spawn
from smsplit.apps.demo import DemoConfig, run


def test_demo_two_gloo_ranks_trains_and_writes_report(tmp_path, demo_processes_from_the_fork_server):
    summary = run(DemoConfig(str(tmp_path), steps=5, device="cpu", batch=8, chunks=2, progress=False, timeout_s=60))
    assert summary["device"] == "cpu" and summary["ep"] == 2 and summary["world"] == 2
    losses = summary["losses"]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(64)) < 1.0  # starts near chance over the 64-token vocabulary
    assert losses[-1] < losses[0] - 0.3  # and falls
    assert summary["tokens_per_s"] > 0 and 0 <= summary["exposed_comm_fraction"] <= 1
    for name in ("loss_curve.png", "pipeline_timeline.png", "overlap_timeline.png", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 5


def _stalling_worker(rank, world, port, opts, out_dir):
    """The demo's own worker; rank 1 stalls before the EP gradient all-reduce of its first step until rank 0 has
    given up (at most 20 s). Each rank writes what it raised and when."""
    import time

    import smsplit.apps.demo as train

    real = train._all_reduce_grads

    def stalled(params, group):
        end = time.monotonic() + 20
        while rank == 1 and not (out_dir / "rank0.json").exists() and time.monotonic() < end:
            time.sleep(0.05)
        return real(params, group)

    train._all_reduce_grads = stalled
    start = time.monotonic()
    outcome = {"error": None}
    try:
        train._worker(rank, port, opts)
    except Exception as error:  # noqa: BLE001 - recorded for the test
        outcome = {"error": type(error).__name__, "message": str(error)}
    outcome["elapsed"] = time.monotonic() - start
    (out_dir / f"rank{rank}.json").write_text(json.dumps(outcome))


def test_a_stalled_peer_ends_the_demo_within_timeout_s_naming_the_rank_and_phase(tmp_path):
    from smsplit.launch import free_port

    opts = DemoConfig(out_dir=str(tmp_path / "report"), steps=2, device="cpu", world_size=2, pp=1, chunks=2, batch=8,
                      seed=0, lr=3e-3, comm_sms=20, progress=False, timeout_s=5)
    spawn(_stalling_worker, args=(2, free_port(), opts, tmp_path), nprocs=2, join=True)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["error"] == "RuntimeError" and rank0["message"].startswith(
        "rank 0: step 0: summing the replicated gradients"), rank0
    assert rank0["elapsed"] < 15, rank0  # bounded by timeout_s (5 s) and the set-up, not by the stalled peer


def test_bad_timeouts_are_refused_before_any_process_starts(tmp_path):
    for bad in (0, -1, float("inf"), float("nan"), 1e15, True, "60"):
        with pytest.raises(ValueError, match="timeout_s"):
            run(DemoConfig(str(tmp_path), steps=1, device="cpu", progress=False, timeout_s=bad))


def test_a_comm_sm_count_no_gpu_can_grant_is_refused_before_spawning(tmp_path, monkeypatch):
    """On GPUs the demo asks each for `SmBudget(comm_sms)` (grid mode where green contexts cannot grant it): a
    count that leaves no compute SM even in grid mode fails here, not in the spawned processes."""
    import torch
    import torch.multiprocessing as mp

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(mp, "spawn", lambda *a, **k: pytest.fail("spawned processes"))
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="comm_sms must be between 1 and 131"):
        run(DemoConfig(str(tmp_path / "report"), steps=1, device="cuda", comm_sms=132, progress=False))
    assert not (tmp_path / "report").exists()


def test_a_one_step_demo_times_its_ops(tmp_path, demo_processes_from_the_fork_server):
    """The first step is left out of the op times (one-time set-up), except when it is the only one: the pipeline
    timeline is drawn from these times and says they were measured."""
    summary = run(DemoConfig(str(tmp_path), steps=1, device="cpu", batch=4, chunks=2, progress=False, timeout_s=60))
    ops = summary["op_seconds"]
    assert ops.get("F", 0) > 0 and ops.get("FB", 0) > 0, ops


def _stalled_dispatch_worker(rank, world, port, opts, out_dir):
    """The demo's own worker; rank 1 stalls in its first EP dispatch (inside the pipeline step) until rank 0 has
    given up (at most 20 s). Each rank writes what it raised."""
    import time

    import smsplit.moe.layer as layer
    import smsplit.apps.demo as train

    real = layer.MoE.dispatch

    def stalled(self, *args):
        end = time.monotonic() + 20
        while rank == 1 and not (out_dir / "rank0.json").exists() and time.monotonic() < end:
            time.sleep(0.05)
        return real(self, *args)

    layer.MoE.dispatch = stalled
    outcome = {"error": None}
    try:
        train._worker(rank, port, opts)
    except Exception as error:  # noqa: BLE001 - recorded for the test
        outcome = {"error": type(error).__name__, "message": str(error)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(outcome))


def test_a_peer_stalled_inside_the_pipeline_step_is_named_with_the_rank_step_op_and_piece(tmp_path):
    """An EP wait inside `pipe.step` (a dispatch or combine piece) used to end the demo with the buffer's bare
    message ("dispatch: waiting for counts from rank 1 ..."): no rank, step, pipeline op or layer."""
    from smsplit.launch import free_port

    opts = DemoConfig(out_dir=str(tmp_path / "report"), steps=1, device="cpu", world_size=2, pp=1, chunks=2, batch=4,
                      seed=0, lr=3e-3, comm_sms=20, progress=False, timeout_s=5)
    spawn(_stalled_dispatch_worker, args=(2, free_port(), opts, tmp_path), nprocs=2, join=True)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["error"] == "RuntimeError", rank0
    message = rank0["message"]
    assert message.startswith("rank 0: step 0: pipeline op F0.0, piece 'dispatch.0': "), message
    assert "waiting for counts from rank 1" in message, message


def test_model_overrides_and_an_infinite_lr_are_refused_before_spawning(tmp_path, monkeypatch):
    """These used to start the processes: an infinite lr trained on NaN from the second step, a bad route_scale
    failed inside every worker, an unknown field raised TypeError."""
    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "spawn", lambda *a, **k: pytest.fail("spawned processes"))
    for kwargs, words in ((dict(lr=float("inf")), "lr must be a finite number > 0"),
                          (dict(model={"route_scale": 0.0}), "route_scale must be"),
                          (dict(model={"rope_theta": -1.0}), "rope_theta must be"),
                          (dict(model={"bogus": 1}), "model: .*bogus")):
        with pytest.raises(ValueError, match=words):
            run(DemoConfig(str(tmp_path / "report"), steps=1, device="cpu", progress=False, **kwargs))
    assert not (tmp_path / "report").exists()


def test_the_pipeline_timeline_is_simulated_with_the_measured_split_backward(tmp_path, monkeypatch):
    """The split backward's measured time ("Bi") was left out: the simulator used B - W in its place."""
    import smsplit.pipeline as pipeline
    from smsplit.moe.model import ModelConfig
    from smsplit.apps.demo import _report

    calls = []

    class Sim:
        def save_png(self, path, title=""):
            (tmp_path / "sim.txt").write_text(title)

    def simulate(*args, **kwargs):
        calls.append(kwargs)
        return Sim()

    monkeypatch.setattr(pipeline, "simulate", simulate)
    config = DemoConfig(str(tmp_path), device="cpu", world_size=2, seed=0, model=ModelConfig(), pp=1, chunks=2)
    op_times = {"F": [1.0], "B": [3.0], "Bi": [2.5], "W": [1.0], "FB": [3.5]}
    _report(config, [2.0, 1.0], [1.0, 1.0], [0.5, 0.5], op_times, {}, None, 1.0)
    assert calls and calls[0]["Bi"] == 2.5 and calls[0]["B"] == 3.0 and calls[0]["W"] == 1.0, calls
