"""python -m training.eval: a finished run scored on any split, apart from its own outputs (metrics.json and renders/
stay byte for byte), with the end of training's metric code; errors are one line naming the option."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from test_train import REPO, finished_run, scene_cache  # noqa: F401  (fixtures: a 12-step CPU run of the built-in scene)

from training import eval as run_eval


def digest(folder) -> dict[str, str]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_eval_on_the_train_split_leaves_the_runs_outputs_alone(finished_run):  # noqa: F811
    metrics = (finished_run / "metrics.json").read_bytes()
    renders = digest(finished_run / "renders")
    result = subprocess.run(
        [sys.executable, "-m", "training.eval", str(finished_run), "--split", "train", "--device", "cpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    written = json.loads((finished_run / "eval_train.json").read_text())
    assert written["split"] == "train" and written["views"] == 6 and len(written["per_view"]) == 6
    assert all(isinstance(v["psnr"], float) and isinstance(v["ssim"], float) for v in written["per_view"])
    assert [v["name"] for v in written["per_view"]] == [f"./train/r_{i}" for i in range(6)]
    assert written["psnr"] == pytest.approx(sum(v["psnr"] for v in written["per_view"]) / 6)
    assert written["psnr_worst10"] <= written["psnr"] and len(written["worst_views"]) == 1
    for view in range(6):
        assert (finished_run / "eval_train" / f"{view:03d}_pred.png").stat().st_size > 0
    assert "PSNR" in result.stdout and "eval_train.json" in result.stdout
    assert (finished_run / "metrics.json").read_bytes() == metrics  # byte for byte
    assert digest(finished_run / "renders") == renders
    assert not [p for p in finished_run.glob(".*") if p.name != ".hydra"]  # no temporary left


def test_the_default_split_scores_as_training_did_and_an_evaluation_is_replaced_whole(finished_run, tmp_path):  # noqa: F811
    out = tmp_path / "elsewhere" / "scores.json"
    first = run_eval.evaluate_run(finished_run, out=out, device="cpu", progress=False)
    metrics = json.loads((finished_run / "metrics.json").read_text())
    assert first["split"] == metrics["eval_split"] == "test"
    assert first["psnr"] == pytest.approx(metrics["psnr"], abs=1e-4)  # the same renders, the same metric code
    assert [v["psnr"] for v in first["per_view"]] == pytest.approx([v["psnr"] for v in metrics["per_view"]], abs=1e-4)
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["scores", "scores.json"]
    (out.with_suffix("") / "stale.txt").write_text("from before")
    run_eval.evaluate_run(finished_run, out=out, device="cpu", progress=False)  # again: the folder is replaced
    assert not (out.with_suffix("") / "stale.txt").exists() and (out.with_suffix("") / "000_pred.png").is_file()
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["scores", "scores.json"]
    # --data-root: the same scene at another path (the generated scene is a blender-format folder)
    root = next(p.parent for p in (finished_run.parent.parent).rglob("transforms_test.json"))
    other = run_eval.evaluate_run(finished_run, "val", data_root=root, out=tmp_path / "v.json", device="cpu")
    assert other["split"] == "val" and other["views"] == 2 and other["data_root"] == str(root)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--split", "nope"], "error: --split: the scene"),
        (["--out", "{run}/metrics.json"], "error: --out: metrics.json is the run's own evaluation"),
        (["--out", "{run}/scores.txt"], "error: --out:"),
        (["--data-root", "/nonexistent/scene"], "error: --data-root: /nonexistent/scene does not exist"),
        (["--chunk", "0"], "error: --chunk: must be >= 1"),
    ],
)
def test_errors_are_one_line(finished_run, capsys, args, message):  # noqa: F811
    args = [a.replace("{run}", str(finished_run)) for a in args]
    metrics = (finished_run / "metrics.json").read_bytes()
    assert run_eval.main([str(finished_run), "--device", "cpu", *args]) == run_eval.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert (finished_run / "metrics.json").read_bytes() == metrics


def test_a_missing_run_is_one_line(tmp_path, capsys):
    assert run_eval.main([str(tmp_path / "nothing")]) == run_eval.EXIT_USAGE
    assert capsys.readouterr().err == f"error: {tmp_path / 'nothing'}: no such run folder\n"
