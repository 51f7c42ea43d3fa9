"""Checkpoint round trips, crash safety (handled errors and SIGKILL mid-write), RNG state, InterruptGuard."""

import io
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from training import checkpoint
from training.checkpoint import (
    CheckpointError,
    InterruptGuard,
    capture_rng_state,
    load_checkpoint,
    remove_stale_temporaries,
    restore_rng_state,
    save_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]


def _trained_pair(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer


def _assert_same(a, b):
    """Deep equality of nested dicts / lists / tensors, tensors compared exactly (values, dtype, shape)."""
    assert type(a) is type(b) or (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _stray_files(folder: Path, keep: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != keep)


def test_round_trip_restores_model_and_optimizer(tmp_path):
    model, optimizer = _trained_pair(0)
    state = {"iteration": 3, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "note": "x"}
    path = tmp_path / "deep" / "run" / "ckpt.pt"  # parent folders are created
    save_checkpoint(path, state)
    loaded = load_checkpoint(path)
    _assert_same(loaded, state)
    assert _stray_files(path.parent, "ckpt.pt") == []
    assert path.stat().st_mode & 0o777 == 0o666 & ~checkpoint._umask()  # not the temp file's 0600

    # Resuming from the checkpoint continues exactly like the original run
    resumed_model, resumed_optimizer = _trained_pair(1)  # different weights before loading
    resumed_model.load_state_dict(loaded["model"])
    resumed_optimizer.load_state_dict(loaded["optimizer"])
    batch = torch.randn(16, 4)
    for m, opt in ((model, optimizer), (resumed_model, resumed_optimizer)):
        opt.zero_grad()
        m(batch).pow(2).mean().backward()
        opt.step()
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)


def test_save_overwrites_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"version": 1})
    save_checkpoint(path, {"version": 2, "w": torch.arange(5)})
    assert load_checkpoint(path)["version"] == 2
    assert _stray_files(tmp_path, "ckpt.pt") == []


def _partial_then_fail(error: BaseException):
    real_save = torch.save

    def fake_save(obj, file):
        buffer = io.BytesIO()
        real_save(obj, buffer)
        file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        raise error

    return fake_save


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_failed_write_keeps_previous_checkpoint_and_cleans_up(tmp_path, monkeypatch, error):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"version": 1, "weights": torch.full((1000,), 1.0)})
    before = path.read_bytes()
    monkeypatch.setattr(torch, "save", _partial_then_fail(error))
    with pytest.raises(type(error)):
        save_checkpoint(path, {"version": 2, "weights": torch.full((1000,), 2.0)})
    assert path.read_bytes() == before
    assert load_checkpoint(path)["version"] == 1
    assert _stray_files(tmp_path, "ckpt.pt") == []


def _python(script: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )


def _read_line(process: subprocess.Popen, timeout: float = 60.0) -> str:
    result = []
    reader = threading.Thread(target=lambda: result.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not result:
        process.kill()
        pytest.fail("child process did not report progress in time")
    return result[0].strip()


def test_sigkill_in_the_middle_of_a_write_leaves_previous_checkpoint(tmp_path):
    # The child writes half of version 2, tells us, and waits: the SIGKILL lands provably mid-write.
    child = _python(
        """
        import io, sys, time, torch
        from training.checkpoint import save_checkpoint
        path = sys.argv[1]
        save_checkpoint(path, {"version": 1, "weights": torch.full((100_000,), 1.0)})
        real_save = torch.save
        def half_then_hang(obj, file):
            buffer = io.BytesIO()
            real_save(obj, buffer)
            file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            file.flush()
            print("half written", flush=True)
            time.sleep(120)
        torch.save = half_then_hang
        save_checkpoint(path, {"version": 2, "weights": torch.full((100_000,), 2.0)})
        """,
        str(tmp_path / "ckpt.pt"),
    )
    assert _read_line(child) == "half written"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    loaded = load_checkpoint(tmp_path / "ckpt.pt")
    assert loaded["version"] == 1 and torch.equal(loaded["weights"], torch.full((100_000,), 1.0))
    # The half-written bytes went to a temporary file, never to ckpt.pt (SIGKILL allows no clean-up)
    strays = [tmp_path / name for name in _stray_files(tmp_path, "ckpt.pt")]
    assert len(strays) == 1 and strays[0].name.startswith(".ckpt.pt.") and strays[0].stat().st_size > 0
    # ... which the next run removes before it starts saving (the trainer calls this at start)
    assert remove_stale_temporaries(tmp_path / "ckpt.pt") == 1
    assert _stray_files(tmp_path, "ckpt.pt") == [] and load_checkpoint(tmp_path / "ckpt.pt")["version"] == 1


def test_sigkill_during_repeated_saves_never_leaves_a_torn_checkpoint(tmp_path):
    # No patching here: real saves of an 8 MB checkpoint in a loop, killed at an arbitrary moment.
    child = _python(
        """
        import sys, torch
        from training.checkpoint import save_checkpoint
        for version in range(1, 10_000):
            save_checkpoint(sys.argv[1], {"version": version, "weights": torch.full((2_000_000,), float(version))})
            print(version, flush=True)
        """,
        str(tmp_path / "ckpt.pt"),
    )
    while int(_read_line(child)) < 3:
        pass
    time.sleep(0.013)  # land somewhere inside a later save
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    loaded = load_checkpoint(tmp_path / "ckpt.pt")
    assert loaded["version"] >= 3
    assert torch.equal(loaded["weights"], torch.full((2_000_000,), float(loaded["version"])))


def test_load_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.pt"
    with pytest.raises(CheckpointError, match=f"{missing}.*not found"):
        load_checkpoint(missing)
    with pytest.raises(CheckpointError, match="not a file"):
        load_checkpoint(tmp_path)

    good = tmp_path / "good.pt"
    save_checkpoint(good, {"w": torch.randn(1000)})
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:-100])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(np.random.default_rng(0).bytes(4096))
    for path in (truncated, garbage):
        with pytest.raises(CheckpointError, match=f"{path}: cannot read checkpoint"):
            load_checkpoint(path)

    not_a_dict = tmp_path / "list.pt"
    torch.save([1, 2, 3], not_a_dict)
    with pytest.raises(CheckpointError, match="holds a list, expected a dict"):
        load_checkpoint(not_a_dict)


