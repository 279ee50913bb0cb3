"""The ``--require-gpu`` switch of tests/conftest.py, in pytest sessions of their own (each in a process of its own,
with CUDA hidden, so they behave alike on a CPU machine and a GPU machine): without it GPU tests skip where CUDA is
missing; with it (option or environment variable) they fail, as does CUDA that answers ``is_available()`` but cannot
run a tensor operation, a GPU test that skips for any reason, and a multi-GPU test selected where there is one GPU."""

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from ep_harness import context

TESTS = Path(__file__).parent

SAMPLE = '''
import pytest

def test_cpu():
    pass

@pytest.mark.gpu
def test_gpu():
    pass

@pytest.mark.gpu
@pytest.mark.multigpu
def test_two_gpus():
    pass

@pytest.mark.gpu
def test_gpu_that_skips():
    pytest.skip("a reason of its own")
'''

# CUDA that claims a device but cannot run on it: the probe's tensor operation fails
BROKEN_CUDA = '''
import torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
'''

# one usable GPU, as conftest's probe would have found it (set after conftest's own pytest_configure)
ONE_GPU = '''
import pytest

@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    config._smsplit_gpu.update(problem=None, count=1)
'''


# the sessions: pytest's arguments and environment; they run at once
SESSIONS = {
    "plain": ((), {}),
    "switch": (("--require-gpu",), {}),
    "broken": (("-p", "broken_cuda"), {"SMSPLIT_REQUIRE_GPU": "1"}),
    "one_gpu_deselected": (("--require-gpu", "-p", "one_gpu", "-m", "gpu and not multigpu"), {}),
    "one_gpu_all": (("--require-gpu", "-p", "one_gpu"), {}),
}


def _session(root: str, args: tuple, env: dict, output: str) -> None:
    """A pytest session in `root`, in a process of its own (from ep_harness's fork server, where torch is imported
    and CUDA is not initialized: it starts in seconds less than a new interpreter); exits with pytest's status."""
    os.chdir(root)
    os.environ.pop("SMSPLIT_REQUIRE_GPU", None)
    os.environ.update(CUDA_VISIBLE_DEVICES="", **env)  # (before anything initializes CUDA here)
    sys.path.insert(0, root)  # the plugins, as PYTHONPATH=root would
    out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    code = pytest.main(["-v", "-rA", "-p", "no:cacheprovider", *args, "test_sample.py"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """{name: (exit code, {test: outcome}, output)} of each of SESSIONS, on SAMPLE with the project's conftest."""
    root = tmp_path_factory.mktemp("require_gpu")
    shutil.copy(TESTS / "conftest.py", root / "conftest.py")
    (root / "test_sample.py").write_text(SAMPLE)
    (root / "broken_cuda.py").write_text(BROKEN_CUDA)
    (root / "one_gpu.py").write_text(ONE_GPU)
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: g\n    multigpu: m\n")
    ctx = context()
    running = {}
    for name, (args, env) in SESSIONS.items():
        running[name] = ctx.Process(target=_session, args=(str(root), args, env, str(root / f"{name}.out")))
        running[name].start()
    results = {}
    for name, process in running.items():
        process.join(timeout=300)
        if process.is_alive():
            process.kill()
            process.join()
        out = (root / f"{name}.out").read_text()
        outcomes = {}
        for line in out.splitlines():  # -v: "test_sample.py::test_gpu SKIPPED (reason) [ 50%]"
            m = re.match(r"test_sample.py::(test_\w+) (PASSED|FAILED|SKIPPED|ERROR)", line)
            if m:  # (a skip made at setup that the switch turns into a failure is reported as an error)
                outcomes[m.group(1)] = "FAILED" if m.group(2) == "ERROR" else m.group(2)
        results[name] = (process.exitcode, outcomes, out)
    return results


def test_without_the_switch_gpu_tests_skip_where_cuda_is_missing(sessions):
    code, outcomes, out = sessions["plain"]
    assert code == 0, out
    assert outcomes == {"test_cpu": "PASSED", "test_gpu": "SKIPPED", "test_two_gpus": "SKIPPED",
                        "test_gpu_that_skips": "SKIPPED"}, out
    assert "torch.cuda.is_available() is False" in out


def test_the_switch_turns_a_missing_cuda_into_failures(sessions):
    code, outcomes, out = sessions["switch"]
    assert code == 1, out
    assert outcomes == {"test_cpu": "PASSED", "test_gpu": "FAILED", "test_two_gpus": "FAILED",
                        "test_gpu_that_skips": "FAILED"}, out
    assert "this GPU test would have skipped (needs a CUDA GPU: torch.cuda.is_available() is False" in out


def test_the_environment_variable_fails_a_cuda_that_cannot_run_a_tensor_operation(sessions):
    code, outcomes, out = sessions["broken"]
    assert code == 1, out
    assert outcomes["test_cpu"] == "PASSED" and outcomes["test_gpu"] == "FAILED", out
    assert "a tensor operation on CUDA failed" in out


def test_with_one_gpu_multi_gpu_tests_are_deselected_or_fail(sessions):
    code, outcomes, out = sessions["one_gpu_deselected"]
    assert code == 1 and outcomes == {"test_gpu": "PASSED", "test_gpu_that_skips": "FAILED"}, out
    assert "a reason of its own" in out  # a GPU test that skips fails, naming its reason
    code, outcomes, out = sessions["one_gpu_all"]
    assert code == 1 and outcomes == {"test_cpu": "PASSED", "test_gpu": "PASSED", "test_two_gpus": "FAILED",
                                      "test_gpu_that_skips": "FAILED"}, out
    assert 'needs two or more CUDA GPUs, this machine has 1 (deselect with -m "gpu and not multigpu")' in out
