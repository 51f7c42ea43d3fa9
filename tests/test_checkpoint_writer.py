"""Checkpoints written behind training (training.checkpoint_writer): the snapshot is isolated from later updates,
the caller blocks only for the snapshot, errors come back to the owner, kill -9 mid-write keeps the previous file,
and an exiting interpreter finishes the write in flight."""

from __future__ import annotations

import signal
import time

import pytest
import torch
from test_checkpoint import _python, _read_line, _stray_files

from training import checkpoint_writer
from training.checkpoint import load_checkpoint, save_checkpoint
from training.checkpoint_writer import BackgroundWriter, snapshot, to_host


def test_a_snapshot_does_not_see_later_in_place_updates():
    weights, moments = torch.randn(100), torch.randn(3, 4)
    state = {"model": {"w": weights}, "optimizer": {"state": {0: {"exp_avg": moments}}, "groups": [{"lr": 0.1}]}}
    state["rng"] = ("python", [1, 2, 3])
    copy = snapshot(state)
    expected_w, expected_m = weights.clone(), moments.clone()
    weights.add_(1.0)
    moments.mul_(0.0)
    state["optimizer"]["groups"][0]["lr"] = 0.5
    assert torch.equal(copy["model"]["w"], expected_w) and torch.equal(
        copy["optimizer"]["state"][0]["exp_avg"], expected_m
    )
    assert copy["optimizer"]["groups"][0]["lr"] == 0.1 and copy["rng"] == ("python", [1, 2, 3])
    assert to_host(copy)["model"]["w"].device.type == "cpu"


def test_submit_returns_before_a_slow_write_and_wait_joins_it(tmp_path):
    path, writer = tmp_path / "last.pt", BackgroundWriter()
    state = {"step": 1, "w": torch.randn(1000)}

    def slow(host):
        time.sleep(1.0)
        save_checkpoint(path, host)

    start = time.perf_counter()
    writer.submit(snapshot(state), slow, label=1)
    assert time.perf_counter() - start < 0.5 and writer.pending  # training goes on while the bytes are written
    state["w"].zero_()
    assert writer.wait() > 0.3 and not writer.pending and writer.label == 1
    loaded = load_checkpoint(path)
    assert loaded["step"] == 1 and loaded["w"].abs().sum() > 0  # the snapshot's values, not the zeroed ones
    assert writer.write_seconds >= 1.0


def test_a_failed_write_is_raised_at_the_next_submit_or_wait(tmp_path):
    writer = BackgroundWriter()

    def full_disk(host):
        raise OSError(28, "No space left on device")

    writer.submit({"step": 1}, full_disk)
    with pytest.raises(OSError, match="No space left"):
        writer.submit({"step": 2}, lambda host: None)  # joins the failed one first
    writer.wait()  # raised once, then clear
    writer.submit({"step": 3}, full_disk)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()


def test_one_write_at_a_time_in_order(tmp_path):
    writer, order = BackgroundWriter(), []
    for step in range(5):
        writer.submit({"step": step}, lambda host: (time.sleep(0.02), order.append(host["step"])))
    writer.wait()
    assert order == [0, 1, 2, 3, 4]


def test_sigkill_during_a_background_write_leaves_the_previous_checkpoint(tmp_path):
    # The child trains (changes its tensor) while the writer thread writes half of version 2 and hangs there.
    child = _python(
        """
        import io, sys, time, torch
        from training.checkpoint import save_checkpoint
        from training.checkpoint_writer import BackgroundWriter, snapshot
        path, weights = sys.argv[1], torch.full((100_000,), 1.0)
        save_checkpoint(path, {"version": 1, "weights": weights})
        real_save = torch.save
        def half_then_hang(obj, file):
            buffer = io.BytesIO()
            real_save(obj, buffer)
            file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            file.flush()
            print("half written", flush=True)
            time.sleep(120)
        torch.save = half_then_hang
        writer = BackgroundWriter()
        writer.submit(snapshot({"version": 2, "weights": weights + 1}), lambda host: save_checkpoint(path, host))
        while True:
            weights.add_(1.0)  # training goes on in the main thread
            time.sleep(0.01)
        """,
        str(tmp_path / "last.pt"),
    )
    assert _read_line(child) == "half written"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    loaded = load_checkpoint(tmp_path / "last.pt")
    assert loaded["version"] == 1 and torch.equal(loaded["weights"], torch.full((100_000,), 1.0))
    strays = _stray_files(tmp_path, "last.pt")
    assert len(strays) == 1 and strays[0].startswith(".last.pt.")  # removed by the next run (remove_stale_temporaries)


def test_an_exiting_interpreter_finishes_the_write_in_flight(tmp_path):
    child = _python(
        """
        import sys, time, torch
        from training.checkpoint import save_checkpoint
        from training.checkpoint_writer import BackgroundWriter
        def slow(host):
            time.sleep(1.0)
            save_checkpoint(sys.argv[1], host)
        BackgroundWriter().submit({"version": 7, "weights": torch.ones(10)}, slow)
        print("submitted", flush=True)
        """,
        str(tmp_path / "last.pt"),
    )
    assert _read_line(child) == "submitted"
    assert child.wait(timeout=60) == 0
    assert load_checkpoint(tmp_path / "last.pt")["version"] == 7


@pytest.mark.requires_cuda
def test_cuda_snapshot_is_copied_on_its_own_stream_and_isolated(tmp_path):
    weights = torch.randn(1 << 24, device="cuda")
    expected = weights.cpu()
    writer, path = BackgroundWriter(), tmp_path / "last.pt"
    start = time.perf_counter()
    writer.submit(snapshot({"w": weights}), lambda host: save_checkpoint(path, host))
    blocked = time.perf_counter() - start
    for _ in range(20):  # training kernels queued right after the snapshot
        weights.mul_(1.0001).add_(1.0)
    writer.wait()
    assert blocked < 1.0 and torch.equal(load_checkpoint(path)["w"], expected)
    assert checkpoint_writer.snapshot(torch.ones(1, device="cuda")).device.type == "cuda"
