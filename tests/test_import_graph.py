"""The library's modules import one another without circles, and the CPU reference transport needs no device module.

The graph is read from the source (`ast`): an edge for every import statement of a module, at module level or inside
a function (an import deferred into a function to dodge a circle still ties the two modules together both ways),
but not in ``if TYPE_CHECKING:`` blocks (annotations only). ``from package import name`` is an edge to ``package.name`` where that is a module, else to ``package``.
The import of a package's ``__init__`` that Python runs before a submodule is not an edge (every submodule would
otherwise sit in a circle with the ``__init__`` that imports it).
"""

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set

SRC = Path(__file__).resolve().parent.parent / "src"
# the device transports (Triton kernels); `smsplit.cuda_driver` is not one: no Triton, and cuda-bindings only when
# called (the reference transport makes its NCCL header stream with it)
DEVICE_MODULES = ["smsplit.ep.nvlink", "smsplit.ep.copy_engine"]


def module_files(root: Path, package: str) -> Dict[str, Path]:
    """Module name -> file, for every module of ``package`` under ``root``."""
    out = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _nodes(node: ast.AST):
    """Every node under ``node``, but those of ``if TYPE_CHECKING:`` blocks (their ``else`` kept)."""
    for child in ast.iter_child_nodes(node):
        yield child
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from _nodes(other)
        else:
            yield from _nodes(child)


def imports_of(name: str, path: Path, modules: Set[str]) -> Set[str]:
    """The modules among ``modules`` that module ``name`` (file ``path``) imports, anywhere in its code."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in _nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a module: that module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path, package: str) -> Dict[str, Set[str]]:
    files = module_files(root, package)
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """A circle of imports ``[a, b, ..., a]``, or None."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def closure(graph: Dict[str, Set[str]], start: str) -> Set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def test_the_library_has_no_import_circle():
    graph = import_graph(SRC, "smsplit")
    assert "smsplit.ep.buffer" in graph and graph["smsplit.ep.buffer"], "the graph was not read"
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_check_finds_a_circle(tmp_path):
    """Two modules of a package that import each other (one at module level, the other in a function, by a relative
    import), beside one whose import under TYPE_CHECKING is no edge."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("import os\nfrom pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("class B:\n    def f(self):\n        from .. import a\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
                                  "else:\n    import pkg.sub.b\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.c"] == {"pkg.sub.b"}
    cycle = find_cycle(graph)
    assert cycle is not None and set(cycle) == {"pkg.a", "pkg.sub.b"}, cycle
    (package / "sub" / "b.py").write_text("class B:\n    def f(self):\n        import json\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) is None


def test_the_reference_transport_imports_no_device_module():
    """Read from the source: nothing the reference transport imports, directly or not, is a device transport or
    imports Triton."""
    graph = import_graph(SRC, "smsplit")
    needed = closure(graph, "smsplit.ep.reference")
    assert "smsplit.ep.host_headers" in needed and "smsplit.ep.transport" in needed
    assert not needed & set(DEVICE_MODULES), needed & set(DEVICE_MODULES)
    files = module_files(SRC, "smsplit")
    for name in needed:
        source = files[name].read_text()
        assert "import triton" not in source and "from triton" not in source, name


def test_importing_the_reference_loads_no_device_module():
    """In a fresh interpreter: importing the reference transport (and with it the `smsplit.ep` package) loads none of
    the device modules. (Triton and cuda-bindings themselves are loaded anyway: by the package's layout kernels, and
    by torch.)"""
    code = ("import sys, smsplit.ep.reference\n"
            f"print([m for m in {DEVICE_MODULES!r} if m in sys.modules])")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
