"""Smoke test of the render benchmark (bench/bench_render.py) at a tiny size on the CPU, so the script cannot rot:
its rows carry rays/s, fps and the floor verdict, and the shell scene is seen by its cameras."""

from __future__ import annotations

import json


def test_the_render_benchmark_reports_rays_per_second_against_its_floor(load_bench, tmp_path, capsys):
    bench = load_bench("bench_render")
    out = tmp_path / "render.json"
    args = [
        "--device",
        "cpu",
        "--sizes",
        "16",
        "--frames",
        "1",
        "--resolution",
        "16",
        "--out",
        str(out),
        "--profile",
        "1",
    ]
    code = bench.main(args)
    assert code == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert row["size"] == 16 and row["rays_per_second"] > 0 and row["render_path_fps"] > 0
    assert row["floor_rays_per_second"] == bench.FLOOR_RAYS_PER_SECOND and row["last_view_opacity"] > 0.05
    assert 0 < row["metrics_ms_per_view"] and 0 < row["eval_rays_per_second"] < row["rays_per_second"]
    printed = capsys.readouterr().out
    assert "rays/s" in printed and "Self CPU time total" in printed  # the profile's table
