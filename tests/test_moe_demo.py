"""Smoke test of the MoE training demo: 2 gloo processes, EP over both, DualPipeV, a few steps."""

import json
import math

from smsplit.moe.train import run_demo


def test_demo_two_gloo_ranks_trains_and_writes_report(tmp_path):
    summary = run_demo(str(tmp_path), steps=5, device="cpu", batch=8, chunks=2, progress=False, timeout_s=60)
    assert summary["device"] == "cpu" and summary["ep"] == 2 and summary["world"] == 2
    losses = summary["losses"]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(64)) < 1.0  # starts near chance over the 64-token vocabulary
    assert losses[-1] < losses[0] - 0.3  # and falls
    assert summary["tokens_per_s"] > 0 and 0 <= summary["exposed_comm_fraction"] <= 1
    for name in ("loss_curve.png", "pipeline_timeline.png", "overlap_timeline.png", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 5