def test_save_rejects_non_dict_state(tmp_path):
    with pytest.raises(TypeError, match="state must be a dict"):
        save_checkpoint(tmp_path / "x.pt", [1, 2])
    assert list(tmp_path.iterdir()) == []


def _draw_numbers():
    return (
        [random.random() for _ in range(5)],
        np.random.rand(5).tolist(),
        np.random.normal(size=3).tolist(),  # exercises numpy's cached Gaussian
        torch.rand(5).tolist(),
        torch.randn(3).tolist(),
    )


@pytest.mark.parametrize("through_disk", [False, True])
def test_rng_capture_restore_reproduces_random_numbers(tmp_path, through_disk):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.normal()  # leave a cached Gaussian in numpy's state
    state = capture_rng_state()
    if through_disk:  # must survive torch.load(weights_only=True)
        save_checkpoint(tmp_path / "rng.pt", {"rng": state})
        state = load_checkpoint(tmp_path / "rng.pt")["rng"]
    first = _draw_numbers()
    assert _draw_numbers() != first  # the generators really move on
    restore_rng_state(state)
    assert _draw_numbers() == first


@pytest.mark.requires_cuda
def test_rng_capture_restore_cuda():
    state = capture_rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    first = torch.rand(5, device="cuda").tolist()
    restore_rng_state(state)
    assert torch.rand(5, device="cuda").tolist() == first


def test_restore_rng_rejects_incomplete_state():
    with pytest.raises(ValueError, match="numpy"):
        restore_rng_state({"python": random.getstate(), "torch": torch.get_rng_state()})


def _send_and_wait(signum: int, guard: InterruptGuard) -> None:
    os.kill(os.getpid(), signum)
    deadline = time.monotonic() + 5
    while not guard.requested and time.monotonic() < deadline:  # handlers run between bytecodes
        time.sleep(0.001)


@pytest.fixture
def sentinel_handlers():
    """Install known handlers for SIGINT/SIGTERM so the test can see they are restored; undo afterwards."""

    def sentinel(signum, frame):
        raise AssertionError(f"sentinel handler called for signal {signum}")

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in saved:
        signal.signal(sig, sentinel)
    yield sentinel
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_guard_turns_signal_into_request(sentinel_handlers, signum):
    with InterruptGuard() as guard:
        assert not guard.requested and guard.exit_code == 0
        _send_and_wait(signum, guard)
        assert guard.requested and guard.signum == signum
        assert guard.exit_code == 128 + signum
        # a SIGTERM after the request changes nothing
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert guard.signum == signum
    assert signal.getsignal(signal.SIGINT) is sentinel_handlers
    assert signal.getsignal(signal.SIGTERM) is sentinel_handlers


def test_second_sigint_still_saves_third_raises_keyboard_interrupt_and_restores_handlers(sentinel_handlers):
    guard = InterruptGuard()
    with pytest.raises(KeyboardInterrupt):
        with guard:
            _send_and_wait(signal.SIGINT, guard)
            assert guard.requested
            os.kill(os.getpid(), signal.SIGINT)  # people press twice: still a polite stop (the run saves)
            for _ in range(200):
                time.sleep(0.001)
            assert guard.requested and guard.signum == signal.SIGINT
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(5000):  # the handler raises at the next bytecode boundary
                time.sleep(0.001)
            pytest.fail("third SIGINT did not raise KeyboardInterrupt")
    assert signal.getsignal(signal.SIGINT) is sentinel_handlers
    assert signal.getsignal(signal.SIGTERM) is sentinel_handlers
    with guard:  # reusable, and a fresh entry clears the old request
        assert not guard.requested and guard.signum is None


def test_interrupt_guard_refuses_other_threads_and_nesting(sentinel_handlers):
    errors = []

    def enter():
        try:
            with InterruptGuard():
                pass
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]
    guard = InterruptGuard()
    with guard:
        with pytest.raises(RuntimeError, match="already active"):
            guard.__enter__()
    assert signal.getsignal(signal.SIGINT) is sentinel_handlers
