"""bench/step_outliers.py: a tiny CPU run writes a row for every step, the slowest first, and windows that sum the
rows; under torchrun every rank writes its own; a garbage collection inside a step is charged to that step."""

import gc
import json
import subprocess
import sys

from test_train import REPO, scene_cache, tiny_overrides  # noqa: F401 (scene_cache: the fixture)


def test_tiny_run_writes_every_steps_row_and_the_windows(tmp_path, scene_cache):  # noqa: F811
    out = tmp_path / "steps.json"
    args = ["--json", str(out), "--top", "3", "--"]
    args += tiny_overrides(scene_cache, 7) + [f"hydra.run.dir={tmp_path / 'run'}", "train.turntable_frames=0"]
    result = subprocess.run(
        [sys.executable, "bench/step_outliers.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [row[0] for row in rows] == list(range(1, 8))  # the step each row ends at
    assert all(row[1] > 0 and row[2] >= 0 and row[4:] == [0, 0] for row in rows)  # no CUDA: no segments
    assert [row[1] for row in report["slowest"]] == sorted((row[1] for row in rows), reverse=True)[:3]
    window = report["windows"]["100"]  # steps 1-7 fall in the first window of 100
    assert abs(window["host_ms"] - sum(row[1] for row in rows)) < 0.01
    assert window["collections"] == sum(row[3] for row in rows)
    assert (tmp_path / "run" / "metrics.json").exists() and "step_outliers: 7 steps" in result.stdout


def test_under_torchrun_every_rank_writes_its_steps(tmp_path, scene_cache):  # noqa: F811
    """A rank > 0 leaves train.py by os._exit (no finally): its rows are written when its training ends."""
    from test_distributed import ranks_output, tiny, torchrun

    out = tmp_path / "steps.json"
    args = ["--json", str(out), "--", *tiny(scene_cache, tmp_path / "run", 6)]
    result = torchrun(2, args, script="bench/step_outliers.py")
    assert result.returncode == 0, ranks_output(result)
    for path in (out, out.with_name("steps.json.rank1")):
        assert [row[0] for row in json.loads(path.read_text())["rows"]] == list(range(1, 7)), path


def test_a_collection_is_charged_to_the_step_that_made_it(load_bench):
    outliers = load_bench("step_outliers")
    recorder = outliers.StepRecorder()

    class Trainer:
        step = 0

        def train_step(self):
            self.step += 1
            if self.step == 2:
                gc.collect()

    gc.callbacks.append(recorder.on_gc)
    gc.disable()  # no automatic collection: the only one is step 2's
    try:
        step = recorder.wrap(Trainer.train_step)
        trainer = Trainer()
        for _ in range(3):
            step(trainer)
    finally:
        gc.enable()
        gc.callbacks.remove(recorder.on_gc)
    assert [row[3] for row in recorder.rows] == [0, 1, 0]
    assert [row[2] > 0 for row in recorder.rows] == [False, True, False]  # its milliseconds too, and only there
    assert recorder.report(1)["windows"]["100"]["collections"] == 1
