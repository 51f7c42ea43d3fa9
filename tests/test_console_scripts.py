"""The console scripts of setup.py: each names a function that exists, and each command answers --help (run as the
installed script would run it, in a subprocess)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys

import pytest
from test_train import REPO

from training import cli


def console_scripts() -> dict[str, str]:
    """name: "module:function" from setup.py's entry_points (read, not run: setup.py builds the extension)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            scripts = ast.literal_eval(node.value)["console_scripts"]
            return dict(tuple(part.strip() for part in line.split("=", 1)) for line in scripts)
    raise AssertionError("setup.py has no entry_points")


def test_every_job_has_a_script_naming_a_function():
    scripts = console_scripts()
    jobs = ("train", "process", "view", "render", "export", "eval")
    assert {"voxel-field", *(f"voxel-field-{job}" for job in jobs)} == set(scripts)
    for name, target in scripts.items():
        module, function = target.split(":")
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not in this tree yet")
        assert callable(getattr(importlib.import_module(module), function)), name


HELP = {  # script: the command its --help runs as, and what the help must name
    "voxel-field": (["-m", "training.cli"], ["train", "render", "export", "eval"]),
    "voxel-field-train": (["-c", "import sys; from training.cli import train; sys.exit(train())"], ["Hydra"]),
    "voxel-field-view": (["-m", "training.view"], ["run_dir", "--port"]),
    "voxel-field-render": (["-m", "training.render_path"], ["run_dir", "interpolate", "--frames", "--out"]),
    "voxel-field-export": (["-m", "training.export"], ["pointcloud", "mesh", "cameras"]),
    "voxel-field-eval": (["-m", "training.eval"], ["run_dir", "--split", "--data-root", "--out"]),
    "voxel-field-process": (["-m", "training.process"], []),
}


def test_each_command_answers_help():
    if importlib.util.find_spec("training.process") is None:
        HELP.pop("voxel-field-process")
    running = {
        name: subprocess.Popen(
            [sys.executable, *command, "--help"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, (command, _) in HELP.items()
    }
    for name, process in running.items():
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, (name, err[-2000:])
        for word in HELP[name][1]:
            assert word in out, (name, word, out)


def test_the_dispatcher_names_a_bad_verb(capsys):
    assert cli.main(["bogus"]) == 2
    assert capsys.readouterr().err.startswith("error: voxel-field: unknown verb 'bogus'")
    assert cli.main([]) == 2 and "usage: voxel-field <verb>" in capsys.readouterr().out
