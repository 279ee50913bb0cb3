"""bench/tables.py and bench/ep.py's CPU parts (CPU): BENCHMARKS.md is the page tables.py prints from the stored
results, a field an older result lacks reads "not recorded", the byte counts and GB/s follow the documented
convention, and bench/ep.py refuses arguments it cannot run."""

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


def printed(fn, *args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(*args)
    return out.getvalue()


def test_benchmarks_page_is_printed_from_the_stored_results():
    assert printed(tables.benchmarks) == (ROOT / "BENCHMARKS.md").read_text()


def test_every_section_names_its_result_file_and_command():
    for section, name in ((tables.sm_split, "sm_split"), (tables.ep, "ep"), (tables.ep_buffer, "ep_buffer"),
                          (tables.pipeline, "pipeline"), (tables.moe_overlap, "moe_overlap")):
        text = printed(section)
        command = json.loads((ROOT / "bench" / "results" / f"{name}.json").read_text())
        command = command.get("env", command)["command"]
        assert f"Command: `{command}` (result: `bench/results/{name}.json`)" in text, name


def test_ep_table_is_the_stored_run_with_baselines_and_quoted_deepep():
    lines = [line for line in printed(tables.ep).splitlines() if line.startswith("|")]
    assert len(lines) == 2 + len(tables.EP_TABLE_OPS)
    d = stored_ep()
    g = next(r for r in d["graph_rows"] if r["transport"] == "nvlink_copy_engine" and r["comm_sms"] == 20)
    bf16 = lines[2].split(" | ")
    assert bf16[1] == " / ".join(f"{g[k] * 1e3:.1f}" for k in (
        "dispatch_bf16_graph_ms", "dispatch_bf16_graph_queued_ms", "dispatch_bf16_graph_aligned_ms"))
    assert bf16[4] == " / ".join(f"{d[k] * 1e3:.1f}" for k in (
        "nccl_all_to_all_ms", "nccl_all_to_all_queued_ms", "nccl_all_to_all_aligned_ms"))
    assert bf16[5] == " / ".join(f"{d[k] * 1e3:.1f}" for k in (
        "copy_engine_ms", "copy_engine_queued_ms", "copy_engine_aligned_ms"))
    assert bf16[6] == "404 |" and lines[0].endswith("(quoted from the design notes, measured apart) |")
    fp8 = lines[3].split(" | ")
    assert fp8[4] == fp8[5] == "—"  # NCCL and the ceiling moved BF16 rows, not these bytes
    at_16 = [line for line in printed(tables.ep, "ep", "16").splitlines() if line.startswith("| BF16")]
    assert at_16[0].endswith("| — |")  # no DeepEP figure quoted at 16 SMs


def test_fields_an_older_result_lacks_read_not_recorded(tmp_path, monkeypatch):
    d = stored_ep()
    for key in ("nccl_all_to_all_aligned_ms", "nccl_all_to_all_queued_ms", "nccl_all_to_all_ms"):
        del d[key]
    for r in d["graph_rows"]:
        r.pop("dispatch_fp8_input_graph_aligned_ms")
    d["graph_rows"][0]["combine_graph_ms"] = None  # recorded as not measured
    (tmp_path / "old.json").write_text(json.dumps(d))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    text = printed(tables.ep, "old", "8")
    bf16 = next(line for line in text.splitlines() if line.startswith("| BF16")).split(" | ")
    assert bf16[4] == "not recorded"
    fp8_input = next(line for line in text.splitlines() if line.startswith("| FP8 dispatch of FP8")).split(" | ")
    assert fp8_input[1].endswith(" / not recorded") and fp8_input[2].endswith(" / not recorded")
    combine = next(line for line in text.splitlines() if line.startswith("| combine (BF16)")).split(" | ")
    assert combine[2].startswith("n/a / ")  # graph_rows[0] is nvlink at 8 SMs


def test_eager_buffer_table_marks_calls_the_run_did_not_time():
    text = printed(tables.ep_buffer)
    d = json.loads((ROOT / "bench" / "results" / "ep_buffer.json").read_text())
    nvlink = next(r for r in d["rows"] if r["backend"] == "nvlink")
    combine = next(line for line in text.splitlines() if line.startswith("| combine |")).split(" | ")
    assert combine[1] == f"{nvlink['buffer_combine_ms'] * 1e3:.0f} / {nvlink['buffer_combine_queued_ms'] * 1e3:.0f}"
    assert combine[-1] == "442 |"
    assert "| FP8 dispatch of FP8 input, cached | " in text and "/ not recorded | not recorded |" in text


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
