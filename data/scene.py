"""The in-memory form of one split of a scene: images, cameras and their intrinsics."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from data.camera_models import Lens


@dataclass
class Scene:
    """One split of a posed-image scene.

    images:     (V, H, W, 3) uint8, already composited on ``background``.
    c2w:        (V, 4, 4) float32 camera-to-world, OpenGL convention (camera looks down -z, y up, x right).
    height, width: image size in pixels.
    focal:      focal length in pixels of the first view (a summary; rays use ``intrinsics``).
    near, far:  ray distance range (Euclidean, along unit-length directions).
    bbox:       (2, 3) float32 min and max corners of the scene box.
    background: RGB in [0, 1] that transparent pixels were composited on.
    split:      the split's name (``"train"``, ``"val"``, ``"test"``, ...).
    names:      the frames' ``file_path`` as written in the transforms file.
    alpha:      (V, H, W) uint8 coverage the images were composited with, or None (opaque images). The view
                on another background B' is ``images + (B' - background) * (1 - alpha)`` (in [0, 1] units).
    intrinsics: (V, 4) float64 pinhole intrinsics per view, fx, fy, cx, cy in pixels (data.rays conventions);
                None (the default) means (focal, focal, width/2, height/2) for every view, the blender cameras.
                float64 so that intrinsics derived from them (scaled renders) match those from ``focal``.
    lens:       None (pinhole cameras) or the views' distortion, a :class:`data.camera_models.Lens` with (V, 6)
                float64 coefficients; it does not change with ``downscale`` (it acts on normalised coordinates).
    sizes:      None when every view is ``height`` x ``width``; else (V, 2) int64 each view's own (height, width)
                (portrait and landscape photos, two cameras): ``height`` and ``width`` are then the largest, and
                each view's pixels are the top-left (h, w) of its padded image (:meth:`view_size`); the padding
                is never sampled, scored or shown.
    """

    images: torch.Tensor
    c2w: torch.Tensor
    height: int
    width: int
    focal: float
    near: float
    far: float
    bbox: torch.Tensor
    background: tuple[float, float, float]
    split: str
    names: list[str]
    alpha: torch.Tensor | None = None
    intrinsics: torch.Tensor | None = None
    lens: Lens | None = None
    sizes: torch.Tensor | None = None

    def __post_init__(self) -> None:
        views = self.images.shape[0] if self.images.dim() == 4 else -1
        if self.images.dtype != torch.uint8 or tuple(self.images.shape[1:]) != (self.height, self.width, 3):
            raise ValueError(
                f"Scene.images must be uint8 of shape (V, {self.height}, {self.width}, 3), "
                f"got {self.images.dtype} {tuple(self.images.shape)}"
            )
        if self.c2w.dtype != torch.float32 or tuple(self.c2w.shape) != (views, 4, 4):
            raise ValueError(
                f"Scene.c2w must be float32 of shape ({views}, 4, 4), got {self.c2w.dtype} {tuple(self.c2w.shape)}"
            )
        if self.alpha is not None and (
            self.alpha.dtype != torch.uint8 or tuple(self.alpha.shape) != (views, self.height, self.width)
        ):
            raise ValueError(
                f"Scene.alpha must be None or uint8 of shape ({views}, {self.height}, {self.width}), "
                f"got {self.alpha.dtype} {tuple(self.alpha.shape)}"
            )
        if tuple(self.bbox.shape) != (2, 3):
            raise ValueError(f"Scene.bbox must have shape (2, 3), got {tuple(self.bbox.shape)}")
        if len(self.names) != views:
            raise ValueError(f"Scene.names has {len(self.names)} entries for {views} views")
        if not 0.0 <= self.near < self.far:
            raise ValueError(f"Scene needs 0 <= near < far, got near={self.near}, far={self.far}")
        if self.intrinsics is None:
            one = (float(self.focal), float(self.focal), 0.5 * self.width, 0.5 * self.height)
            self.intrinsics = torch.tensor([one], dtype=torch.float64, device=self.images.device).expand(views, 4)
        self.intrinsics = torch.as_tensor(self.intrinsics, dtype=torch.float64).contiguous()
        if (
            tuple(self.intrinsics.shape) != (views, 4)
            or not bool(torch.isfinite(self.intrinsics).all())
            or not bool((self.intrinsics[:, :2] > 0).all())
        ):
            raise ValueError(
                f"Scene.intrinsics must be None or a float tensor of shape ({views}, 4) (fx, fy, cx, cy) with "
                f"finite values and positive fx, fy, got shape {tuple(self.intrinsics.shape)}"
            )

        if self.sizes is not None:
            self.sizes = torch.as_tensor(self.sizes, dtype=torch.int64).cpu()
            if (
                tuple(self.sizes.shape) != (views, 2)
                or not bool((self.sizes >= 1).all())
                or int(self.sizes[:, 0].max()) != self.height
                or int(self.sizes[:, 1].max()) != self.width
            ):
                raise ValueError(
                    f"Scene.sizes must be None or ({views}, 2) positive (height, width) whose largest are "
                    f"({self.height}, {self.width}), got {self.sizes.tolist()}"
                )
            if bool((self.sizes == self.sizes[:1]).all()):
                self.sizes = None  # one size after all: the plain layout
        if self.lens is not None:
            self.lens = self.lens.to(self.intrinsics.device, torch.float64)
            if tuple(self.lens.coefficients.shape) != (views, 6):
                raise ValueError(
                    f"Scene.lens must have ({views}, 6) coefficients, got {tuple(self.lens.coefficients.shape)}"
                )

    @property
    def num_views(self) -> int:
        return self.images.shape[0]

    def view_size(self, view: int) -> tuple[int, int]:
        """(height, width) of view ``view``'s own pixels."""
        if self.sizes is None:
            return self.height, self.width
        height, width = self.sizes[view].tolist()
        return height, width

    def view_image(self, view: int) -> torch.Tensor:
        """(h, w, 3) uint8 view ``view``'s own pixels (without padding)."""
        height, width = self.view_size(view)
        return self.images[view, :height, :width]

    def describe_sizes(self) -> str:
        """``WxH``, or each size with its count for views of several sizes (``1080x1920 (x31), 1920x1080 (x28)``)."""
        if self.sizes is None:
            return f"{self.width}x{self.height}"
        sizes, counts = torch.unique(self.sizes, dim=0, return_counts=True)
        return ", ".join(f"{w}x{h} (x{n})" for (h, w), n in zip(sizes.tolist(), counts.tolist()))

    @property
    def device(self) -> torch.device:
        return self.images.device

    def pixel_footprint(self, point: torch.Tensor) -> float:
        """World size of one pixel at the distance of ``point`` (3,) from the cameras: distance / fx, the median
        over the views (the scale at which finer geometry stops showing in these images)."""
        distance = (self.c2w[:, :3, 3].double().cpu() - point.double().cpu()).norm(dim=1)
        fx = self.intrinsics[:, 0].cpu() if self.intrinsics is not None else torch.full_like(distance, self.focal)
        return float((distance / fx).median())

    def to(self, device: torch.device | str) -> Scene:
        """A copy with images, alpha, cameras and box on ``device`` (the images stay uint8)."""
        return dataclasses.replace(
            self,
            images=self.images.to(device),
            c2w=self.c2w.to(device),
            bbox=self.bbox.to(device),
            intrinsics=self.intrinsics.to(device),
            lens=None if self.lens is None else self.lens.to(device),
            alpha=None if self.alpha is None else self.alpha.to(device),
        )
