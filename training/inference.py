"""The one inference path: evaluation, ``render_only``, the turntable, ``render_path`` and the viewer render a
trained model through :func:`render_view` and hand the pictures to the host through :class:`HostPipeline`.

- :func:`render_view`: a full view without gradients through models.render_views.infer_image: ``march_rays`` keeps
  only samples in occupied cells, each sample's density is looked up once, the samples past the early-termination
  transmittance or below the weight threshold are never decoded, the decoder runs in the config's precision (bf16
  autocast in the blender preset) and one ``volume_render`` composites; none of training's jitter, gradients or
  TV/touched-row bookkeeping. On CUDA at least :data:`CUDA_CHUNK` rays a launch (an 800x800 view in one), so the
  two host syncs of a launch (the packed and the decoded sample counts) are paid once per view. It renders what
  ``model.render_image`` (training's own march) renders, to float rounding (tests/test_render_views.py).
- :class:`HostPipeline`: the device-to-host copies of a view start without waiting (pinned buffers,
  ``non_blocking``), and a worker thread waits for them, then encodes and writes PNGs, videos frames or
  whatever the caller asks, while the device renders the next view.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np
import torch

from models.render_views import infer_image

CUDA_CHUNK = 1 << 20  # rays per launch on CUDA at least: a whole 800x800 view (~1-6 GB of packed samples on lego)


def inference_chunk(device: torch.device, requested: int | None) -> int:
    """Rays per chunk: ``requested`` (e.g. ``train.render_chunk``), raised to :data:`CUDA_CHUNK` on CUDA."""
    requested = int(requested or 65536)
    if requested < 1:
        raise ValueError(f"render chunk: must be >= 1 rays, got {requested}")
    return max(requested, CUDA_CHUNK) if device.type == "cuda" else requested


@torch.no_grad()
def render_view(
    model: torch.nn.Module,
    c2w: torch.Tensor,
    height: int,
    width: int,
    intrinsics: float | torch.Tensor,
    chunk: int | None = None,
    lens: Any = None,
) -> dict[str, torch.Tensor]:
    """One view of ``model`` (eval mode expected): dict(rgb (H, W, 3) in [0, 1], depth (H, W) = sum w t, opacity
    (H, W)) on the model's device. ``intrinsics``: a focal length in pixels or (4,) fx, fy, cx, cy; ``lens``: the
    view's lens distortion where the capture has one (passed to the model as is). A model with its own
    ``infer_image(c2w, height, width, intrinsics, chunk, lens)`` (bench.peers' renderers) renders itself."""
    device = model.bbox.device
    c2w = torch.as_tensor(c2w, dtype=torch.float32, device=device)
    own = getattr(model, "infer_image", None)
    render = own if own is not None else partial(infer_image, model)
    return render(c2w, height, width, intrinsics, inference_chunk(device, chunk), lens)


def expected_depth(out: dict[str, torch.Tensor], min_opacity: float = 0.5) -> torch.Tensor:
    """(H, W) depth along the ray where the opacity reaches ``min_opacity``, NaN elsewhere (on the device)."""
    opacity = out["opacity"]
    depth = out["depth"] / opacity.clamp_min(1e-6)
    return torch.where(opacity > min_opacity, depth, torch.full_like(depth, float("nan")))


class HostPipeline:
    """Copies a view's tensors to the host without stalling the device's queue, then runs a function on them in a
    worker pool. ``submit(tensors, fn)`` returns the Future of ``fn({name: numpy array})``; results come in
    submission order through the futures."""

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool = pool

    def submit(self, tensors: dict[str, torch.Tensor], fn: Callable[[dict[str, np.ndarray]], Any]) -> Future:
        host, event = {}, None
        for name, tensor in tensors.items():
            tensor = tensor.detach()
            if tensor.device.type == "cuda":
                pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host[name] = pinned.copy_(tensor, non_blocking=True)
                event = torch.cuda.Event()
            else:
                host[name] = tensor
        if event is not None:
            event.record()  # after every copy above, on the current stream

        def run() -> Any:
            if event is not None:
                event.synchronize()  # this thread waits for the copies; the device goes on rendering
            return fn({name: tensor.numpy() for name, tensor in host.items()})

        return self.pool.submit(run)


def render_frames(
    model: torch.nn.Module,
    cameras: list | np.ndarray | torch.Tensor,
    intrinsics: list | np.ndarray | torch.Tensor,
    shape: tuple[int, int],
    frame: Callable[[dict[str, np.ndarray]], np.ndarray],
    chunk: int | None = None,
    lens_of: Callable[[int], Any] | None = None,
    workers: int = 4,
) -> list[np.ndarray]:
    """Render each camera ((4, 4) c2w with its intrinsics; ``lens_of(index)``: its lens distortion, when the cameras
    have one) at ``shape`` = (H, W) and turn its host maps (rgb, depth (NaN where the opacity is below 0.5),
    opacity) into a picture with ``frame``, in a worker pool while the next camera renders; returns the pictures
    in camera order."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pipeline = HostPipeline(pool)
        futures = []
        for index, (camera, k) in enumerate(zip(cameras, intrinsics)):
            lens = None if lens_of is None else lens_of(index)
            out = render_view(model, torch.as_tensor(camera), *shape, torch.as_tensor(k), chunk, lens)
            maps = {"rgb": out["rgb"], "depth": expected_depth(out), "opacity": out["opacity"]}
            futures.append(pipeline.submit(maps, frame))
        return [future.result() for future in futures]
