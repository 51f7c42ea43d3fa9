"""The live browser viewer (training/viewer.py, training/view.py) end to end: a tiny run trained on the CPU is
served, the system's headless Chromium loads the page, and its screenshot must show the rendered scene; plus the
viewer's error messages (port in use, missing checkpoint, no viser), its loopback-only default address and a
browser that leaves mid-render.

Every server binds 127.0.0.1 only, every wait is bounded, and servers and browsers are stopped in ``finally``.
The browser test needs viser and Chromium (Debian: ``apt-get install -y chromium``); CI installs both
(.ci/run, the ``test`` extra), and without them the tests say so in their skip reason.
"""

from __future__ import annotations

import importlib.util
import io
import json
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from training import view
from training import viewer as viewer_module
from training.config import TrainConfig
from training.viewer import Viewer, ViewerError, check_viewer, import_viser

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
HAS_VISER = importlib.util.find_spec("viser") is not None
needs_viser = pytest.mark.skipif(not HAS_VISER, reason='viser is not installed (pip install -e ".[test]")')
WINDOW = (1200, 800)  # the page's viewport: the GUI panel (top right, ~320 px wide) stays out of the centre
# a run that learns the built-in scene well enough in ~200 CPU steps to show its coloured objects
TINY_RUN = [
    "ops=torch",
    "device=cpu",
    "train.iters=200",
    "data.resolution=32",
    "data.n_train=12",
    "data.n_val=2",
    "data.n_test=2",
    "model.resolution_start=12",
    "model.resolution_end=24",
    "model.grow_at=[0.3]",
    "model.feature_dim=6",
    "model.decoder_hidden=16",
    "model.decoder_layers=1",
    "model.max_samples=64",
    "model.tv_samples=256",
    "model.occupancy.warmup=20",
    "model.occupancy.refresh_every=10",
    "train.patch_size=8",
    "train.patches_per_batch=8",
    "train.log_every=20",
    "train.turntable_frames=0",
]


