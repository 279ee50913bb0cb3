"""The scripts under examples/ run as their docstrings say and their own checks pass (and can fail).

A script's whole path runs as a program under torchrun (`__main__`, the ranks of torchrun's environment), and from
its `main()`, through the processes it starts, to the exit status of a failed check. The checks of its ranks' work
with other options run its `main_rank` on the ranks of a process pool (tests/ep_harness.py) with the options its own
parser made of the arguments: what a started rank runs, without starting interpreters (most of a run's CPU time).
Bad options are refused by `main()` in this process.
"""

import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ep_harness import gloo_pool, spawn

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str, timeout: float = 240.0, launcher: tuple = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *launcher, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def ok_ranks(stdout: str) -> set:
    return {int(m.group(1)) for m in re.finditer(r"^rank (\d+)/\d+\b.* OK$", stdout, re.MULTILINE)}


def example(name: str):
    """The script as a module (importable by its name, as its spawned ranks import it); its `main()` not run."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(Path(name).stem)


class Started(Exception):
    """Raised in place of starting the ranks."""


def parsed_options(name: str, args, monkeypatch):
    """The options `main()` of the script passes to its ranks for these arguments (its parser's and its checks')."""
    module = example(name)
    started = {}

    def record(fn, args, nprocs, **kwargs):
        started.update(fn=fn, args=args, nprocs=nprocs)
        raise Started

    monkeypatch.setattr(module.mp, "spawn", record)
    monkeypatch.setattr(sys, "argv", [name, *args])
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # (not started by torchrun)
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(Started):
        module.main()
    world, _, options = started["args"]
    assert started["fn"] is module.spawned and started["nprocs"] == world
    return world, options


def case_example_rank(rank, world_size, name, options):
    """One rank of the script: its `main_rank` in the pool's group; returns (its check passed, what it printed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ok = example(name).main_rank(options)
    return ok, out.getvalue()


def run_ranks(name: str, args, monkeypatch):
    """The script's ranks for these arguments on a pool of as many ranks: (every rank's result, all they printed)."""
    world, options = parsed_options(name, args, monkeypatch)
    results = gloo_pool(world).run(case_example_rank, name, options)
    return [ok for ok, _ in results], "".join(text for _, text in results), world


def exit_status(name: str, args, monkeypatch) -> int:
    """The exit status of the script's `main()` run in this process, which starts its ranks (their processes from
    ep_harness's fork server, as `mp.spawn` would start them but without importing torch in each)."""
    module = example(name)
    monkeypatch.setattr(module.mp, "spawn", spawn)
    monkeypatch.setattr(sys, "argv", [name, *args])
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    try:
        module.main()
    except SystemExit as done:  # (a message: status 1 when run as a program)
        return done.code if isinstance(done.code, int) else 1
    return 0


@pytest.mark.parametrize("ranks, extra", [(2, ()), (4, ("--experts", "16", "--topk", "9"))])
def test_ep_moe_layer_matches_the_dense_layer_on_gloo(ranks, extra, monkeypatch):
    oks, out, world = run_ranks("ep_moe_layer.py", ("--ranks", str(ranks), *extra), monkeypatch)
    assert world == ranks and all(oks), out
    assert ok_ranks(out) == set(range(ranks)), out


@pytest.mark.parametrize("name", ["ep_moe_layer.py", "dualpipev.py"])
def test_examples_run_under_torchrun(name):
    done = run_example(name, launcher=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert ok_ranks(done.stdout) == {0, 1}, done.stdout


def test_ep_moe_layer_reports_a_mismatch(monkeypatch):
    # bf16 rounding (of the expert outputs, the combine's sums) differs from the dense layer's fp32 by more than
    # 1e-6: the script's check must say so and fail
    oks, out, _ = run_ranks("ep_moe_layer.py", ("--tolerance", "1e-6"), monkeypatch)
    assert not any(oks) and "MISMATCH" in out and not ok_ranks(out), out
    assert exit_status("ep_moe_layer.py", ("--tolerance", "1e-6"), monkeypatch) == 1


@pytest.mark.parametrize("name, args, message", [
    ("ep_moe_layer.py", ("--backend", "nvlink"), "--backend nvlink needs --device cuda"),
    ("ep_moe_layer.py", ("--hidden", "100"), "--hidden 100: a multiple of 128"),
    ("ep_moe_layer.py", ("--topk", "9"), "--topk 9: between 1 and --experts (8)"),
    ("ep_moe_layer.py", ("--experts", "7"), "--experts 7 must be a multiple of --ranks 2"),
    ("ep_moe_layer.py", ("--ranks", "0"), "must be at least 1"),
    ("dualpipev.py", ("--chunks", "3"), "--chunks 3: DualPipeV with 2 ranks needs at least 2 x ranks = 4"),
    ("dualpipev.py", ("--batch", "3"), "--batch 3: must split into 4 micro-batches of equal size"),
    ("dualpipev.py", ("--batch", "6"), "--batch 6: must split into 4 micro-batches of equal size"),
    ("dualpipev.py", ("--steps", "0"), "must be at least 1"),
])
def test_examples_refuse_bad_options_before_starting_ranks(name, args, message, monkeypatch, capsys):
    module = example(name)
    monkeypatch.setattr(module.mp, "spawn", lambda *a, **k: pytest.fail("started ranks"))
    monkeypatch.setattr(sys, "argv", [name, *args])
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(SystemExit) as done:
        module.main()
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err, err


def test_ep_moe_layer_with_a_rank_that_receives_nothing(monkeypatch):
    # one token with top-1 on 4 ranks: at least two ranks receive nothing, and still take part in the backward
    oks, out, _ = run_ranks("ep_moe_layer.py", ("--ranks", "4", "--tokens", "1", "--topk", "1"), monkeypatch)
    assert all(oks) and ok_ranks(out) == set(range(4)), out


@pytest.mark.parametrize("ranks, extra", [(2, ()), (3, ("--chunks", "12", "--batch", "36", "--steps", "2"))])
def test_dualpipev_example_matches_the_unpipelined_model(ranks, extra, monkeypatch):
    oks, out, world = run_ranks("dualpipev.py", ("--ranks", str(ranks), *extra), monkeypatch)
    assert world == ranks and all(oks), out
    assert ok_ranks(out) == set(range(ranks)), out
    losses = re.findall(r"loss ([\d.]+) \(without the pipeline ([\d.]+)\)", out)
    assert losses and all(abs(float(a) - float(b)) <= 1e-5 for a, b in losses), out


def test_dualpipev_example_reports_a_mismatch(monkeypatch):
    # the exit path of the script's check: no difference is within a negative tolerance
    oks, out, _ = run_ranks("dualpipev.py", ("--steps", "1", "--tolerance", "-1"), monkeypatch)
    assert not any(oks) and "MISMATCH" in out and not ok_ranks(out), out
    assert exit_status("dualpipev.py", ("--steps", "1", "--tolerance", "-1"), monkeypatch) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["reference", "nvlink", "nvlink_copy_engine", "copy_engine"])
def test_ep_moe_layer_on_gpus(backend):
    ranks = min(torch.cuda.device_count(), 2)
    done = run_example("ep_moe_layer.py", "--device", "cuda", "--ranks", str(ranks), "--backend", backend)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ok_ranks(done.stdout) == set(range(ranks)), done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dualpipev_example_on_gpus():
    ranks = min(torch.cuda.device_count(), 2)
    done = run_example("dualpipev.py", "--device", "cuda", "--ranks", str(ranks))
    assert done.returncode == 0, done.stdout + done.stderr
    assert ok_ranks(done.stdout) == set(range(ranks)), done.stdout
