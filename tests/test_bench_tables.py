"""bench/tables.py and bench/ep.py's CPU parts (CPU): the EP table is the stored result's numbers, the byte counts
and GB/s follow the documented convention, and bench/ep.py refuses arguments it cannot run."""

import argparse
import contextlib
import copy
import io
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import tables  # noqa: E402


def stored_ep():
    return json.loads((ROOT / "bench" / "results" / "ep.json").read_text())


def test_ep_table_is_the_published_table():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tables.ep()
    published = (ROOT / "BENCHMARKS.md").read_text()
    lines = [line for line in out.getvalue().splitlines() if line.startswith("|")]
    assert len(lines) > 40
    for line in lines:
        assert line in published, line


def test_ep_rates_follow_the_convention_and_keep_the_stored_figures():
    d = stored_ep()
    stored = copy.deepcopy(d)
    tables.add_ep_rates(d)
    H, recv, peers = d["shape"]["hidden"], d["num_recv"], d["recv_from_peers"]
    b = d["bytes_per_rank"]
    assert b["dispatch_bf16"] == {"deepep": recv * H * 2, "nvlink": peers * H * 2}
    # FP8: e4m3 values and one fp32 scale per 128, (1 + 4/128) / 2 of BF16's
    assert b["dispatch_fp8"]["deepep"] == pytest.approx(recv * H * 2 * (1 + 4 / 128) / 2, rel=1e-12)
    assert b["dispatch_fp8"]["nvlink"] == peers * (H + H // 128 * 4)
    assert b["combine"] == b["dispatch_bf16"]
    for key in ("nccl_all_to_all_gbps_recv", "copy_engine_gbps"):
        assert d[key] == pytest.approx(stored[key], rel=1e-12)
    for row, old in zip(d["rows"], stored["rows"]):
        for key in ("dispatch_bf16_deepep_gbps", "dispatch_bf16_nvlink_gbps", "dispatch_fp8_deepep_gbps",
                    "combine_deepep_gbps"):
            assert row[key] == pytest.approx(old[key], rel=1e-12), key
        assert row["combine_nvlink_gbps"] == pytest.approx(peers * H * 2 / row["combine_ms"] / 1e6)
        assert row["dispatch_bf16_cached_vs_nccl"] == pytest.approx(d["nccl_all_to_all_ms"] / row["dispatch_bf16_cached_ms"])
        assert "dispatch_fp8_cached_vs_nccl" not in row  # NCCL moved BF16 rows, not these bytes
    g = d["graph_rows"][0]
    assert g["combine_graph_queued_of_ceiling"] == pytest.approx(
        peers * H * 2 / g["combine_graph_queued_ms"] / (d["copy_engine_bytes"] / d["copy_engine_queued_ms"]))
    assert g["dispatch_bf16_graph_aligned_vs_nccl"] == pytest.approx(
        d["nccl_all_to_all_aligned_ms"] / g["dispatch_bf16_graph_aligned_ms"])


def test_ep_rates_table_prints_every_time():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tables.ep_rates()
    d = stored_ep()
    rows = [line for line in out.getvalue().splitlines() if line.startswith("| nvlink") or line.startswith("| copy")]
    assert len(rows) == len(d["rows"]) + 3 * len(d["graph_rows"])


def test_concurrent_line_reports_the_comm_slowdown_when_measured():
    d = stored_ep()
    c = d["concurrent"][0]
    c.update(comm_alone_queued=5, comm_slowdown=0.02, comm_slowdown_rounds=[0.01, 0.03])
    d["concurrent"] = [c]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.MonkeyPatch.context() as mp:
        mp.setattr(tables.json, "loads", lambda _: d)
        tables.ep()
    assert "slowdown beside the GEMM, median of the rounds: +2.0% (rounds +1.0, +3.0%)" in out.getvalue()


@pytest.mark.parametrize("argv, gpus, message", [
    ([], 1, "--world 1"),
    (["--world", "3"], 2, "--world 3"),
    (["--world", "2", "--hidden", "7000"], 2, "multiple of 128"),
    (["--world", "2", "--experts", "255"], 2, "split evenly"),
    (["--world", "2", "--comm-sms", "0", "20"], 2, "at least 1"),
    (["--world", "2", "--reps", "0"], 2, "at least 1"),
    (["--world", "2", "--soak-gemms", "4"], 2, "soak"),
    (["--world", "2", "--name", "../ep"], 2, "plain file name"),
    (["--world", "2", "--name", ".ep"], 2, "plain file name"),
])
def test_ep_refuses_arguments_it_cannot_run(argv, gpus, message, capsys):
    ep = pytest.importorskip("ep")
    args = _ep_args(ep, argv, gpus)
    with pytest.raises(SystemExit):
        ep.check_arguments(argparse.ArgumentParser(), args, gpus)
    assert message in capsys.readouterr().err


def _ep_args(ep, argv, gpus):
    """bench/ep.py's parsed arguments for ``argv`` on a machine of ``gpus`` GPUs (its parser, without a run)."""
    captured = {}

    def stop(parser, args, found):
        captured["args"] = args
        raise SystemExit(0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["ep.py", *argv])
        mp.setattr(ep, "check_arguments", stop)
        mp.setattr(ep.torch.cuda, "device_count", lambda: gpus)
        with pytest.raises(SystemExit):
            ep.main()
    return captured["args"]


def test_ep_accepts_the_issue_run():
    ep = pytest.importorskip("ep")
    args = _ep_args(ep, [], 2)
    assert args.world == 2 and args.comm_sms == [8, 16, 20, 24, 32]
    ep.check_arguments(argparse.ArgumentParser(), args, 2)


def test_results_are_strict_json_with_unmeasured_times_as_null(tmp_path, monkeypatch):
    common = pytest.importorskip("common")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    path = common.write_result("t", {"ms": float("nan"), "rows": [{"a": float("inf"), "b": 1.5}],
                                     "t": (torch.tensor(2.0).item(), -float("inf")), "n": 3})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"ms": None, "rows": [{"a": None, "b": 1.5}], "t": [2.0, None], "n": 3}
