"""Per-frame pose refinement (BARF / nerfacto's camera optimiser): a learnt correction of each training camera.

Captured poses (COLMAP, a phone's tracking) are off by a fraction of a degree and a few millimetres; the field then
explains the misregistration with floaters and blur. ``model.pose_refinement: so3xr3`` learns, per training image,
a 6-vector ``(w, v)``: ``w`` (3,) an axis-angle rotation (the so(3) exponential map, :func:`so3_exp`) and ``v``
(3,) a translation in scene units (nerfstudio's SO3xR3 form: rotation and translation separate). Each starts at
zero (the poses as given). The correction moves a camera ``c2w = [R | o]`` to ``[exp(w) R | o + v]``: the camera
turns about its own centre by a rotation about world axes and shifts by ``v``, so a ray (o, d) of that image becomes
``(o + v, exp(w) d)``; the batch's rays need no camera matrix (:meth:`PoseRefinement.forward`). About the centre,
not the world origin: a rotation then does not move the camera, which keeps the two halves of the 6-vector apart.

The march's sample distances stay data (``march_rays`` is not differentiable); the points ``o + t d`` are
recomputed with gradients (:func:`points_with_ray_gradients`), so the photometric loss reaches the corrections
through the grids' lookups and the view directions.

Rule for images without an index (held-out frames, renders, the viewer: ``views`` None): no correction, the poses
as given (as nerfstudio evaluates). Trained with its own Adam group (``train.lr_pose``) and an L2 penalty
(``train.pose_penalty``, :meth:`PoseRefinement.penalty`); saved in the model's state dict (resume), reported in
metrics.json (:meth:`PoseRefinement.summary`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from cuda_ext.reference import contract_points
from models.config import POSE_MODES
from models.field import to_unit

_TAYLOR_BELOW = 1e-4  # theta^2 under which sin(t)/t and (1 - cos t)/t^2 take their series (exact to ~1e-17 there)


def skew(w: torch.Tensor) -> torch.Tensor:
    """(..., 3) vectors -> (..., 3, 3) cross-product matrices ``[w]_x`` (``[w]_x d = w x d``)."""
    zero = torch.zeros_like(w[..., 0])
    x, y, z = w.unbind(-1)
    rows = (zero, -z, y), (z, zero, -x), (-y, x, zero)
    return torch.stack([torch.stack(row, -1) for row in rows], -2)


def so3_exp(w: torch.Tensor) -> torch.Tensor:
    """(..., 3) axis-angle vectors (angle = |w| radians) -> (..., 3, 3) rotation matrices, Rodrigues' formula
    ``I + sin(t)/t [w]_x + (1 - cos t)/t^2 [w]_x^2``. Smooth at w = 0 (series there; exactly I at 0, with the
    gradient of ``I + [w]_x``); any float dtype."""
    theta2 = (w * w).sum(-1)[..., None, None]
    small = theta2 < _TAYLOR_BELOW
    safe2 = torch.where(small, torch.ones_like(theta2), theta2)  # no 0/0 in the branch where() discards
    theta = safe2.sqrt()
    half_sin = torch.sin(0.5 * theta)
    a = torch.where(small, 1.0 - theta2 / 6.0 + theta2.square() / 120.0, torch.sin(theta) / theta)
    b = torch.where(small, 0.5 - theta2 / 24.0 + theta2.square() / 720.0, 2.0 * half_sin.square() / safe2)
    k = skew(w)
    eye = torch.eye(3, dtype=w.dtype, device=w.device)
    return eye + a * k + b * (k @ k)


def rotation_angle(w: torch.Tensor) -> torch.Tensor:
    """(..., 3) axis-angle vectors -> (...,) their rotation angles in degrees."""
    return torch.linalg.vector_norm(w, dim=-1) * (180.0 / math.pi)


def rotate(rotation: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """(..., 3, 3) rotations applied to (..., 3) vectors (broadcasting). Elementwise products and sums, so the
    identity returns the vectors bit for bit."""
    return (rotation * vectors[..., None, :]).sum(-1)


class PoseRefinement(nn.Module):
    """A (num_images, 6) table of pose corrections ``(w, v)`` (module docstring); none with mode ``none``.

    Args:
        mode: ``none`` or ``so3xr3``.
        num_images: rows of the table (0 until :meth:`resize` or a state dict sets them).
    """

    def __init__(self, mode: str = "none", num_images: int = 0):
        super().__init__()
        if mode not in POSE_MODES:
            raise ValueError(f"model.pose_refinement: expected one of {', '.join(POSE_MODES)}, got {mode!r}")
        self.mode = mode
        self.table = nn.Parameter(torch.zeros(0, 6)) if mode != "none" else None
        self.resize(num_images)

    @property
    def enabled(self) -> bool:
        return self.table is not None

    @property
    def num_images(self) -> int:
        return 0 if self.table is None else self.table.shape[0]

    def resize(self, num_images: int) -> None:
        """A fresh table of ``num_images`` zero corrections (replaces the parameter)."""
        if num_images < 0:
            raise ValueError(f"PoseRefinement.resize: num_images must be >= 0, got {num_images}")
        if self.table is not None:
            self.table = nn.Parameter(torch.zeros(num_images, 6, device=self.table.device))

    def transforms(self, views: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(*V,) int64 image indices -> rotations (*V, 3, 3) and translations (*V, 3)."""
        if views.dtype != torch.int64:
            raise ValueError(f"views: expected int64 image indices, got {views.dtype}")
        rows = self.table[views]  # an index out of range raises here (IndexError / device assert)
        return so3_exp(rows[..., :3]), rows[..., 3:]

    def forward(
        self, views: torch.Tensor | None, origins: torch.Tensor, *directions: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Rays of training images through their corrected cameras: ``(o + v, exp(w) d)``.

        ``views``: (*V,) the image of each ray (a prefix of the rays' batch shape: (B,) for (B, 3) rays, (n,) for
        (n, P, P, 3) patches), or None (held out: unchanged). ``origins`` (..., 3); each of ``directions`` (..., 3)
        with the same leading (*V,) (e.g. a patch's low- and full-resolution directions). Returns
        ``(origins, *directions)``; the inputs themselves when off or ``views`` is None.
        """
        if self.table is None or views is None:
            return (origins, *directions)
        for name, tensor in (("origins", origins), *(("directions", d) for d in directions)):
            if tensor.shape[: views.dim()] != views.shape or tensor.dim() <= views.dim() or tensor.shape[-1] != 3:
                raise ValueError(
                    f"pose refinement: {name} {tuple(tensor.shape)} must be (*V, ..., 3) for views {tuple(views.shape)}"
                )
        rotation, translation = self.transforms(views)
        extra = origins.dim() - 1 - views.dim()
        translation = translation.reshape(*views.shape, *(1,) * extra, 3).to(origins.dtype)
        moved = [origins + translation]
        for d in directions:
            inner = (1,) * (d.dim() - 1 - views.dim())
            moved.append(rotate(rotation.reshape(*views.shape, *inner, 3, 3).to(d.dtype), d))
        return tuple(moved)

    def penalty(self) -> torch.Tensor:
        """Mean over the training images of ``|w|^2 + |v|^2`` (radians, scene units): the L2 pull towards the
        poses as given (scalar, in the graph). ValueError when there is no table (off, or no images)."""
        if self.table is None or self.num_images == 0:
            raise ValueError("PoseRefinement.penalty: no corrections (model.pose_refinement is none or no images)")
        return self.table.square().sum(-1).mean()

    @torch.no_grad()
    def summary(self) -> dict[str, float] | None:
        """How far the poses moved (metrics.json): mean and max rotation (degrees) and translation (scene units)
        over the training images; None when off."""
        if self.table is None or self.num_images == 0:
            return None
        degrees = rotation_angle(self.table[:, :3].double())
        shift = torch.linalg.vector_norm(self.table[:, 3:].double(), dim=-1)
        return {
            "images": self.num_images,
            "rotation_deg_mean": float(degrees.mean()),
            "rotation_deg_max": float(degrees.max()),
            "translation_mean": float(shift.mean()),
            "translation_max": float(shift.max()),
        }

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # a checkpoint's table decides the number of images (a model built for export has none yet)
        incoming = state_dict.get(prefix + "table")
        if self.table is not None and isinstance(incoming, torch.Tensor) and incoming.dim() == 2:
            if incoming.shape[1] == 6 and incoming.shape[0] != self.num_images:
                self.resize(incoming.shape[0])
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def points_with_ray_gradients(
    points: torch.Tensor,
    ray: torch.Tensor,
    t: torch.Tensor,
    origins: torch.Tensor,
    directions: torch.Tensor,
    bbox: torch.Tensor,
    contract: bool,
) -> torch.Tensor:
    """The march's (N, 3) grid points with the gradient of ``o + t d`` with respect to the (B, 3) rays (the
    distances ``t`` (N,) of rays ``ray`` (N,) stay data, as ``march_rays``' outputs are on every backend, the
    reference's included): the values are ``points`` bit for bit (the recomputed
    points enter as ``p - p.detach()``, exactly zero), the derivative is that of the box coordinates (``contract``:
    of their L-inf contraction, halved: march_rays' grid coordinates). ``points`` itself when no ray needs a
    gradient (pose refinement off, held-out views)."""
    if not (origins.requires_grad or directions.requires_grad) or not torch.is_grad_enabled():
        return points
    world = origins[ray] + t[:, None].to(origins.dtype) * directions[ray]
    unit = to_unit(world, bbox.to(world.dtype))
    moved = (contract_points(unit) if contract else unit).to(points.dtype)
    return points.detach() + (moved - moved.detach())


__all__ = ["POSE_MODES", "PoseRefinement", "points_with_ray_gradients", "rotate", "rotation_angle", "so3_exp", "skew"]
