"""Without the compiled extension the references and ops=torch still work; a custom op says how to build it."""

from __future__ import annotations

import subprocess
import sys

from test_model import backends
from test_train import REPO, read_metrics, tiny_overrides

WITHOUT_EXTENSION = """
import runpy, sys
sys.modules["cuda_ext._C"] = None  # as if the extension was never built
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""


def run_without_extension(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTENSION, *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_references_and_ops_torch_need_no_build(tmp_path):
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['cuda_ext._C'] = None\n"
            "import torch, cuda_ext, cuda_ext.reference as r\n"
            "print(cuda_ext.has_extension(), float(r.gelu(torch.ones(1))))",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0 and probe.stdout.split() == ["False", "0.8413447141647339"], probe.stderr
    result = run_without_extension(
        tiny_overrides(tmp_path / "cache", 4) + [f"hydra.run.dir={tmp_path / 'run'}", "train.turntable_frames=0"]
    )
    assert result.returncode == 0, result.stderr
    assert read_metrics(tmp_path / "run")["ops"] == backends("torch")


def test_a_custom_op_without_the_extension_says_how_to_build_it(tmp_path):
    overrides = [o for o in tiny_overrides(tmp_path / "cache", 4) if not o.startswith("ops=")]
    result = run_without_extension(overrides + [f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.returncode == 2
    assert "ops.grid_interpolate: cuda_ext: the compiled extension" in result.stderr and "pip install" in result.stderr
    assert "Traceback" not in result.stderr
