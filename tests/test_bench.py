"""Smoke test of the op benchmark (bench/bench_ops.py) at tiny sizes on the CPU, so the script cannot rot.

Speed is never asserted here: only that every measurement is made, recorded and reported, and that one
failing op is recorded as an error while the rest of the run goes on.
"""

import json
import math

import pytest
import torch

import cuda_ext


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("bench_ops")


def _positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_tiny_cpu_run_records_every_measurement_and_survives_a_failing_op(bench, tmp_path, monkeypatch):
    def broken_gelu(*args, **kwargs):
        raise RuntimeError("deliberately broken by the test")

    monkeypatch.setattr(cuda_ext.reference, "gelu", broken_gelu)
    json_path, md_path = tmp_path / "out.json", tmp_path / "out.md"
    bench.main(
        ["--device", "cpu", "--size", "tiny", "--repeats", "3", "--json", str(json_path), "--markdown", str(md_path)]
    )

    report = json.loads(json_path.read_text())
    for key in ("date", "torch", "device", "size", "copy", "counting_rules", "results", "targets", "errors"):
        assert key in report, key
    assert report["device"]["type"] == "cpu" and report["size"] == "tiny"
    assert _positive(report["copy"]["GBps"])

    rows = {(r["op"], r["case"], r["variant"]): r for r in report["results"]}
    expected_cases = {
        ("trilinear", "grad=feats"),
        ("trilinear", "grad=feats+points"),
        ("grid_interpolate", "random"),
        ("grid_interpolate", "rays"),
        ("upsample", "x2"),
        ("gelu", "exact"),
        ("gelu_rows", "exact"),
        *(("brick_grid_interpolate", f"{points} C={c}") for c in (12, 1) for points in ("random", "rays")),
        ("volume_render", "C=3 B=64"),
        ("volume_render", "C=12 B=64"),
        ("distortion_loss", "B=64"),
    }
    assert {(op, case) for op, case, _ in rows} == expected_cases
    errors = {(e["op"], e["case"], e["variant"], e["phase"]): e["error"] for e in report["errors"]}

    # The pure-PyTorch variants run everywhere: each has positive times, bandwidths and custom-speed-up slots.
    timed = [key for key in rows if key[2] in ("builtin", "former") or (key[2] == "reference" and key[0] != "gelu")]
    # reference: trilinear x2, grid x2, brick x4, upsample, gelu_rows, volume_render x2, distortion_loss; builtin:
    # grid x2, upsample, gelu, gelu_rows; former: volume_render x2, distortion_loss
    assert len(timed) == 13 + 5 + 3
    for key in timed:
        row = rows[key]
        for field in ("fw_ms", "fwbw_ms", "fw_GBps", "fw_pct_copy", "fwbw_GBps"):
            assert _positive(row[field]), (key, field, row[field])
        # fwbw - fw: at tiny sizes timing noise can make it <= 0, which the bench reports as missing
        assert row["bw_ms"] is None or _positive(row["bw_ms"]), (key, row["bw_ms"])
        assert row["fw"]["runs"] >= 3 and row["fwbw"]["runs"] >= 3
        assert "custom_speedup" in row
    for key in [k for k in timed if k[2] in ("builtin", "former") and k[0] != "gelu"]:  # gelu's reference: broken
        assert rows[key]["rel_err_vs_reference"] < 1e-5, key  # F.grid_sample / F.interpolate / former agree
    for key in [k for k in rows if k[0] == "brick_grid_interpolate"]:  # the custom op and its reference agree
        assert rows[key]["bytes_bw"] > rows[key]["bytes_fw"] > 0 and _positive(rows[key]["fw_pct_copy"]), key
        if key[2] == "custom":
            assert rows[key]["rel_err_vs_reference"] < 1e-5 and rows[key]["bw_source"] == "op", key
    for case in ("C=3 B=64", "C=12 B=64"):  # the bytes each pass must move, so the table shows % of copy
        row = rows[("volume_render", case, "custom")]
        assert row["bytes_fw"] > 0 and row["bytes_bw"] > row["bytes_fw"] and _positive(row["fw_pct_copy"])
        assert row["rel_err_vs_reference"] < 1e-5 and _positive(row["bw_ms"]) and row["bw_source"] == "op"

    # The broken op is an error row, not a crash, and the ops after it were still measured.
    assert "deliberately broken" in errors[("gelu", "exact", "reference", "fw")]
    assert rows[("gelu", "exact", "reference")]["fw_ms"] is None

    # Custom ops are either measured or recorded as failing, whatever state their kernels are in.
    for key, row in rows.items():
        if key[2] == "custom":
            assert _positive(row["fw_ms"]) or key + ("fw",) in errors, key

    markdown = md_path.read_text()
    assert markdown.count("\n| ") >= 1 + len(rows) and "errors:" in markdown
    assert [t["name"] for t in report["targets"]] == ["CPU grid_interpolate random fwbw >= 2x reference"]


def test_grid_channel_sweep_names_each_channel_count_and_matches_the_reference(bench, tmp_path):
    json_path = tmp_path / "sweep.json"
    bench.main(
        [
            "--device",
            "cpu",
            "--size",
            "tiny",
            "--repeats",
            "3",
            "--ops",
            "grid",
            "--variants",
            "custom,reference",
            "--grid-channels",
            "3,4,6",
            "--json",
            str(json_path),
        ]
    )
    report = json.loads(json_path.read_text())
    assert report["grid_channels"] == [3, 4, 6] and report["errors"] == []
    rows = {(r["case"], r["variant"]): r for r in report["results"]}
    # tiny's own channel count (4) keeps the plain case names, so the targets still find them
    cases = {"random C=3", "rays C=3", "random", "rays", "random C=6", "rays C=6"}
    assert {case for case, _ in rows} == cases
    for case in cases:
        channels = 4 if case in ("random", "rays") else int(case.split("C=")[1])
        assert rows[(case, "custom")]["shape"].startswith(f"12^3x{channels} ")
        assert rows[(case, "custom")]["rel_err_vs_reference"] < 1e-6, case
        assert _positive(rows[(case, "custom")]["fwbw_ms"])


@pytest.mark.parametrize("value", ["", "0,4", "four"])
def test_grid_channels_rejects_bad_values(bench, value):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--grid-channels", value])


def test_ray_points_lie_in_the_box_and_advance_along_each_ray(bench):
    gen = torch.Generator().manual_seed(1)
    rays, samples = 50, 32
    points = bench.ray_points(rays, samples, gen).reshape(rays, samples, 3)
    assert points.abs().max() <= 1
    steps = points.diff(dim=1)
    direction = steps[:, :1] / steps[:, :1].norm(dim=-1, keepdim=True)
    # Consecutive samples of a ray are evenly spaced along one direction (ray-major order).
    assert torch.allclose(steps, steps[:, :1].expand_as(steps), atol=1e-5)
    assert (steps.norm(dim=-1) > 0).all() and torch.allclose((steps * direction).sum(-1), steps.norm(dim=-1), atol=1e-5)


def test_targets_pass_miss_and_missing_numbers(bench):
    def row(variant, fwbw_ms):
        return {"op": "grid_interpolate", "case": "random", "variant": variant, "fwbw_ms": fwbw_ms}

    def status(custom_ms):
        rows = [row("reference", 10.0), row("custom", custom_ms)]
        return bench.evaluate_targets(rows, "cpu", "small")[0]["status"]

    assert status(4.0) == "PASS"  # 2.5x
    assert status(6.0) == "MISS"  # 1.7x
    assert status(None) == "n/a"  # the custom op failed
