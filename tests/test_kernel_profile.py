"""bench/kernel_profile.py on the CPU: a tiny train.py run, timed plain and then under torch.profiler, so the script
cannot rot (on a GPU it also writes the kernels' table; no time is asserted here)."""

import subprocess
import sys

from test_train import REPO, scene_cache, tiny_overrides  # noqa: F401 (scene_cache: the fixture)


def test_tiny_run_writes_the_timings_and_tables(tmp_path, scene_cache):  # noqa: F811
    out = tmp_path / "profile.txt"
    args = ["--out", str(out), "--first", "4", "--steps", "2", "--"]
    args += tiny_overrides(scene_cache, 8) + [f"hydra.run.dir={tmp_path / 'run'}", "train.turntable_frames=0"]
    result = subprocess.run(
        [sys.executable, "bench/kernel_profile.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = out.read_text()
    assert text.startswith("steps 4..6: plain ") and "ms/step" in text.splitlines()[0]
    assert "by host time" in text and "aten::" in text  # the host table lists the step's ops
    sections = text[text.index("by section of the step") :].splitlines()[1:]
    named = {line.split()[0] for line in sections if line.strip()}
    assert {"sampling", "forward", "loss_backward", "optimizer"} <= named, sections
    assert all(" ATen calls, " in line for line in sections if line.strip())
    assert (tmp_path / "run" / "metrics.json").exists()  # the run itself went on to its end


def test_rejects_a_window_before_the_plain_steps(tmp_path):
    result = subprocess.run(
        [sys.executable, "bench/kernel_profile.py", "--out", str(tmp_path / "p.txt"), "--first", "2", "--steps", "5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "--first (2) must be >= --steps (5)" in result.stderr
