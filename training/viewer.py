"""The live viewer in the browser (viser, the library nerfstudio's viewer uses): ``train.viewer=true`` while
training, ``python -m training.view RUN_DIR`` for a finished run (training/view.py).

The page shows the model rendered from the browser's own camera (as the viewport's background image), in RGB,
depth, opacity or, with deferred shading, the composited diffuse colour; the training cameras as frusta; the
grids' box; the step, the last batch PSNR and rays/s; a resolution slider; a pause / resume button; and a
"Camera path" panel that records one: "Add keyframe" takes the browser's current view, "Save camera path" writes
nerfstudio's camera-path JSON (the keyframes joined smoothly as ``render_path --path interpolate`` joins the training
cameras, "Frames" in all, at the Resolution slider's size and the first keyframe's aspect) into the run's
``camera_paths/`` folder; ``python -m training.render_path RUN_DIR --path camera_paths/NAME.json`` renders it.

Threads. viser runs its callbacks (camera moves, GUI changes, connects) on its own threads; they only record
state under a lock. Every render runs on the thread that owns the model, the training loop, inside
:meth:`Viewer.on_step`: the model is never used by two threads at once, needs no lock around training, and a
render sees the parameters between two optimiser steps. (torch.no_grad + a lock on another thread would render
concurrently, but on one GPU the two would share the device anyway and the lock would stall the loop.)

Cost. :meth:`Viewer.on_step` returns at once while no browser is connected. Otherwise it renders at most one
frame per call, and only when the time spent rendering stays within ``budget`` (a fraction, default 5%) of the
wall time: after a frame that took r seconds the next waits r * (1 - budget) / budget. A moving camera gets a
preview at 1/4 of the slider's side; once it has been still for SETTLE_SECONDS, a frame at the slider's side;
while training, a still camera's frame is redrawn every REFRESH_SECONDS so the picture follows training.
While paused the loop waits inside on_step and renders without a budget.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import math
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from models.model import VoxelNeRF
from training.run_dir import RunError
from training.viewer_frames import (
    available_modes,
    box_edges,
    c2w_to_viser,
    focal_from_fov,
    fov_from_focal,
    frame_size,
    render_frame,
    viser_to_c2w,
)

VIEWER_HINT = 'pip install -e ".[viewer]"'
PREVIEW_DIVISOR = 4  # a moving camera's frames: this many times smaller a side
SETTLE_SECONDS = 0.3  # a camera without updates for this long is still: full-resolution frame
REFRESH_SECONDS = 2.0  # while training, a still camera's frame is redrawn this often
PROGRESS_SECONDS = 0.5  # the GUI's step / PSNR / rays/s texts are updated this often
IDLE_SLEEP = 0.02  # seconds between looks for work while paused or serving a finished run
RESOLUTION_SLIDER = (32, 1024, 16)  # min, max, step of the longer side in pixels
FRUSTUM_COLOR = (255, 140, 0)
KEYFRAME_COLOR = (40, 200, 80)
PATH_FRAMES = 120  # the record panel's starting frame count
BOX_COLOR = (60, 60, 200)


class ViewerError(RunError):
    """The viewer cannot start (no viser, an address in use); the one-line message names the key."""


def import_viser(key: str = "train.viewer") -> Any:
    """The viser module, or ViewerError with the install hint."""
    try:
        import viser
    except ImportError:
        raise ViewerError(f"{key}: the live viewer needs the viser package: {VIEWER_HINT}") from None
    return viser


def check_address(host: str, port: int, key: str = "train.viewer_port") -> None:
    """ViewerError unless a server can listen on host:port now (viser itself would move to the next free port)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as error:
        raise ViewerError(f"train.viewer_host: cannot resolve {host!r} ({error})") from None
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own socket does
            probe.bind((host, port))
    except OSError as error:
        reason = "already in use" if error.errno == errno.EADDRINUSE else (error.strerror or str(error))
        raise ViewerError(
            f"{key}: cannot serve the viewer on {host}:{port} ({reason}); choose a free port, e.g. {key}={port + 1}"
        ) from None


