"""The project's shape, as a newcomer reads it: imports run top-down (train.py -> training -> models ->
cuda_ext, with data below models), and no source file outside tests grows past ~400 lines."""

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