def load_clients():
    """bench/viewer_clients.py (bench is not a package)."""
    spec = importlib.util.spec_from_file_location("viewer_clients", REPO / "bench" / "viewer_clients.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


class FakeTrainer:
    """What Viewer.on_step reads of the trainer."""

    def __init__(self):
        self.step, self.iters, self.rays_done, self.history = 0, 100, 0, {"psnr": []}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("viewer_run")
    args = TINY_RUN + [f"data.cache_dir={root / 'cache'}", f"hydra.run.dir={root / 'run'}"]
    result = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return root / "run"


def make_viewer(run_dir: Path, training: bool, cameras: bool = True) -> Viewer:
    """A viewer of the run on a free loopback port (host left at its default)."""
    model, state, train_cameras = view.open_run(str(run_dir), torch.device("cpu"), cameras)
    data = state["config"]["data"]
    return Viewer(model, train_cameras, data["near"], data["far"], port=free_port(), training=training)


def scene_match(shot: np.ndarray, frame: np.ndarray, background: np.ndarray) -> tuple[float, float]:
    """(fraction of the centre that is scene in ``frame``, fraction of those scene pixels that the screenshot
    shows in the frame's colours) over the middle 40% of the page; the frame is stretched over the viewport."""
    height, width = shot.shape[:2]
    expected = np.asarray(Image.fromarray(frame).resize((width, height), Image.BILINEAR), dtype=np.int32)
    rows, cols = slice(int(0.3 * height), int(0.7 * height)), slice(int(0.3 * width), int(0.7 * width))
    expected, seen = expected[rows, cols], shot[rows, cols, :3].astype(np.int32)
    scene = np.abs(expected - background).max(axis=-1) > 60
    close = np.abs(expected - seen).max(axis=-1) <= 48
    return float(scene.mean()), float((scene & close).sum() / max(1, scene.sum()))


def png(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@needs_viser
def test_headless_chromium_shows_the_rendered_scene(run_dir, tmp_path):
    clients = load_clients()
    binary = clients.find_chromium()
    if binary is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install -y chromium; .ci/run installs it)")
    viewer = make_viewer(run_dir, training=False)
    assert viewer.url.startswith(f"http://{HOST}:")
    stop = threading.Event()
    server = threading.Thread(target=viewer.serve, kwargs={"until": stop.is_set}, daemon=True)
    try:
        with clients.HeadlessChromium(*WINDOW, binary=binary, timeout=60) as browser:
            browser.open(viewer.url)
            wait_for(lambda: viewer.num_clients == 1, 60, "the page to connect to the viewer")
            wait_for(lambda: browser.evaluate("document.querySelectorAll('canvas').length") > 0, 30, "a canvas")
            time.sleep(2.0)  # the page draws the box and the frusta; nothing renders frames yet
            blank = png(browser.screenshot(tmp_path / "viewer_no_render.png"))
            server.start()
            wait_for(lambda: viewer.frames_sent > 0 and viewer.last_frame_full, 120, "a full-resolution frame")
            background = viewer.model.background.cpu().numpy() * 255
            deadline = time.monotonic() + 30  # the browser decodes and paints the frame
            while True:
                frame = viewer.last_frame
                shot = png(browser.screenshot(tmp_path / "viewer.png"))
                scene, shown = scene_match(shot, frame, background)
                if shown >= 0.6 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            print(f"viewer: {scene:.0%} scene in the centre, {shown:.0%} shown; screenshots in {tmp_path}")
    finally:
        stop.set()
        server.join(timeout=30) if server.is_alive() else None
        viewer.close()
    assert scene > 0.1, f"the model's frame is mostly background in the centre ({scene:.0%} scene): not a scene"
    assert shown >= 0.6, f"the page shows only {shown:.0%} of the frame's scene pixels (see {tmp_path})"
    blank_scene, blank_shown = scene_match(blank, frame, background)
    assert blank_shown < 0.2, f"the page without renders already matches the frame ({blank_shown:.0%})"
    assert np.abs(shot.astype(int) - blank.astype(int)).max(axis=-1).mean() > 5  # the frame changed the page


def test_listens_on_loopback_by_default(run_dir, monkeypatch):
    assert TrainConfig().viewer_host == HOST
    assert OmegaConf.load(REPO / "configs" / "train" / "default.yaml").viewer_host == HOST
    seen = {}

    def refuse(*args, **kwargs):
        seen.update(kwargs)
        raise ViewerError("stop before serving")

    monkeypatch.setattr(view, "import_viser", lambda key: None)
    monkeypatch.setattr(view, "Viewer", refuse)
    assert view.main([str(run_dir), "--no-cameras", "--device", "cpu"]) == view.EXIT_USAGE
    assert seen["host"] == HOST


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp*) with a socket listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


@needs_viser
def test_viewer_socket_is_loopback_only(run_dir):
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux's /proc/net/tcp to list listening sockets")
    viewer = make_viewer(run_dir, training=False, cameras=False)
    try:
        port = int(viewer.url.rsplit(":", 1)[1])
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only
    finally:
        viewer.close()


def test_port_in_use_names_the_key():
    cfg = OmegaConf.create({"viewer_host": HOST, "viewer_port": free_port()})
    with socket.socket() as taken:
        taken.bind((HOST, int(cfg.viewer_port)))
        taken.listen()
        if not HAS_VISER:
            with pytest.raises(ViewerError, match="viser"):
                check_viewer(cfg)
            return
        with pytest.raises(ViewerError) as error:
            check_viewer(cfg)
    message = str(error.value)
    assert "train.viewer_port" in message and "already in use" in message and "\n" not in message


@needs_viser
def test_view_port_in_use_is_one_line(run_dir, capsys):
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert view.main([str(run_dir), "--port", str(port), "--no-cameras", "--device", "cpu"]) == view.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --port:") and "already in use" in err and "\n" not in err