def check_viewer(train_cfg) -> None:
    """Before any work (train.viewer=true): viser is installed and the address is free, else ViewerError."""
    import_viser()
    check_address(str(train_cfg.viewer_host), int(train_cfg.viewer_port))


def start_viewer(train_cfg, trainer, group) -> Viewer:
    """The viewer of a training run (rank 0), showing ``trainer.model`` and its training cameras."""
    scene = trainer.train_scene
    cameras = TrainCameras.of_scene(scene)
    viewer = Viewer(
        trainer.model,
        cameras,
        scene.near,
        scene.far,
        host=str(train_cfg.viewer_host),
        port=int(train_cfg.viewer_port),
        budget=float(train_cfg.viewer_budget),
        resolution=int(train_cfg.viewer_resolution),
        chunk=int(train_cfg.render_chunk),
        pausable=not group.active,
        path_dir=trainer.paths.root / "camera_paths",
    )
    print(f"viewer: open {viewer.url} in a browser (renders take <= {viewer.budget:.0%} of the time while one is open)")
    return viewer


@dataclass
class TrainCameras:
    """The training views, drawn as frusta: (V, 4, 4) OpenGL c2w, each view's vertical field of view (V,) in
    radians and aspect (V,) width / height (a capture may mix portrait and landscape frames)."""

    c2w: np.ndarray
    fov: np.ndarray
    aspect: np.ndarray

    @classmethod
    def of_scene(cls, scene) -> TrainCameras:
        """The views of a :class:`data.Scene`, each with its own size and focal length."""
        sizes = np.array([scene.view_size(view) for view in range(scene.num_views)], np.float64)
        fy = scene.intrinsics[:, 1].cpu().numpy()
        fov = np.array([fov_from_focal(f, h) for f, h in zip(fy, sizes[:, 0])])
        return cls(scene.c2w.cpu().numpy().astype(np.float64), fov, sizes[:, 1] / sizes[:, 0])


@dataclass
class _Client:
    """What the viewer knows about one browser tab (written by viser's threads under the viewer's lock)."""

    handle: Any
    c2w: np.ndarray | None = None
    fov: float = 1.0
    aspect: float = 1.0
    version: int = 0  # camera updates received
    moved_at: float = 0.0
    drawn_version: int = -1  # the camera version of the last frame sent (-1: redraw)
    drawn_full: bool = False
    drawn_at: float = 0.0
    drawn_step: int = -1


