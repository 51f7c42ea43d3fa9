"""Clients of the live viewer (training/viewer.py) for tests and benchmarks, with no browser download:

- :class:`HeadlessChromium`: the system's Chromium (Debian: ``apt-get install -y chromium``) in headless mode,
  driven over the DevTools protocol (a websocket, through the ``websockets`` package viser already needs):
  open a page, take a PNG screenshot.
- :class:`SimulatedClient`: a Python websocket client that speaks viser's protocol as the browser does: it
  reports a camera (msgpack ``ViewerCameraMessage``, like the page on connect and on every move) and reads
  (and drops) what the server sends, frames included. For machines without a browser (the GPU machines).
"""

from __future__ import annotations

import base64
import json
import math
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """Path of an installed Chromium / Chrome, or None."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class HeadlessChromium:
    """One headless Chromium page driven over the DevTools protocol (context manager; ``close`` kills it)."""

    def __init__(self, width: int = 1200, height: int = 800, binary: str | None = None, timeout: float = 30.0):
        from websockets.sync.client import connect

        binary = binary or find_chromium()
        if binary is None:
            raise FileNotFoundError("no chromium binary found (Debian: apt-get install -y chromium)")
        self.profile = tempfile.mkdtemp(prefix="viewer-chromium-")
        flags = [
            "--headless",
            "--no-sandbox",  # CI runs as root
            "--disable-dev-shm-usage",  # containers' /dev/shm is often 64 MB
            "--use-angle=swiftshader",  # WebGL (viser's canvas) in software
            "--enable-unsafe-swiftshader",
            "--no-first-run",
            "--disable-extensions",
            "--remote-debugging-port=0",
            f"--user-data-dir={self.profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        self.process = subprocess.Popen([binary, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + timeout
        port = None
        while port is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("chromium did not start its DevTools server")
            try:
                with open(port_file) as file:
                    port = int(file.read().split()[0])
            except (OSError, ValueError, IndexError):
                time.sleep(0.05)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=timeout) as response:
                pages = [t for t in json.load(response) if t.get("type") == "page"]
            self.socket = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=timeout)
            self._id = 0
            self.call("Page.enable", timeout=timeout)
            # the page's viewport (and so the screenshot) is exactly width x height, whatever the window's frame
            self.call(
                "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
            )
        except Exception:
            self.close()
            raise

    def call(self, method: str, timeout: float = 30.0, **params) -> dict:
        """Send one DevTools command and return its result (events in between are dropped)."""
        self._id += 1
        self.socket.send(json.dumps({"id": self._id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self.socket.recv(timeout=max(0.01, deadline - time.monotonic())))
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str, timeout: float = 30.0):
        """The value of a JavaScript expression in the page (None when it has none, e.g. a DOM node)."""
        return self.call("Runtime.evaluate", timeout=timeout, expression=expression, returnByValue=True)["result"].get(
            "value"
        )

    def screenshot(self, path: str | os.PathLike | None = None) -> bytes:
        """The page as it is now, as PNG bytes (also written to ``path`` when given)."""
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        if path is not None:
            with open(path, "wb") as file:
                file.write(data)
        return data

    def close(self) -> None:
        socket = getattr(self, "socket", None)
        if socket is not None:
            socket.close()
            self.socket = None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> HeadlessChromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SimulatedClient:
    """A browser stand-in: connects to a viser server, reports a camera, and consumes everything it is sent.

    ``position`` / ``look_at`` place the camera (z up); ``orbit(seconds_per_turn)`` moves it around the z axis
    from a thread, as a user dragging the view would (``None``: the camera stays still).
    """

    def __init__(self, url: str, position=(3.0, 0.0, 1.5), look_at=(0.0, 0.0, 0.0), fov: float = 0.9):
        import msgspec
        import viser
        from websockets.sync.client import connect

        self._encode = msgspec.msgpack.encode
        self.position, self.look_at, self.fov = tuple(position), tuple(look_at), fov
        ws_url = url.replace("http://", "ws://")
        self.socket = connect(ws_url, subprotocols=[f"viser-v{viser.__version__}"], max_size=None)
        self.bytes_received = 0
        self.messages_received = 0
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._mover = None
        self.send_camera()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                message = self.socket.recv(timeout=0.2)
            except TimeoutError:
                continue
            except Exception:  # closed
                return
            self.bytes_received += len(message)
            self.messages_received += 1

    def send_camera(self, width: int = 800, height: int = 600) -> None:
        """One ViewerCameraMessage: OpenCV-style pose looking from ``position`` at ``look_at``, z up."""
        import numpy as np

        from training.viewer_frames import matrix_to_quaternion

        eye, target = np.array(self.position, float), np.array(self.look_at, float)
        forward = (target - eye) / np.linalg.norm(target - eye)
        right = np.cross(forward, [0.0, 0.0, 1.0])
        right /= np.linalg.norm(right)
        down = np.cross(forward, right)
        wxyz = matrix_to_quaternion(np.stack([right, down, forward], axis=1))
        message = {
            "type": "ViewerCameraMessage",
            "wxyz": [float(v) for v in wxyz],
            "position": [float(v) for v in eye],
            "fov": float(self.fov),
            "near": 0.01,
            "far": 1000.0,
            "image_height": int(height),
            "image_width": int(width),
            "look_at": [float(v) for v in target],
            "up_direction": [0.0, 0.0, 1.0],
        }
        self.socket.send(self._encode(message))

    def orbit(self, seconds_per_turn: float | None, updates_per_second: float = 20.0) -> None:
        """Start moving the camera around the z axis (``None``: stop moving)."""
        if self._mover is not None:
            self._moving = False
            self._mover.join()
            self._mover = None
        if seconds_per_turn is None:
            return
        self._moving = True

        def move() -> None:
            radius = math.hypot(self.position[0], self.position[1])
            start = time.monotonic()
            while self._moving and not self._stop.is_set():
                angle = 2 * math.pi * (time.monotonic() - start) / seconds_per_turn
                self.position = (radius * math.cos(angle), radius * math.sin(angle), self.position[2])
                try:
                    self.send_camera()
                except Exception:
                    return
                time.sleep(1.0 / updates_per_second)

        self._mover = threading.Thread(target=move, daemon=True)
        self._mover.start()

    def close(self) -> None:
        self.orbit(None)
        self._stop.set()
        self.socket.close()
        self._reader.join(timeout=5)

    def __enter__(self) -> SimulatedClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