def test_view_missing_checkpoint(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert view.main([str(tmp_path / "run")]) == view.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert "checkpoint not found" in err and "last.pt" in err and "\n" not in err
    assert view.main([str(tmp_path / "missing")]) == view.EXIT_USAGE
    assert "no such run folder" in capsys.readouterr().err


def test_missing_viser_gives_the_install_hint(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "viser", None)  # import viser -> ImportError
    with pytest.raises(ViewerError, match=r"train\.viewer: .*pip install -e \"\.\[viewer\]\""):
        import_viser()
    with pytest.raises(ViewerError, match="viser"):
        check_viewer(OmegaConf.create({"viewer_host": HOST, "viewer_port": free_port()}))
    assert view.main([str(tmp_path)]) == view.EXIT_USAGE
    assert 'pip install -e ".[viewer]"' in capsys.readouterr().err


def test_train_without_viser_stops_with_one_line(tmp_path):
    block = (
        "import sys, runpy; sys.modules['viser'] = None; sys.argv[0] = 'train.py'; "
        "runpy.run_path('train.py', run_name='__main__')"
    )
    args = ["ops=torch", "device=cpu", "train.iters=50", "train.viewer=true", f"hydra.run.dir={tmp_path / 'run'}"]
    result = subprocess.run([sys.executable, "-c", block, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        result.stderr.strip()
        == 'error: train.viewer: the live viewer needs the viser package: pip install -e ".[viewer]"'
    )
    assert not (tmp_path / "run" / "checkpoints").exists()  # stopped before any work


@needs_viser
def test_training_goes_on_when_a_browser_leaves_mid_render(run_dir, monkeypatch, capsys):
    clients = load_clients()
    viewer = make_viewer(run_dir, training=True, cameras=False)
    client = None
    try:
        client = clients.SimulatedClient(viewer.url, position=(3.0, 0.0, 1.5))
        wait_for(lambda: viewer.num_clients == 1, 30, "the simulated browser to connect")
        render = viewer_module.render_frame

        left = threading.Event()

        def render_while_the_browser_leaves(*args, **kwargs):
            left.set()
            client.close()
            wait_for(lambda: not viewer.server.get_clients(), 30, "viser to notice the disconnect")
            return render(*args, **kwargs)

        monkeypatch.setattr(viewer_module, "render_frame", render_while_the_browser_leaves)
        trainer = FakeTrainer()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # viser's "queued on a closed connection" warning would fail here
            deadline = time.monotonic() + 30  # the first render needs the browser's camera, which may come late
            step = 0
            while step < 20 or (not left.is_set() and time.monotonic() < deadline):
                trainer.step = step
                assert viewer.on_step(trainer) == 0.0
                step += 1
                time.sleep(0.0 if step < 20 else 0.05)
        assert left.is_set(), "no render was attempted for the connected browser"
        wait_for(lambda: viewer.num_clients == 0, 30, "the viewer to forget the departed browser")
        assert viewer.frames_sent == 0
        assert "a browser disconnected during a render" in capsys.readouterr().err
        start = time.perf_counter()
        for later in range(step, step + 1000):  # nobody connected: on_step returns at once
            trainer.step = later
            viewer.on_step(trainer)
        assert time.perf_counter() - start < 1.0
    finally:
        if client is not None:
            client.close()
        viewer.close()


@needs_viser
def test_throughput_bench_runs_off_still_and_moving_with_a_connected_client(tmp_path):
    """bench/viewer_throughput.py, the H100 bar's tool, end to end on a tiny CPU run: three runs, the two with
    the viewer on each received frames, and the JSON has every run's rays/s (the figures themselves say nothing
    on a shared CPU)."""
    from test_train import tiny_overrides

    out = tmp_path / "throughput.json"
    command = [sys.executable, str(REPO / "bench" / "viewer_throughput.py"), "--json", str(out)]
    command += ["--runs", str(tmp_path / "runs"), "--", *tiny_overrides(tmp_path / "cache", 600)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = {r["viewer"]: r for r in json.loads(out.read_text())["results"]}
    assert set(runs) == {"off", "still", "moving"}
    assert all(r["rays_per_second"] > 0 for r in runs.values())
    assert runs["off"]["messages"] == 0 and runs["still"]["messages"] > 0 and runs["moving"]["messages"] > 0
