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


def test_unknown_command_and_bad_device_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2 and "invalid choice: 'frobnicate'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["demo", "--device", "tpu"])
    assert e.value.code == 2 and "argument --device: invalid choice: 'tpu'" in capsys.readouterr().err
