"""The dependency direction stays as docs/architecture.md draws it: no import cycles between modules,
not even through imports inside functions, nor between folders; jobs/'s
sub-packages on floors that import only downward; the ground
(errors, config, runtime) imports nothing above it; engine knows nothing of files or jobs, io nothing
of models or jobs, monitor nothing of jobs, the CLI reaches the engine only through jobs; and the
scheduler, block manager and sequence run without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "batchgen"
GROUND = ("batchgen.errors", "batchgen.config", "batchgen.runtime")
FORBIDDEN = {  # package -> packages none of its modules may import (at module level or inside a function)
    "errors": ("batchgen.",),
    "config": ("batchgen.engine", "batchgen.io", "batchgen.jobs", "batchgen.monitor", "batchgen.ray",
               "batchgen.cli", "batchgen.runtime"),
    "runtime": ("batchgen.engine", "batchgen.io", "batchgen.jobs", "batchgen.monitor", "batchgen.ray",
                "batchgen.cli", "batchgen.config"),
    "engine": ("batchgen.io", "batchgen.jobs", "batchgen.monitor", "batchgen.ray", "batchgen.cli"),
    "io": ("batchgen.engine", "batchgen.jobs", "batchgen.monitor", "batchgen.ray", "batchgen.cli"),
    "monitor": ("batchgen.jobs", "batchgen.ray", "batchgen.cli"),  # it reads the engine's metric types
    "jobs": ("batchgen.cli", "batchgen.ray"),  # the Ray executor is jobs/executors/ray/; batchgen.ray calls it
    "ray": ("batchgen.cli",),
    "cli": ("batchgen.engine", "batchgen.io"),  # commands go through batchgen.jobs
}
TORCH_FREE = ("batchgen.engine.scheduler.scheduler", "batchgen.engine.kv.block_manager",
              "batchgen.engine.kv.hybrid", "batchgen.engine.kv.groups",
              "batchgen.engine.sequence", "batchgen.config.job", "batchgen.config.rules")
# what a command imports before its checks pass: a user's mistake must not wait seconds for torch
CHECKS_TORCH_FREE = ("batchgen.cli", "batchgen.config.job", "batchgen.jobs.commands.run",
                     "batchgen.jobs.commands.plan", "batchgen.jobs.commands.status")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _runtime_nodes(tree: ast.AST):
    """Every node that runs: `if TYPE_CHECKING:` blocks are skipped (annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_modules(path: Path) -> set[str]:
    """Every dotted name an import in `path` names, module-level or inside a function."""
    names = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def batchgen_dependencies(path: Path) -> set[str]:
    """The batchgen modules `path` imports: `from pkg import name` counts pkg.name where it is a module."""
    deps = set()
    for name in imported_modules(path):
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name:
            deps.add(name)
    deps -= {name for name in deps if any(other.startswith(name + ".") for other in deps)}  # the package of a module
    return deps - {module_name(path)}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycles():
    graph = {name: batchgen_dependencies(path) for name, path in MODULES.items()}
    assert import_cycles(graph) == []


# The imports between sub-packages that may close a loop of folders: none. Never add one: move the
# module that would close the loop below both folders instead (engine/packed_seq.py, jobs/rows/).
FOLDER_LOOPS_LEFT: set[tuple[str, str]] = set()
# jobs/'s floors, lowest first, as docs/architecture.md draws them: a module imports its own floor's
# modules and those of the floors below it, never one above (a sub-folder counts as its floor: executors/ray)
JOBS_FLOORS = ("prompting", "rows", "openai", "planning", "durability", "sharding", "pipeline", "encoding",
               "executors", "commands")


def folder_of(module: str, modules: dict[str, Path]) -> str:
    """The sub-package a module lives in (a package's __init__ is its own folder)."""
    return module if modules[module].name == "__init__.py" else module.rpartition(".")[0]


def folder_graph(module_graph: dict[str, set[str]], allowed: set[tuple[str, str]],
                 modules: dict[str, Path] = MODULES) -> dict[str, set[str]]:
    """Folder -> the folders its modules import, leaving out the `allowed` module imports and those
    between a folder and one inside it (a package's own modules sit above or below its sub-packages)."""
    graph: dict[str, set[str]] = {}
    for module, deps in module_graph.items():
        here = folder_of(module, modules)
        graph.setdefault(here, set())
        for dep in deps:
            there = folder_of(dep, modules)
            nested = there.startswith(here + ".") or here.startswith(there + ".")
            if there != here and not nested and (module, dep) not in allowed:
                graph[here].add(there)
    return graph


def test_no_import_loops_between_folders():
    modules = {name: batchgen_dependencies(path) for name, path in MODULES.items()}
    assert import_cycles(folder_graph(modules, FOLDER_LOOPS_LEFT)) == []
    gone = {(a, b) for a, b in FOLDER_LOOPS_LEFT if b not in modules.get(a, ())}
    assert not gone, f"these imports are gone: remove them from FOLDER_LOOPS_LEFT: {sorted(gone)}"
    for allowed in FOLDER_LOOPS_LEFT:  # each one still closes a loop, else it has no business here
        assert import_cycles(folder_graph(modules, FOLDER_LOOPS_LEFT - {allowed})), allowed


def upward_imports(module_graph: dict[str, set[str]], package: str, floors: tuple[str, ...]) -> list[str]:
    """'module imports dep' for each import of a floor above the importer's; a folder of `package`
    that is on no floor is reported too, so that a new folder is placed before it is used."""
    def floor(module: str) -> str | None:
        return module[len(package) + 1:].split(".")[0] if module.startswith(package + ".") else None

    bad = sorted(f"{module}: a folder on no floor" for module in module_graph
                 if floor(module) is not None and floor(module) not in floors)
    for module, deps in sorted(module_graph.items()):
        here = floor(module)
        for dep in sorted(deps):
            there = floor(dep)
            if here in floors and there in floors and floors.index(there) > floors.index(here):
                bad.append(f"{module} imports {dep}")
    return bad


def test_jobs_floors_import_only_downward():
    modules = {name: batchgen_dependencies(path) for name, path in MODULES.items()}
    assert upward_imports(modules, "batchgen.jobs", JOBS_FLOORS) == []


def test_the_floor_check_sees_an_upward_import_and_an_unplaced_folder():
    graph = {"p.low.x": {"p.high.y"}, "p.high.y": {"p.low.x"}, "p.new.z": set(), "p": {"p.high.y"}}
    assert upward_imports(graph, "p", ("low", "high")) == ["p.new.z: a folder on no floor", "p.low.x imports p.high.y"]
    assert upward_imports({"p.low.x": set(), "p.high.y": {"p.low.x"}}, "p", ("low", "high")) == []


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_imports_from_the_ground_up(package):
    bad = []
    paths = [PACKAGE / f"{package}.py"] if (PACKAGE / f"{package}.py").exists() else (PACKAGE / package).rglob("*.py")
    for path in sorted(paths):
        for name in sorted(imported_modules(path)):
            if name.startswith(FORBIDDEN[package]):
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    assert not bad, bad


def test_scheduler_block_manager_sequence_and_config_import_no_torch():
    code = f"import sys; import {', '.join(TORCH_FREE)}; print(sorted(m for m in sys.modules if m == 'torch'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_the_cli_and_the_job_checks_import_neither_torch_nor_transformers():
    code = (f"import sys; import {', '.join(CHECKS_TORCH_FREE)}; "
            "print(sorted(m for m in sys.modules if m in ('torch', 'transformers', 'tqdm')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_the_checks_see_a_violation(tmp_path):
    """The AST walk finds imports inside functions too, and skips annotation-only imports."""
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import batchgen.engine\n"
                    "def f():\n    from batchgen.jobs.commands.run import run_job\n")
    assert "batchgen.jobs.commands.run" in imported_modules(path)
    assert "batchgen.engine" not in imported_modules(path)


def test_the_folder_check_sees_a_loop_of_folders():
    modules = {name: Path(f"{name.replace('.', '/')}.py") for name in ("p.a.x", "p.b.y", "p.b.z", "p.c")}
    graph = {"p.a.x": {"p.b.y"}, "p.b.y": set(), "p.b.z": {"p.a.x"}, "p.c": {"p.a.x"}}
    assert import_cycles(folder_graph(graph, set(), modules)) == [["p.a", "p.b"]]
    assert import_cycles(folder_graph(graph, {("p.b.z", "p.a.x")}, modules)) == []


def test_the_cycle_check_sees_a_cycle_through_a_function_body():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
