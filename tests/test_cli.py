"""The command line: info, trace (CPU explanation), argument errors."""

import json

import pytest
import torch

from smsplit.cli import main


def test_info_json_lists_versions_and_gpus(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["versions"]["torch"] == torch.__version__
    assert len(info["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU explanation")
def test_trace_on_a_cpu_explains_and_writes_a_summary(tmp_path, capsys):
    assert main(["trace", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "No CUDA GPU here" in out and "SmBudget(comm_sms=20)" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gpu"] is False


def test_demo_passes_its_options_and_says_where_the_report_is(tmp_path, capsys, monkeypatch):
    from smsplit.apps import demo

    calls = []
    monkeypatch.setattr(demo, "run", lambda config: calls.append(config) or {})
    out = str(tmp_path / "report")
    assert main(["demo", "--out", out, "--steps", "7", "--device", "cpu", "--comm-sms", "16", "--seed", "3"]) == 0
    assert calls == [demo.DemoConfig(out_dir=out, steps=7, device="cpu", comm_sms=16, seed=3)]
    assert capsys.readouterr().out.strip().endswith(f"report: {out}")


def test_unknown_command_and_bad_device_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2 and "invalid choice: 'frobnicate'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["demo", "--device", "tpu"])
    assert e.value.code == 2 and "argument --device: invalid choice: 'tpu'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["demo", "--steps", "0"], ["demo", "--steps", "-5"], ["demo", "--comm-sms", "-3"],
                                  ["trace", "--comm-sms", "0"]])
def test_counts_below_one_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=0), "world_size must be an int >= 1"), (dict(pp=0), "pp must be an int >= 1"),
    (dict(chunks=1), "chunks=1 must be at least 2 \\* pp"), (dict(steps=0), "steps must be"),
    (dict(device="tpu"), "device must be"), (dict(lr=0.0), "lr must be"), (dict(lr=float("nan")), "lr must be"),
    (dict(device="cuda", world_size=64), "needs 64 CUDA GPUs")])
def test_run_demo_refuses_bad_arguments_before_spawning(kwargs, message, tmp_path):
    from smsplit.apps.demo import DemoConfig, run

    with pytest.raises(ValueError, match=message):
        run(DemoConfig(out_dir=str(tmp_path / "report"), **kwargs))
    assert not (tmp_path / "report").exists()  # nothing started


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU explanation")
def test_trace_explains_the_split_it_was_asked_for(tmp_path, capsys):
    assert main(["trace", "--out", str(tmp_path), "--comm-sms", "33"]) == 0
    out = capsys.readouterr().out
    assert "SmBudget(comm_sms=33)" in out and "40 SMs for communication and 92 for compute" in out


@pytest.mark.parametrize("argv,message", [
    (["demo", "--seed", str(2**60)], "seed must be an int in \\[0, 2\\*\\*32\\)"),
    (["demo", "--seed", "-1"], "seed must be an int in \\[0, 2\\*\\*32\\)"),
    (["demo", "--out", "{file}"], "cannot make the report folder"),
    (["trace", "--out", "{file}/trace"], "cannot make the report folder")])
def test_demo_and_trace_input_errors_are_usage_errors_before_any_process_starts(argv, message, tmp_path, capsys,
                                                                                   monkeypatch):
    import re

    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "spawn", lambda *a, **k: pytest.fail("spawned processes"))
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        main([a.format(file=tmp_path / "file") for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and re.search(f"smsplit {argv[0]}: error: .*{message}", err), err


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 2, reason="needs fewer than 2 GPUs")
def test_demo_on_cuda_without_two_gpus_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--device", "cuda", "--out", str(tmp_path / "report")])
    assert e.value.code == 2 and "needs 2 CUDA GPUs" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()
