"""The torch and Triton releases smsplit supports, checked when ``smsplit`` is imported.

smsplit's kernels are Triton code with inline PTX, and its transports use torch internals (CUDA IPC, stream memory
operations, green contexts); each release in these ranges has had its tests run (CPU suite, and every kernel compiled
for sm_90 with the PTX it promises). Outside them, rather than fail later in a kernel compile or, worse, run
different code, ``import smsplit`` raises `UnsupportedVersionError` naming the package, its version and the range.
``SMSPLIT_ALLOW_UNSUPPORTED=1`` turns that error into a warning, for trying a release not yet tested.

The versions are read from the installed packages' metadata, so the check imports neither torch nor Triton. Triton
is optional here: it exists for Linux only, and a machine without it still imports smsplit and its modules that need
no kernel (the others fail to import, naming triton).
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings

# [lowest, first unsupported) (major, minor) releases; pyproject.toml's dependencies say the same
# (tests/test_versions.py checks that they agree).
SUPPORTED = {"torch": ((2, 11), (2, 15)), "triton": ((3, 6), (3, 10))}
ALLOW_ENV = "SMSPLIT_ALLOW_UNSUPPORTED"


class UnsupportedVersionError(ImportError):
    """A torch or Triton release outside the ranges smsplit supports."""


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``2.14.1+cu130``, ``3.9.0`` or ``2.15.0.dev20260101``."""
    parts = version.split(".")
    try:
        major = int(parts[0])
        minor = int("".join(c for c in parts[1] if c.isdigit()) if len(parts) > 1 else "0")
    except ValueError:
        raise UnsupportedVersionError(f"cannot read a release from the version string {version!r}") from None
    return major, minor


def range_text(package: str) -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED[package]
    return f"{package}>={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


# Distributions that install a package's module under another name (torch's own builds of Triton).
_ALSO_SHIPPED_AS = {"triton": ("pytorch-triton",)}


def installed(package: str) -> str | None:
    """The installed version of ``package`` (from its metadata), or None where it is not installed."""
    for distribution in (package, *_ALSO_SHIPPED_AS.get(package, ())):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def problems(versions: dict[str, str | None]) -> list[str]:
    """One message per package of ``versions`` (name -> version string, None: not installed) outside its range."""
    found = []
    for package, version in versions.items():
        if version is None:
            continue
        low, high = SUPPORTED[package]
        if not low <= release(version) < high:
            found.append(f"{package} {version} is installed; smsplit supports {range_text(package)} "
                         f"(pip install '{range_text(package)}')")
    return found


def check(versions: dict[str, str | None] | None = None) -> None:
    """Raise `UnsupportedVersionError` if the installed torch or Triton (or those of ``versions``) is outside
    `SUPPORTED`; with ``SMSPLIT_ALLOW_UNSUPPORTED=1``, warn instead."""
    if versions is None:
        versions = {package: installed(package) for package in SUPPORTED}
    found = problems(versions)
    if not found:
        return
    message = "; ".join(found) + f". (Set {ALLOW_ENV}=1 to use it anyway, untested.)"
    if os.environ.get(ALLOW_ENV, "") == "1":
        warnings.warn(message, stacklevel=3)
        return
    raise UnsupportedVersionError(message)
