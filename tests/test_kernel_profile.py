"""bench/kernel_profile.py on the CPU: a tiny train.py run, timed plain and then under torch.profiler, so the script
cannot rot (on a GPU it also writes the kernels' table; no time is asserted here)."""

import subprocess
import sys
from types import SimpleNamespace

import torch
from test_train import REPO, scene_cache, tiny_overrides  # noqa: F401 (scene_cache: the fixture)


def test_tiny_run_writes_the_timings_and_tables(tmp_path, scene_cache):  # noqa: F811
    out = tmp_path / "profile.txt"
    args = ["--out", str(out), "--first", "4", "--steps", "2", "--python", "--syncs", "--"]
    args += tiny_overrides(scene_cache, 11) + [f"hydra.run.dir={tmp_path / 'run'}", "train.turntable_frames=0"]
    result = subprocess.run(
        [sys.executable, "bench/kernel_profile.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = out.read_text()
    assert text.startswith("steps 4..6: plain ") and "ms/step" in text.splitlines()[0]
    assert "by host time" in text and "aten::" in text  # the host table lists the step's ops
    sections = text[text.index("by section of the step") : text.index("where the device waited")].splitlines()[1:]
    named = {line.split()[0] for line in sections if line.strip()}
    assert {"sampling", "forward", "loss_backward", "optimizer"} <= named, sections
    assert all(" ATen calls, " in line for line in sections if line.strip())
    python = text[text.index("Python functions, steps 6..8 under cProfile") :]
    assert "tottime" in python and "train_step" in python  # the host's Python functions of steps 6 and 7
    assert "host syncs, steps 8..10\n(no CUDA device)" in text  # on a GPU: the syncs by site
    assert (tmp_path / "run" / "metrics.json").exists()  # the run itself went on to its end


def test_syncs_are_counted_by_the_repository_line_that_made_them():
    sys.path.insert(0, str(REPO / "bench"))
    from kernel_profile import SyncSites

    sites = SyncSites()

    def read_back():  # a line of this repository that syncs
        return sites.record("called a synchronizing CUDA operation")

    assert read_back() and read_back() and not sites.record("some other warning")
    ((site, count),) = sites.sites.items()
    assert count == 2 and site.startswith("tests/test_kernel_profile.py:") and site.endswith(" read_back")
    report = sites.table(steps=4)
    assert report.splitlines()[0] == "0.50 syncs a step" and "0.50  tests/test_kernel_profile.py:" in report


def test_rejects_a_window_before_the_plain_steps(tmp_path):
    result = subprocess.run(
        [sys.executable, "bench/kernel_profile.py", "--out", str(tmp_path / "p.txt"), "--first", "2", "--steps", "5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "--first (2) must be >= --steps (5)" in result.stderr


def _event(name, parent=None, device=False, start=0.0, end=0.0):
    device_type = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, cpu_parent=parent, device_type=device_type,
                           time_range=SimpleNamespace(start=start, end=end))  # fmt: skip


def test_idle_time_is_charged_to_the_launch_before_the_kernel_after_it():
    sys.path.insert(0, str(REPO / "bench"))
    from kernel_profile import idle_by_launcher

    forward, backward = _event("section:forward"), _event("section:loss_backward")
    cumsum = _event("aten::cumsum", forward)
    copy = _event("aten::copy_", cumsum)  # charged to its top-level call
    mm = _event("aten::mm", backward)
    host = [  # microseconds: the launches, and a host call that is no launch (never charged)
        _event("cudaLaunchKernel", mm, start=-1, end=0),
        _event("cudaLaunchKernel", copy, start=20, end=24),
        _event("cudaMemsetAsync", copy, start=26, end=27),
        _event("aten::empty", mm, start=60, end=61),
        _event("cudaLaunchKernel", mm, start=85, end=88),
    ]
    kernels = [  # busy 0-10, idle 10-25, busy 25-40 and 30-50 (overlapping), idle 50-90, busy 90-95
        _event("k0", device=True, start=0, end=10),
        _event("k1", device=True, start=25, end=40),
        _event("k2", device=True, start=30, end=50),
        _event("k3", device=True, start=90, end=95),
    ]
    text = idle_by_launcher([forward, backward, cumsum, copy, mm, *host, *kernels], steps=1)
    lines = text.splitlines()
    assert lines[0] == "device span 0.10 ms a step, idle 0.06 ms a step between kernels"
    assert "0.040 ms  loss_backward  aten::mm" in text and "0.015 ms  forward        aten::cumsum" in text
    assert lines[1].split() == ["loss_backward", "0.040", "ms"] and lines[2].split() == ["forward", "0.015", "ms"]


def test_host_waits_are_counted_by_the_call_that_made_them():
    """Syncs inside a C++ op (a stream sync under cuda_ext::visible_samples) count, charged to that op."""
    sys.path.insert(0, str(REPO / "bench"))
    from kernel_profile import waits_by_call

    forward, optimizer = _event("section:forward"), _event("section:optimizer")
    visible = _event("cuda_ext::visible_samples", forward)
    copy = _event("aten::copy_", _event("aten::to", visible))
    item = _event("aten::item", optimizer)
    events = [
        _event("cudaStreamSynchronize", copy),
        _event("cudaMemcpyAsync", copy),  # no wait by itself
        _event("cudaStreamSynchronize", _event("aten::_local_scalar_dense", item)),
        _event("cudaLaunchKernel", visible),
    ] * 2
    lines = waits_by_call(events, steps=2).splitlines()
    assert lines[0] == "2.00 waits a step"
    assert sorted(line.split() for line in lines[1:]) == [
        ["1.00", "forward", "cuda_ext::visible_samples"],
        ["1.00", "optimizer", "aten::item"],
    ]
