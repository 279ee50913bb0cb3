"""The library stays a library: importing it loads neither the picture and console packages (matplotlib, rich:
only the command line's applications and the pictures use them, when they draw) nor the applications
(`smsplit.apps`) or the test harness."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
LIBRARY = ["smsplit", "smsplit.budget", "smsplit.ep", "smsplit.pipeline", "smsplit.moe", "smsplit.launch",
           "smsplit.copy", "smsplit.fp8", "smsplit.autotune", "smsplit.trace", "smsplit.info", "smsplit.cli"]
NOT_LOADED = ["matplotlib", "rich", "smsplit.apps", "ep_harness"]


def loaded_by_imports(modules: list) -> dict:
    """Imports ``modules`` one after another in a fresh interpreter; for each, which of `NOT_LOADED` its import
    brought into sys.modules."""
    code = (f"import importlib, json, sys\n"
            f"out = {{}}\n"
            f"for name in {modules!r}:\n"
            f"    before = set(sys.modules)\n"
            f"    importlib.import_module(name)\n"
            f"    out[name] = [m for m in {NOT_LOADED!r} if m in sys.modules and m not in before]\n"
            f"print(json.dumps(out))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# the check's own test: the apps import matplotlib and rich where they draw, not at import; these load them
LOADING = {"smsplit.apps.demo": ["smsplit.apps"], "rich.console": ["rich"]}


@pytest.fixture(scope="module")
def loaded():
    """`loaded_by_imports` of the library, then of `LOADING`'s modules, in one interpreter (each import is judged by
    what it adds to sys.modules: the library's, imported first, add nothing of `NOT_LOADED` to what follows)."""
    return loaded_by_imports(LIBRARY + list(LOADING))


def test_importing_the_library_loads_no_pictures_console_apps_or_test_harness(loaded):
    assert {name: loaded[name] for name in LIBRARY} == {name: [] for name in LIBRARY}


def test_the_check_sees_a_module_that_loads_them(loaded):
    """The apps import matplotlib and rich where they draw, not at import; the check sees a module that does."""
    assert {name: loaded[name] for name in LOADING} == LOADING
