"""The docs keep their bars: docs/config.md is what docs/make_config_reference.py writes from the schema and the
configs now (every key of the composed default config, none extra, each with a meaning); README.md stays a short
page for users with CI's test command; bench/README.md stays a guide, not a log."""

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
TEST_COMMAND = (
    'python3 -m pip install "torch>=2.4" ninja "setuptools>=64" wheel && '
    'python3 -m pip install --no-build-isolation -e ".[test]" && python3 -m pytest -q'
)
COMMIT_ID = re.compile(r"\b[0-9a-f]{7,40}\b")


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("make_config_reference", REPO / "docs" / "make_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _keys_section(text: str) -> dict[str, str]:
    """``key -> meaning`` of the reference's "Keys" table."""
    section = text.split("\n## Keys", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| `[^`]*` \| (.*) \|$", section, flags=re.MULTILINE)
    return dict(rows)


def test_config_reference_is_current(generator):
    written = (REPO / "docs" / "config.md").read_text()
    assert written == generator.render(), "docs/config.md is out of date: run python docs/make_config_reference.py"


def test_config_reference_lists_every_key_once_with_a_meaning(generator):
    keys = list(generator.flatten(generator.compose([])))
    listed = _keys_section((REPO / "docs" / "config.md").read_text())
    assert sorted(listed) == sorted(keys)
    assert [key for key, meaning in listed.items() if not meaning.strip()] == []


def test_yaml_comments_are_read_with_their_continuations(tmp_path, generator):
    path = tmp_path / "x.yaml"
    path.write_text(
        "# header\nalpha: 1      # first part\n              # second part\n\n"
        "# block: heading\nbeta:\n  gamma: 'a # b'  # short\n  delta: 2\n"
    )
    comments = generator.yaml_comments(path, "g.")
    assert comments == {"g.alpha": "first part second part", "g.beta.gamma": "block: heading: short"}


def test_readme_is_short_without_commit_ids():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert len(text.encode()) <= 20 * 1024
    assert COMMIT_ID.findall(text) == []


def test_readme_keeps_ci_test_command():
    lines = README.read_text().splitlines()
    marker = lines.index("<!-- test-command -->")
    assert lines[marker + 1] == "```bash"
    assert lines[marker + 2] == TEST_COMMAND


def test_readme_own_capture_comes_first_and_links_exist():
    text = README.read_text()
    lower = text.lower()
    assert lower.index("capture") == text.index("## Your own capture") + len("## Your own ")
    assert text.index("## Your own capture") < lower.index("colmap")
    for link in ("docs/config.md", "docs/decisions.md", "bench/README.md"):
        assert link in text and (REPO / link).is_file()


def test_bench_readme_is_a_guide():
    assert len((REPO / "bench" / "README.md").read_bytes()) <= 60 * 1024
