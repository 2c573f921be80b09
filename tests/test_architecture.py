"""The import graph of ``harness/`` and ``variants/``: no cycles, no import from a lower stage to a higher one, and
no module over 500 lines.

Stages, highest first; a module may import from its own stage or any lower one. A module takes the stage of the
longest prefix listed (``variants.errors`` sits with ``harness.errors``, not with the mixers)::

    0  harness (the package's lazy facade), harness.cli
    1  harness.commands
    2  harness.sweeps
    3  harness.benchmarks, harness.evaluation
    4  harness.training, harness.reporting
    5  harness.model, harness.rundir, harness.tracking, harness.preflight
    6  harness.data, harness.config, variants
    7  harness.io, harness.registry, harness.measure, harness.sbatch, harness.units, harness.yamltext,
       variants.registry
    8  harness.errors, variants.errors

Run folders, tracking and pre-flight checks describe one run of a model, so they sit with the model; the
configuration parses its variant against the registry of mixers (``variants.spec``), so it sits beside them; the
small helpers that only parse, format or measure sit below.

Imports inside functions count: a deferred import still ties the two modules together.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500

STAGES = [
    ["harness", "harness.cli"],
    ["harness.commands"],
    ["harness.sweeps"],
    ["harness.benchmarks", "harness.evaluation"],
    ["harness.training", "harness.reporting"],
    ["harness.model", "harness.rundir", "harness.tracking", "harness.preflight"],
    ["harness.data", "harness.config", "variants"],
    [
        "harness.io",
        "harness.registry",
        "harness.measure",
        "harness.sbatch",
        "harness.units",
        "harness.yamltext",
        "variants.registry",
    ],
    ["harness.errors", "variants.errors"],
]

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


def stage_of(module: str) -> int:
    best, best_len = None, -1
    for index, prefixes in enumerate(STAGES):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} has no stage: add it to STAGES")
    return best


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
    import harness.registry
    import variants.errors
    import variants.registry

    assert harness.errors.UsageError is variants.errors.UsageError
    assert harness.errors.DepthmemError is variants.errors.DepthmemError
    assert harness.registry.Registry is variants.registry.Registry


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


def test_every_module_has_a_stage():
    for module in import_graph():
        stage_of(module)


def test_no_import_cycle():
    graph = {m: targets - CYCLE_EXEMPT for m, targets in import_graph().items() if m not in CYCLE_EXEMPT}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_from_a_lower_stage_to_a_higher_one():
    upward = [
        f"{module} (stage {stage_of(module)}) imports {target} (stage {stage_of(target)})"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if stage_of(target) < stage_of(module)
    ]
    assert not upward, "\n".join(upward)


def _line_counts() -> dict[str, int]:
    return {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in _modules().values()}


def test_no_module_over_500_lines():
    over = {path: n for path, n in _line_counts().items() if n > MAX_LINES}
    assert not over, over
