"""The import graph of ``harness/`` and ``variants/`` against the layout CONTRIBUTING.md writes down ("Where things
live"): every top-level module placed in a layer, no import from a lower layer to a higher one, no cycles, and no
module over 500 lines.

The layout is read from CONTRIBUTING.md's table, so the page and this test cannot disagree. A module takes the
layer of the longest name listed (``variants.errors`` has a row of its own; ``variants.preln`` falls under
``variants``). Imports inside functions count: a deferred import still ties the two modules together.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def written_layout(guide: str) -> dict[str, int]:
    """Module -> layer from the table of CONTRIBUTING.md's "Where things live" (layer 1 is the highest)."""
    start = guide.index("## Where things live")
    end = guide.index("\n## ", start)
    rows = re.findall(r"(?m)^\| (\d+) \| `([\w.]+)` \| .+ \|$", guide[start:end])
    layout = {module: int(layer) for layer, module in rows}
    assert len(layout) == len(rows), "CONTRIBUTING.md places a module twice"
    return layout


LAYOUT = written_layout((ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8"))

CYCLE_EXEMPT: set[str] = set()  # none: a module here would be left out of the cycle check


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path = ROOT) -> dict[str, Path]:
    return {
        _module_name(p, root): p for package in ("harness", "variants") for p in sorted((root / package).rglob("*.py"))
    }


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = _modules(root)
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(_resolve(alias.name, modules) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - node.level + 1]
                    base = ".".join(package + ([base] if base else []))
                for alias in node.names:
                    # `from package import module` names the module; `from module import function` the module.
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else _resolve(base, modules))
        targets.discard(None)
        targets.discard(name)
        graph[name] = targets
    return graph


def layer_of(module: str) -> int:
    """The layer of ``module``: that of the longest name in the layout that is the module or a package above it."""
    owners = [name for name in LAYOUT if module == name or module.startswith(name + ".")]
    if not owners:
        raise AssertionError(f"{module} has no layer: add it to the table in CONTRIBUTING.md, 'Where things live'")
    return LAYOUT[max(owners, key=len)]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_graph_sees_function_level_and_relative_imports(tmp_path):
    package = tmp_path / "harness"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from harness.sub import b\n")
    (package / "sub" / "__init__.py").write_text("from . import b\n")
    (package / "sub" / "b.py").write_text("from ..a import f\n")
    (tmp_path / "variants").mkdir()
    graph = import_graph(tmp_path)
    assert graph["harness.a"] == {"harness.sub.b"}
    assert graph["harness.sub"] == {"harness.sub.b"}
    assert graph["harness.sub.b"] == {"harness.a"}
    assert find_cycle(graph) == ["harness.a", "harness.sub.b", "harness.a"]


def test_variants_import_nothing_from_the_harness():
    harness_imports = {
        module: sorted(t for t in targets if t.split(".")[0] == "harness")
        for module, targets in import_graph().items()
        if module.split(".")[0] == "variants"
    }
    assert not any(harness_imports.values()), {m: t for m, t in harness_imports.items() if t}


def test_the_harness_raises_the_errors_the_mixers_raise():
    import harness.errors
    import variants.errors

    assert harness.errors.UsageError is variants.errors.UsageError
    assert harness.errors.DepthmemError is variants.errors.DepthmemError


@pytest.mark.slow
def test_variants_import_and_build_without_the_harness():
    """In a fresh interpreter: importing ``variants`` and building a mixer loads no module of ``harness``."""
    code = (
        "import sys, variants\n"
        "assert not any(m == 'harness' or m.startswith('harness.') for m in sys.modules)\n"
        "variants.build('ldm-rls', d_model=32, n_layers=4)\n"
        "assert variants.names()[0] == 'preln'\n"
        "loaded = sorted(m for m in sys.modules if m == 'harness' or m.startswith('harness.'))\n"
        "assert not loaded, loaded\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)


def test_the_layout_names_every_top_level_module_but_the_mixers():
    """Each top-level module of ``harness/`` and ``variants/`` has a row of its own, except the mixer modules,
    which the row ``variants`` holds; and every row names a module that exists."""
    import variants

    top = {".".join(m.split(".")[:2]) for m in import_graph()}
    mixers = {f"variants.{name}" for name in variants.MODULES}
    assert top - mixers - set(LAYOUT) == set(), "modules without a row in CONTRIBUTING.md's layout"
    assert set(LAYOUT) - top == set(), "rows of CONTRIBUTING.md's layout that name no module"
    assert not mixers & set(LAYOUT), "a mixer module has a row of its own; the row `variants` holds them"


def test_written_layout_reads_rows_and_refuses_a_module_placed_twice():
    table = "| Layer | Module | What |\n|---|---|---|\n| 1 | `a` | x |\n| 2 | `a.b` | y |\n"
    guide = f"## Where things live\n\n{table}\n## Next"
    assert written_layout(guide) == {"a": 1, "a.b": 2}
    with pytest.raises(AssertionError, match="twice"):
        written_layout(guide.replace("`a.b`", "`a`"))


def test_no_import_cycle():
    graph = {m: targets - CYCLE_EXEMPT for m, targets in import_graph().items() if m not in CYCLE_EXEMPT}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if layer_of(target) < layer_of(module)
    ]
    assert not upward, "\n".join(upward)


def _line_counts() -> dict[str, int]:
    return {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in _modules().values()}


def test_no_module_over_500_lines():
    over = {path: n for path, n in _line_counts().items() if n > MAX_LINES}
    assert not over, over
