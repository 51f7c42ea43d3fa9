"""The project's shape, as a newcomer reads it: imports run top-down (train.py -> training -> models ->
cuda_ext, with data below models), no module imports itself around a circle, and no source file outside tests grows
past ~800 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("training", "models", "data", "cuda_ext")
# what each layer may import from the project (itself always)
ALLOWED = {
    "train.py": {"training"},
    "training": {"training", "models", "data", "cuda_ext"},
    "models": {"models", "data", "cuda_ext"},
    "data": {"data"},
    "cuda_ext": {"cuda_ext"},
}
MAX_LINES = 800  # a smell, not a rule: a cohesive module may be long; cut along subjects, not at a count


def project_imports(path: Path) -> set[str]:
    """The top-level project packages ``path`` imports (absolute imports; the project uses no relative ones)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found.update(name.split(".")[0] for name in names if name.split(".")[0] in PACKAGES)
    return found


def layer_of(path: Path) -> str:
    relative = path.relative_to(REPO)
    return relative.parts[0] if len(relative.parts) > 1 else relative.name


SOURCES = [REPO / "train.py"] + sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_imports_run_top_down(path):
    layer = layer_of(path)
    upward = project_imports(path) - ALLOWED[layer]
    assert not upward, f"{path.relative_to(REPO)} ({layer}) imports {sorted(upward)}: an arrow running back up"


def test_the_checker_sees_an_upward_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\nfrom training.app import run\nimport models.model as m\n")
    assert project_imports(sample) == {"training", "models"}


def test_no_source_file_outside_tests_is_long():
    suffixes = {".py", ".h", ".cpp", ".cu", ".cuh", ".sh"}
    long_files = []
    for path in REPO.rglob("*"):
        relative = path.relative_to(REPO)
        if (
            path.suffix not in suffixes
            or relative.parts[0] in {"tests", "build", ".git", ".whl", "scenes"}
            or any(part.startswith(".") or part.endswith(".egg-info") for part in relative.parts)
        ):
            continue
        lines = len(path.read_text(encoding="utf-8", errors="replace").splitlines())
        if lines > MAX_LINES:
            long_files.append(f"{relative} ({lines} lines)")
    assert not long_files, f"split these (over {MAX_LINES} lines): {long_files}"


def module_graph(typing_too: bool = False) -> dict[str, set[str]]:
    """Each project module -> the project modules it imports at run time (function-level imports included; with
    ``typing_too`` also those under ``if TYPE_CHECKING:``). ``from pkg import sub`` is an edge to the submodule."""
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        hidden = set()
        if not typing_too:
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    hidden |= {id(inner) for statement in node.body for inner in ast.walk(statement)}
        edges = set()
        for node in ast.walk(tree):
            if id(node) in hidden:
                continue
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                edges.update(
                    f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                    for alias in node.names
                )
        graph[name] = {e for e in edges if e in modules and e != name and not name.startswith(e + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
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
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_around_a_circle():
    """Run-time imports form no circle (type-only imports under TYPE_CHECKING are not counted here)."""
    assert cycles(module_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
