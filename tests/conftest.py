"""GPU tests (`@pytest.mark.gpu`, `@pytest.mark.multigpu` for two or more GPUs) skip where CUDA is missing.

A GPU run passes ``--require-gpu`` (or sets ``SMSPLIT_REQUIRE_GPU=1``): CUDA must then be usable (a tensor
operation on every visible GPU succeeds) and every selected GPU test must run, so a misconfigured machine cannot
report green with nothing run. Under the switch a GPU test that skips, for whatever reason, fails; a multi-GPU test
selected on a machine with one GPU fails too (deselect those with ``-m "gpu and not multigpu"``). docs/testing.md.
"""

import os

import pytest
import torch

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

REQUIRE_GPU_ENV = "SMSPLIT_REQUIRE_GPU"


def pytest_addoption(parser):
    parser.addoption("--require-gpu", action="store_true", default=False,
                     help=f"a GPU run: fail (not skip) GPU tests where CUDA is missing or unusable, and any GPU test "
                          f"that skips (also set by {REQUIRE_GPU_ENV}=1)")


def require_gpu(config) -> bool:
    return bool(config.getoption("--require-gpu")) or os.environ.get(REQUIRE_GPU_ENV, "") not in ("", "0")


def cuda_problem(probe: bool):
    """Why CUDA cannot run the GPU tests here, or None. ``probe``: also run a tensor operation on every visible
    GPU (``torch.cuda.is_available()`` only asks the driver how many devices there are: a GPU the build has no
    kernels for, or a broken driver, passes it)."""
    try:
        if not torch.cuda.is_available():
            return (f"torch.cuda.is_available() is False (torch {torch.__version__}, built for CUDA "
                    f"{torch.version.cuda}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        if probe:
            for i in range(torch.cuda.device_count()):
                x = torch.arange(4, dtype=torch.float32, device=f"cuda:{i}")
                got = (x * 2).sum().item()
                if got != 12.0:
                    return f"a tensor operation on cuda:{i} gave {got}, not 12.0"
    except Exception as error:  # (any error of the driver or the build: it is what the switch reports)
        return f"a tensor operation on CUDA failed: {type(error).__name__}: {error}"
    return None


def pytest_configure(config):
    required = require_gpu(config)
    problem = cuda_problem(probe=required)
    config._smsplit_gpu = dict(required=required, problem=problem,
                               count=0 if problem else torch.cuda.device_count())


def pytest_report_header(config):
    gpu = config._smsplit_gpu
    state = f"CUDA unusable: {gpu['problem']}" if gpu["problem"] else f"{gpu['count']} CUDA GPU(s)"
    return f"smsplit: {state}; GPU tests {'required (--require-gpu)' if gpu['required'] else 'skip without CUDA'}"


def pytest_collection_modifyitems(config, items):
    gpu = config._smsplit_gpu
    skip_gpu = pytest.mark.skip(reason=f"needs a CUDA GPU: {gpu['problem']}")
    skip_multi = pytest.mark.skip(reason=f"needs two or more CUDA GPUs, this machine has {gpu['count']} (deselect "
                                         f"with -m \"gpu and not multigpu\")")
    for item in items:
        if ("gpu" in item.keywords or "multigpu" in item.keywords) and gpu["problem"]:
            item.add_marker(skip_gpu)
        elif "multigpu" in item.keywords and gpu["count"] < 2:
            item.add_marker(skip_multi)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``--require-gpu`` a GPU test that skips (the markers above, a ``skipif``, ``pytest.skip`` inside)
    fails, with the skip's reason."""
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and not hasattr(report, "wasxfail") and item.config._smsplit_gpu["required"]
            and ("gpu" in item.keywords or "multigpu" in item.keywords)):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = (f"--require-gpu / {REQUIRE_GPU_ENV}=1: this GPU test would have skipped ({reason}); a GPU "
                           f"run must run every GPU test it selects")


@pytest.fixture
def demo_processes_from_the_fork_server(monkeypatch):
    """The demo's ranks start from ep_harness's fork server (torch and smsplit imported there once) instead of new
    interpreters: what they run is the same, and the demo on CPU sets no environment for them."""
    import types

    import smsplit.apps.demo as demo
    from ep_harness import spawn

    monkeypatch.setattr(demo, "mp", types.SimpleNamespace(spawn=spawn))
