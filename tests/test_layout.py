"""The layout's import arrows (../shared/docs/layout.md), read from the source with `ast`, imports
inside functions included: no cycle between modules or between packages, the library below the
services, `alerts` a pure rule library, and settings importable without the ML stack."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sparse_engine", "services", "alerts", "dashboards")
# sparse_engine's subpackages, lowest first: a module may import only from its own
# subpackage or from one listed earlier.
ENGINE_ORDER = (
    "jsonstore",
    "data",
    "model",
    "sparsity",
    "evaluation",
    "runtime",
    "calibration",
    "trust",
    "compression",
    "bench",
)
SERVICE_FREE = ("kafka", "prometheus_client", "celery", "fastapi", "sqlalchemy", "services")


def module_files() -> dict[str, Path]:
    found = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imported(path: Path, module: str) -> Iterator[str]:
    """Every module name `path` imports; `from a import b` names a.b when that is a module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                yield f"{base}.{alias.name}"


def edges() -> dict[str, set[str]]:
    modules = module_files()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name in imported(path, module):
            target = resolve(name)
            if target is not None and target != module:
                graph[module].add(target)
    return graph


def external_imports() -> dict[str, set[str]]:
    return {
        module: {name.split(".")[0] for name in imported(path, module)}
        for module, path in module_files().items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for source, targets in graph.items():
        here = package_of(source)
        packages.setdefault(here, set()).update(
            package_of(t) for t in targets if package_of(t) != here
        )
    return packages


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules() -> None:
    assert cycles(edges()) == []


def test_no_import_cycle_between_packages() -> None:
    assert cycles(package_graph(edges())) == []


def test_arrows_never_run_back_into_services() -> None:
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in edges().items()
        if source.startswith(("sparse_engine", "alerts"))
        for target in targets
        if target.startswith("services")
    )
    assert upward == []


def test_the_engine_library_imports_no_service_stack() -> None:
    found = sorted(
        f"{module} imports {name}"
        for module, names in external_imports().items()
        if module.startswith("sparse_engine")
        for name in names & set(SERVICE_FREE)
    )
    assert found == []


def test_engine_subpackages_import_only_lower_ones() -> None:
    rank = {f"sparse_engine.{name}": i for i, name in enumerate(ENGINE_ORDER)}
    engine_packages = {m: t for m, t in package_graph(edges()).items() if m in rank}
    assert set(engine_packages) == set(rank), "ENGINE_ORDER lists every subpackage"
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in engine_packages.items()
        for target in targets
        if target in rank and rank[target] >= rank[source]
    )
    assert upward == []


def test_no_module_outside_a_subpackage_but_the_listed_ones() -> None:
    loose = sorted(p.name for p in (ROOT / "sparse_engine").glob("*.py"))
    assert loose == ["__init__.py", "jsonstore.py"]


def test_settings_import_without_the_ml_stack() -> None:
    code = (
        "import sys, services.config; "
        "print(sorted(m for m in ('torch', 'transformers', 'sparse_engine') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