class Viewer:
    """A viser server showing ``model``; call :meth:`on_step` from the training loop, or :meth:`serve`.

    Args:
        model: the model (renders run on the caller's thread, on the model's device).
        cameras: the training views to draw as frusta (None: none).
        near, far: the depth range of the depth picture.
        host, port: where to listen (ViewerError when the port is taken).
        budget: the fraction of wall time renders may take while training, in (0, 1].
        resolution: the slider's starting value (longer side of a still camera's frame, pixels).
        chunk: rays per render chunk (training.inference raises it to its launch size on CUDA).
        training: False for a finished run (no pause button, no periodic redraw).
        pausable: show the pause button (not under torchrun: the other ranks would time out waiting).
        path_dir: where "Save camera path" writes (None: the current folder's camera_paths/).
    """

    def __init__(
        self,
        model: VoxelNeRF,
        cameras: TrainCameras | None,
        near: float,
        far: float,
        host: str = "127.0.0.1",
        port: int = 8080,
        budget: float = 0.05,
        resolution: int = 256,
        chunk: int = 8192,
        training: bool = True,
        pausable: bool = True,
        port_key: str = "train.viewer_port",
        path_dir: str | os.PathLike | None = None,
    ):
        viser = import_viser("train.viewer" if training else "training.view")
        if not 0 < budget <= 1:
            raise ValueError(f"Viewer: budget must be in (0, 1], got {budget}")
        check_address(host, port, port_key)
        logging.getLogger("websockets").setLevel(logging.WARNING)  # not each connection in train.log (Hydra: INFO)
        with contextlib.redirect_stdout(io.StringIO()):  # viser's banner, whatever `verbose`: we print the URL
            self.server = viser.ViserServer(host=host, port=port, verbose=False)
        if self.server.get_port() != port:  # taken between the check and the bind: viser moved on
            self.server.stop()
            check_address(host, port, port_key)
        self.url = f"http://{host}:{self.server.get_port()}"
        self.model, self.near, self.far, self.chunk = model, float(near), float(far), int(chunk)
        self.budget, self.training = float(budget), training
        self.modes = available_modes(model)
        self._lock = threading.Lock()
        self._clients: dict[int, _Client] = {}
        self._mode, self._side = "rgb", int(resolution)
        self._paused = self._closed = False
        self._next_render_at = self._next_progress_at = 0.0
        self._progress_time, self._progress_rays, self._paused_since_progress = time.perf_counter(), 0, 0.0
        self.frames_sent, self.render_seconds, self.last_frame, self.last_frame_full = 0, 0.0, None, False
        self.path_dir = Path(path_dir) if path_dir is not None else Path("camera_paths")
        self.keyframes: list[tuple[np.ndarray, float, float]] = []  # (c2w, vertical fov in radians, aspect)
        self._keyframe_handles: list = []
        self._build_scene(cameras)
        self._build_gui(resolution, training and pausable)
        self.server.on_client_connect(self._on_connect)
        self.server.on_client_disconnect(self._on_disconnect)

    # ------------------------------------------------------------------ page (built once, shared by every client)
    def _build_scene(self, cameras: TrainCameras | None) -> None:
        scene = self.server.scene
        scene.set_up_direction("+z")  # our scenes are z-up (data/cameras.py)
        bbox = self.model.bbox.detach().cpu().numpy()
        size = float(np.linalg.norm(bbox[1] - bbox[0]))
        scene.add_line_segments("/scene_box", box_edges(bbox), BOX_COLOR, thickness=0.004 * size)
        if cameras is None or len(cameras.c2w) == 0:
            return
        for index, c2w in enumerate(np.asarray(cameras.c2w, dtype=np.float64)):
            wxyz, position = c2w_to_viser(c2w)
            scene.add_camera_frustum(
                f"/train_cameras/{index:03d}",
                fov=float(cameras.fov[index]),
                aspect=float(cameras.aspect[index]),
                scale=0.04 * size,
                thickness=0.002 * size,
                color=FRUSTUM_COLOR,
                wxyz=wxyz,
                position=position,
            )
        first = cameras.c2w[0]  # new browsers start at the first training view, looking at the box's centre
        self.server.initial_camera.position = tuple(float(v) for v in first[:3, 3])
        self.server.initial_camera.look_at = tuple(float(v) for v in (bbox[0] + bbox[1]) / 2)
        self.server.initial_camera.fov = float(cameras.fov[0])

    def _build_gui(self, resolution: int, pausable: bool) -> None:
        gui = self.server.gui
        self._step_text = gui.add_text("Step", initial_value="-", disabled=True)
        self._psnr_text = gui.add_text("PSNR (batch)", initial_value="-", disabled=True)
        self._rays_text = gui.add_text("Rays/s", initial_value="-", disabled=True)
        low, high, step = RESOLUTION_SLIDER
        mode = gui.add_dropdown("Output", options=self.modes, initial_value="rgb")
        side = gui.add_slider("Resolution", min=low, max=high, step=step, initial_value=min(max(resolution, low), high))
        mode.on_update(lambda event: self._set_view(mode=str(event.target.value)))
        side.on_update(lambda event: self._set_view(side=int(event.target.value)))
        self._side = int(side.value)
        self._pause_button = None
        if pausable:
            self._pause_button = gui.add_button("Pause training")
            self._pause_button.on_click(lambda _: self.set_paused(not self._paused))
        with gui.add_folder("Camera path"):
            self._path_status = gui.add_text("Keyframes", initial_value="0", disabled=True)
            add = gui.add_button("Add keyframe")
            clear = gui.add_button("Clear keyframes")
            self._path_frames = gui.add_number("Frames", initial_value=PATH_FRAMES, min=1, max=100000, step=1)
            self._path_loop = gui.add_checkbox("Loop", initial_value=False)
            self._path_name = gui.add_text("File name", initial_value="camera_path")
            save = gui.add_button("Save camera path")
        add.on_click(lambda event: self._record(event.client))
        clear.on_click(lambda _: self.clear_keyframes())
        save.on_click(lambda _: self._save_clicked())

    # ------------------------------------------------------------------ the record panel
    def _record(self, client) -> None:
        if client is None:
            return
        camera = client.camera
        self.add_keyframe(viser_to_c2w(camera.wxyz, camera.position), float(camera.fov), float(camera.aspect))

    def add_keyframe(self, c2w: np.ndarray, fov: float, aspect: float) -> int:
        """Append a keyframe (OpenGL c2w, vertical fov in radians, width / height), drawn as a frustum; returns
        the count."""
        with self._lock:
            self.keyframes.append((np.array(c2w, dtype=np.float64), float(fov), float(aspect)))
            count = len(self.keyframes)
        bbox = self.model.bbox.detach().cpu().numpy()
        size = float(np.linalg.norm(bbox[1] - bbox[0]))
        wxyz, position = c2w_to_viser(np.asarray(c2w, dtype=np.float64))
        handle = self.server.scene.add_camera_frustum(
            f"/camera_path/{count - 1:03d}",
            fov=float(fov),
            aspect=float(aspect),
            scale=0.05 * size,
            color=KEYFRAME_COLOR,
            wxyz=wxyz,
            position=position,
        )
        self._keyframe_handles.append(handle)
        self._path_status.value = str(count)
        return count

    def clear_keyframes(self) -> None:
        with self._lock:
            self.keyframes = []
        handles, self._keyframe_handles = self._keyframe_handles, []
        for handle in handles:
            with contextlib.suppress(Exception):
                handle.remove()
        self._path_status.value = "0"

    def _save_clicked(self) -> None:
        try:
            frames, loop = int(self._path_frames.value), bool(self._path_loop.value)
            path = self.save_camera_path(str(self._path_name.value), frames, loop)
            self._path_status.value = f"{len(self.keyframes)} (saved {path.name})"
            print(f"viewer: wrote {path} (render it: python -m training.render_path RUN_DIR --path {path})")
        except (ValueError, OSError) as error:
            self._path_status.value = f"{len(self.keyframes)} (not saved: {error})"
            print(f"viewer: camera path not saved ({error})", file=sys.stderr)

    def camera_path(self, frames: int = PATH_FRAMES, loop: bool = False) -> dict:
        """nerfstudio's camera-path dict of the keyframes (module doc); ValueError without keyframes."""
        from training.render_path import interpolate_path  # render_path imports this module

        with self._lock:
            keys = list(self.keyframes)
        if not keys:
            raise ValueError("no keyframes: press Add keyframe first")
        if frames < 1:
            raise ValueError(f"Frames must be >= 1, got {frames}")
        height, width = frame_size(self._side, keys[0][2], self.model.upsample)
        c2w = np.stack([key[0] for key in keys])
        focal = np.array([focal_from_fov(key[1], height) for key in keys])
        intrinsics = np.stack([focal, focal, np.full_like(focal, width / 2), np.full_like(focal, height / 2)], -1)
        if len(keys) == 1:
            path, path_k = np.repeat(c2w, frames, 0), np.repeat(intrinsics, frames, 0)
        else:
            path, path_k = interpolate_path(c2w, intrinsics, frames, loop)
        return {
            "render_height": height,
            "render_width": width,
            "seconds": frames / 30.0,
            "frame": "model",  # the run's frame (render_path reads it)
            "camera_path": [
                {"camera_to_world": c.reshape(-1).tolist(), "fov": math.degrees(fov_from_focal(k[1], height))}
                for c, k in zip(path, path_k)
            ],
            "keyframes": [
                {"matrix": key[0].reshape(-1).tolist(), "fov": math.degrees(key[1]), "aspect": key[2]} for key in keys
            ],
            "loop": bool(loop),
        }

    def save_camera_path(self, name: str = "camera_path", frames: int = PATH_FRAMES, loop: bool = False) -> Path:
        """Write :meth:`camera_path` to ``path_dir/<name>.json`` (atomically); returns the file."""
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(name).stem).strip("._") or "camera_path"
        content = self.camera_path(frames, loop)
        self.path_dir.mkdir(parents=True, exist_ok=True)
        path = self.path_dir / f"{stem}.json"
        temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            temp.write_text(json.dumps(content, indent=1))
            os.replace(temp, path)
        finally:
            temp.unlink(missing_ok=True)
        return path

    # ------------------------------------------------------------------ viser's threads: record only
    def _on_connect(self, client) -> None:
        with self._lock:
            self._clients[client.client_id] = _Client(client)
        self._on_camera(client.client_id, client.camera)  # viser connects a client on its first camera message
        client.camera.on_update(lambda camera: self._on_camera(client.client_id, camera))
        if client.client_id not in self.server.get_clients():  # gone before this ran (callbacks run on a pool)
            self._on_disconnect(client)

    def _on_camera(self, client_id: int, camera) -> None:
        c2w = viser_to_c2w(camera.wxyz, camera.position)
        with self._lock:
            client = self._clients.get(client_id)
            if client is not None:
                client.c2w, client.fov, client.aspect = c2w, float(camera.fov), float(camera.aspect)
                client.version += 1
                client.moved_at = time.perf_counter()

    def _on_disconnect(self, client) -> None:
        with self._lock:
            self._clients.pop(client.client_id, None)
            resume = self._paused and not self._clients
        if resume:  # nobody is left to press Resume
            print("viewer: the last browser disconnected while training was paused: resuming", file=sys.stderr)
            self.set_paused(False)

    def _set_view(self, mode: str | None = None, side: int | None = None) -> None:
        with self._lock:
            self._mode = mode if mode is not None else self._mode
            self._side = side if side is not None else self._side
            for client in self._clients.values():
                client.drawn_version = -1

    def set_paused(self, paused: bool) -> None:
        """Pause or resume training (the button's action)."""
        self._paused = bool(paused)
        if self._pause_button is not None:
            self._pause_button.label = "Resume training" if paused else "Pause training"

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def num_clients(self) -> int:
        return len(self._clients)

    # ------------------------------------------------------------------ the model's thread: render
    def _next_job(self, now: float, step: int) -> tuple | None:
        """(client, c2w, fov, aspect, version, full, mode, side) of the most overdue frame, or None."""
        best = None
        with self._lock:
            for client in self._clients.values():
                if client.c2w is None:
                    continue
                still = now - client.moved_at >= SETTLE_SECONDS
                if client.version != client.drawn_version:
                    full = still
                elif not client.drawn_full and still:
                    full = True
                elif self.training and client.drawn_step != step and now - client.drawn_at >= REFRESH_SECONDS:
                    full = True
                else:
                    continue
                if best is None or client.drawn_at < best[0].drawn_at:
                    best = (client, client.c2w.copy(), client.fov, client.aspect, client.version, full)
            return None if best is None else (*best, self._mode, self._side)

    def poll(self, step: int = 0) -> bool:
        """Render and send the most overdue frame, if any (no budget); True when one was sent or attempted."""
        job = self._next_job(time.perf_counter(), step)
        if job is None:
            return False
        client, c2w, fov, aspect, version, full, mode, side = job
        side = side if full else max(RESOLUTION_SLIDER[0], side // PREVIEW_DIVISOR)
        height, width = frame_size(side, aspect, self.model.upsample)
        try:
            frame = render_frame(
                self.model, c2w, height, width, focal_from_fov(fov, height), mode, self.near, self.far, self.chunk
            )
        except Exception as error:  # the viewer never stops training
            print(f"viewer: render failed ({type(error).__name__}: {error}); skipping this frame", file=sys.stderr)
            frame = None
        if frame is not None and client.handle.client_id not in self.server.get_clients():  # viser only warns
            frame = None
            with self._lock:
                self._clients.pop(client.handle.client_id, None)
            print("viewer: a browser disconnected during a render; its frame is dropped", file=sys.stderr)
        if frame is not None:
            try:
                client.handle.scene.set_background_image(frame, format="jpeg", jpeg_quality=85)
                self.frames_sent += 1
                self.last_frame, self.last_frame_full = frame, full
            except Exception as error:  # the viewer never stops training
                print(f"viewer: sending a frame failed ({type(error).__name__}: {error})", file=sys.stderr)
        with self._lock:
            client.drawn_version, client.drawn_full = version, full
            client.drawn_at, client.drawn_step = time.perf_counter(), step
        return True

    def on_step(self, trainer, interrupted: Callable[[], bool] | None = None) -> float:
        """The training loop's per-step hook: at most one frame within the budget, progress texts, and the wait
        while paused (rendering on). Returns the seconds spent paused (not training time)."""
        if self._closed or not (self._clients or self._paused):
            return 0.0
        now = time.perf_counter()
        if now >= self._next_progress_at:
            self._update_progress(trainer, now)
        if self._paused:
            return self._wait_while_paused(trainer, interrupted or (lambda: False))
        if now >= self._next_render_at and self.poll(trainer.step):
            spent = time.perf_counter() - now
            self.render_seconds += spent
            self._next_render_at = time.perf_counter() + spent * (1.0 - self.budget) / self.budget
        return 0.0

    def _wait_while_paused(self, trainer, interrupted: Callable[[], bool]) -> float:
        start = time.perf_counter()
        self._step_text.value = f"{trainer.step} / {trainer.iters} (paused)"
        while self._paused and not self._closed and not interrupted():
            if not self.poll(trainer.step):
                time.sleep(IDLE_SLEEP)
        paused = time.perf_counter() - start
        self._paused_since_progress += paused
        return paused

    def _update_progress(self, trainer, now: float) -> None:
        seconds = now - self._progress_time - self._paused_since_progress
        rays = trainer.rays_done - self._progress_rays
        if seconds > 0 and rays > 0:
            self._rays_text.value = f"{rays / seconds:,.0f}"
        self._progress_time, self._progress_rays, self._paused_since_progress = now, trainer.rays_done, 0.0
        self._next_progress_at = now + PROGRESS_SECONDS
        self.set_progress(trainer.step, trainer.iters, trainer.history["psnr"][-1] if trainer.history["psnr"] else None)

    def set_progress(self, step: int, iters: int, psnr: float | None) -> None:
        """The GUI's step and batch PSNR texts."""
        self._step_text.value = f"{step} / {iters}"
        if psnr is not None:
            self._psnr_text.value = f"{psnr:.2f} dB"

    def serve(self, until: Callable[[], bool] | None = None) -> None:
        """Render for the browsers on this thread until ``until()`` is true or the viewer is closed (Ctrl-C
        raises KeyboardInterrupt as usual)."""
        while not self._closed and not (until and until()):
            if not self.poll():
                time.sleep(IDLE_SLEEP)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.redirect_stdout(io.StringIO()):  # viser's "Server stopped"
                self.server.stop()
