"""The scripts under examples/ run as their docstrings say and their own checks pass (and can fail)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str, timeout: float = 240.0, launcher: tuple = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *launcher, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def ok_ranks(stdout: str) -> set:
    return {int(m.group(1)) for m in re.finditer(r"^rank (\d+)/\d+\b.* OK$", stdout, re.MULTILINE)}


@pytest.mark.parametrize("ranks, extra", [(2, ()), (4, ("--experts", "16", "--topk", "9"))])
def test_ep_moe_layer_matches_the_dense_layer_on_gloo(ranks, extra):
    done = run_example("ep_moe_layer.py", "--ranks", str(ranks), *extra)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ok_ranks(done.stdout) == set(range(ranks)), done.stdout


@pytest.mark.parametrize("name", ["ep_moe_layer.py", "dualpipev.py"])
def test_examples_run_under_torchrun(name):
    done = run_example(name, launcher=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert ok_ranks(done.stdout) == {0, 1}, done.stdout


def test_ep_moe_layer_reports_a_mismatch():
    # bf16 rounding (of the expert outputs, the combine's sums) differs from the dense layer's fp32 by more than
    # 1e-6: the script's check must say so and fail
    done = run_example("ep_moe_layer.py", "--tolerance", "1e-6")
    assert done.returncode != 0
    assert "MISMATCH" in done.stdout and not ok_ranks(done.stdout), done.stdout


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
def test_examples_refuse_bad_options_before_starting_ranks(name, args, message):
    done = run_example(name, *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_ep_moe_layer_with_a_rank_that_receives_nothing():
    # one token with top-1 on 4 ranks: at least two ranks receive nothing, and still take part in the backward
    done = run_example("ep_moe_layer.py", "--ranks", "4", "--tokens", "1", "--topk", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert ok_ranks(done.stdout) == set(range(4)), done.stdout


@pytest.mark.parametrize("ranks, extra", [(2, ()), (3, ("--chunks", "12", "--batch", "36", "--steps", "2"))])
def test_dualpipev_example_matches_the_unpipelined_model(ranks, extra):
    done = run_example("dualpipev.py", "--ranks", str(ranks), *extra)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ok_ranks(done.stdout) == set(range(ranks)), done.stdout
    losses = re.findall(r"loss ([\d.]+) \(without the pipeline ([\d.]+)\)", done.stdout)
    assert losses and all(abs(float(a) - float(b)) <= 1e-5 for a, b in losses), done.stdout


def test_dualpipev_example_reports_a_mismatch():
    # the exit path of the script's check: no difference is within a negative tolerance
    done = run_example("dualpipev.py", "--steps", "1", "--tolerance", "-1")
    assert done.returncode != 0
    assert "MISMATCH" in done.stdout and not ok_ranks(done.stdout), done.stdout


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
