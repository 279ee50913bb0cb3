"""The supported torch and Triton releases: pyproject.toml declares them, ``import smsplit`` refuses others by name."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from smsplit import versions

pytestmark = pytest.mark.versioned  # (CI runs these under every supported torch and Triton)

ROOT = Path(__file__).resolve().parent.parent


def _requirement(package):
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(rf"{package}\b", d)]
    return spec.split(";")[0].strip()


@pytest.mark.parametrize("package", ["torch", "triton"])
def test_pyproject_declares_the_ranges_the_import_checks(package):
    assert _requirement(package) == versions.range_text(package)
    assert versions.range_text("torch") == "torch>=2.11,<2.15" and versions.range_text("triton") == "triton>=3.6,<3.10"


@pytest.mark.parametrize("torch_version,triton_version", [
    ("2.11.0", "3.6.0"), ("2.13.0+cpu", "3.9.0"), ("2.14.1+cu130", "3.8.0"), ("2.11.0a0+gitabc", "3.7.1"),
    ("2.13.0", None)])  # no Triton (not Linux, or a CPU-only install): nothing to check
def test_supported_releases_pass(torch_version, triton_version):
    versions.check({"torch": torch_version, "triton": triton_version})


@pytest.mark.parametrize("package,version", [
    ("torch", "2.10.2"), ("torch", "2.15.0"), ("torch", "2.15.0.dev20260101+cu130"), ("torch", "3.0.0"),
    ("triton", "3.5.1"), ("triton", "3.10.0"), ("triton", "4.0.0")])
def test_a_release_outside_the_range_is_refused_by_name(package, version, monkeypatch):
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    given = {"torch": "2.13.0", "triton": "3.6.0", package: version}
    with pytest.raises(versions.UnsupportedVersionError) as raised:
        versions.check(given)
    message = str(raised.value)
    assert f"{package} {version} is installed" in message and versions.range_text(package) in message
    other = "triton" if package == "torch" else "torch"
    assert f"{other} " not in message.replace(versions.range_text(package), "")  # only the package outside its range
    assert isinstance(raised.value, ImportError)


def test_both_outside_are_both_named(monkeypatch):
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(versions.UnsupportedVersionError, match=r"torch 2\.9\.0 .*triton 3\.4\.0"):
        versions.check({"torch": "2.9.0", "triton": "3.4.0"})


def test_the_override_warns_instead(monkeypatch):
    monkeypatch.setenv(versions.ALLOW_ENV, "1")
    with pytest.warns(UserWarning, match=r"torch 2\.15\.0 is installed"):
        versions.check({"torch": "2.15.0", "triton": "3.6.0"})


def test_the_check_reads_the_installed_packages(monkeypatch):
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    seen = {"torch": "2.16.0", "triton": "3.6.0"}
    monkeypatch.setattr(versions, "installed", seen.get)
    with pytest.raises(versions.UnsupportedVersionError, match=r"torch 2\.16\.0"):
        versions.check()
    seen["torch"] = "2.13.0"
    versions.check()


def test_triton_from_torchs_own_builds_is_checked_too(monkeypatch):
    import importlib.metadata as md

    def version(distribution):
        if distribution == "pytorch-triton":
            return "3.10.0+git1234"
        raise md.PackageNotFoundError(distribution)
    monkeypatch.setattr(md, "version", version)
    assert versions.installed("triton") == "3.10.0+git1234" and versions.installed("torch") is None
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(versions.UnsupportedVersionError, match=r"triton 3\.10\.0\+git1234 is installed"):
        versions.check()


_IMPORT_WITH = """
import importlib.metadata as md, sys
fake = {fake!r}
real = md.version
def version(package):
    if package in fake:
        if fake[package] is None:
            raise md.PackageNotFoundError(package)
        return fake[package]
    return real(package)
md.version = version
if fake.get("triton", "") is None:  # no Triton at all: importing it fails as on a machine without it
    class NoTriton:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "triton":
                raise ModuleNotFoundError("No module named 'triton'", name="triton")
    sys.meta_path.insert(0, NoTriton())
import smsplit, smsplit.cli, smsplit.budget, smsplit.pipeline

print("imported", smsplit.__version__)
"""


def _import(fake):
    env = {k: v for k, v in os.environ.items() if k != versions.ALLOW_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", _IMPORT_WITH.format(fake=fake)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_import_smsplit_refuses_an_unsupported_triton():
    done = _import({"triton": "3.5.0"})
    assert done.returncode != 0 and "UnsupportedVersionError" in done.stderr
    assert "triton 3.5.0 is installed; smsplit supports triton>=3.6,<3.10" in done.stderr


def test_import_smsplit_works_without_triton():
    done = _import({"triton": None})
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-2000:]
