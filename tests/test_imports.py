"""The package's modules import each other without cycles, and utils/ never imports the transform package.

Every ``import`` / ``from ... import`` in the source is read (module level and inside functions, which is
where a lazily imported cycle hides), resolved to the package's own modules, and the graph is checked."""

from __future__ import annotations

import ast
from pathlib import Path

import autodeploy

ROOT = Path(autodeploy.__file__).parent


def _module_name(path: Path) -> str:
    parts = ["autodeploy", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that module ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import mod`` imports the module pkg.mod where there is one
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def _is_package_init_edge(src: str, dst: str) -> bool:
    """A package's ``__init__`` importing its own submodules (to register them) is not a cycle of design."""
    return dst.startswith(src + ".")


def test_no_import_cycle():
    graph = {src: {dst for dst in dsts if not _is_package_init_edge(src, dst)} for src, dsts in _graph().items()}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_utils_never_import_the_transform_package():
    offenders = {src: sorted(d for d in dsts if d.startswith("autodeploy.transform"))
                 for src, dsts in _graph().items() if src.startswith("autodeploy.utils")}
    assert not {src: dsts for src, dsts in offenders.items() if dsts}


# what a process serving a built model must not load: the export and compile stacks (and sympy, setuptools)
# weigh some 90 MiB of resident memory, which peak-memory targets compare against HF's serving process
_BUILD_ONLY = ("torch._inductor", "torch._dynamo", "sympy", "setuptools", "transformers", "autodeploy.transform",
               "autodeploy.compile", "autodeploy.export")


def test_the_canonical_ops_and_their_kernels_load_without_the_build_stacks():
    import subprocess
    import sys

    from autodeploy.custom_ops import native

    native.library()  # built here on a new machine or venv (a build needs cpp_extension): the child loads it
    script = ("import sys, autodeploy, autodeploy.custom_ops\n"
              "from autodeploy.custom_ops import native\n"
              "native.library()\n"
              f"print(sorted(m for m in sys.modules if m.startswith({_BUILD_ONLY!r}))[:20])")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_public_names_load_on_first_use():
    assert autodeploy.LLM.__name__ == "LLM" and callable(autodeploy.optimize)
    assert "SamplingParams" in dir(autodeploy)
