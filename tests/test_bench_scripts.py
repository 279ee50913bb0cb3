"""The benchmark scripts and the device run scripts parse: a syntax error in a script meant for a GPU lease would
cost that lease (bash -n for the shell scripts; Python's compiler for bench/*.py and bench/device/*.py)."""
import shutil
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SHELL_SCRIPTS = sorted((BENCH / "device").glob("*.sh"))
PYTHON_SCRIPTS = sorted(BENCH.glob("*.py")) + sorted((BENCH / "device").glob("*.py"))


def test_there_are_scripts_to_check():
    assert len(SHELL_SCRIPTS) > 10 and len(PYTHON_SCRIPTS) > 10


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_device_shell_scripts_parse():
    bad = {}
    for script in SHELL_SCRIPTS:
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        if done.returncode:
            bad[script.name] = done.stderr.strip()
    assert not bad, bad


def test_bench_python_scripts_compile():
    bad = {}
    for script in PYTHON_SCRIPTS:
        try:
            compile(script.read_text(), str(script), "exec")
        except SyntaxError as error:
            bad[script.name] = str(error)
    assert not bad, bad


def test_a_broken_shell_script_is_caught(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    broken = tmp_path / "broken.sh"
    broken.write_text("for x in 1 2; do\n  echo $x\n")  # no done
    assert subprocess.run(["bash", "-n", str(broken)], capture_output=True).returncode != 0
