"""Analytic solids for the procedural scene: exact ray intersections, normals and signed distances.

All functions are elementwise torch code over (N, 3) points/rays (no reductions across rays, so results do not
depend on the thread count). Ray directions are unit length; a miss is t = +inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MISS = math.inf


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(..., 3) x (..., 3) -> (...), written out so it is exact-order elementwise code."""
    return a[..., 0] * b[..., 0] + a[..., 1] * b[..., 1] + a[..., 2] * b[..., 2]


def _vector(values, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=like.dtype, device=like.device)


def _first_root(b: torch.Tensor, c: torch.Tensor, a: torch.Tensor | float, t_min: float) -> torch.Tensor:
    """Smaller root of a t^2 + 2 b t + c = 0 where it is real and beyond t_min, else +inf."""
    disc = b * b - a * c
    t = (-b - disc.clamp_min(0).sqrt()) / a
    return torch.where((disc >= 0) & (t > t_min), t, torch.full_like(t, MISS))


@dataclass(frozen=True)
class Sphere:
    center: tuple[float, float, float]
    radius: float

    def intersect(self, origins, directions, t_min: float = 1e-4):
        """(N, 3) rays -> t (N,) and outward normals (N, 3) at the hit."""
        oc = origins - _vector(self.center, origins)
        t = _first_root(dot(oc, directions), dot(oc, oc) - self.radius**2, 1.0, t_min)
        return t, self.normal(origins + directions * t.nan_to_num(0.0, posinf=0.0).unsqueeze(-1))

    def normal(self, points):
        return (points - _vector(self.center, points)) / self.radius

    def sdf(self, points):
        return torch.linalg.vector_norm(points - _vector(self.center, points), dim=-1) - self.radius


@dataclass(frozen=True)
class Ellipsoid:
    """Axis-aligned ellipsoid; its sdf is the usual first-order bound (exact sign, zero on the surface)."""

    center: tuple[float, float, float]
    radii: tuple[float, float, float]

    def intersect(self, origins, directions, t_min: float = 1e-4):
        radii = _vector(self.radii, origins)
        o = (origins - _vector(self.center, origins)) / radii
        d = directions / radii
        t = _first_root(dot(o, d), dot(o, o) - 1.0, dot(d, d), t_min)
        return t, self.normal(origins + directions * t.nan_to_num(0.0, posinf=0.0).unsqueeze(-1))

    def normal(self, points):
        radii = _vector(self.radii, points)
        n = (points - _vector(self.center, points)) / (radii * radii)
        return n / torch.linalg.vector_norm(n, dim=-1, keepdim=True).clamp_min(1e-12)

    def sdf(self, points):
        radii = _vector(self.radii, points)
        p = points - _vector(self.center, points)
        k0 = torch.linalg.vector_norm(p / radii, dim=-1)
        k1 = torch.linalg.vector_norm(p / (radii * radii), dim=-1).clamp_min(1e-12)
        return k0 * (k0 - 1.0) / k1


@dataclass(frozen=True)
class Box:
    """Box with half sizes ``half``, turned by ``yaw`` radians about the world z axis."""

    center: tuple[float, float, float]
    half: tuple[float, float, float]
    yaw: float = 0.0

    def to_local(self, vectors, is_point: bool):
        """World -> box frame (rotation by -yaw about z; points are also re-centred)."""
        if is_point:
            vectors = vectors - _vector(self.center, vectors)
        c, s = math.cos(self.yaw), math.sin(self.yaw)
        x, y = vectors[..., 0], vectors[..., 1]
        return torch.stack([c * x + s * y, -s * x + c * y, vectors[..., 2]], dim=-1)

    def to_world(self, vectors):
        c, s = math.cos(self.yaw), math.sin(self.yaw)
        x, y = vectors[..., 0], vectors[..., 1]
        return torch.stack([c * x - s * y, s * x + c * y, vectors[..., 2]], dim=-1)

    def intersect(self, origins, directions, t_min: float = 1e-4):
        o, d = self.to_local(origins, True), self.to_local(directions, False)
        half = _vector(self.half, o)
        d = torch.where(d.abs() < 1e-12, torch.full_like(d, 1e-12), d)  # axis-parallel rays: slabs at +-inf
        t1, t2 = (-half - o) / d, (half - o) / d
        near, far = torch.minimum(t1, t2), torch.maximum(t1, t2)
        t_near = torch.maximum(torch.maximum(near[..., 0], near[..., 1]), near[..., 2])
        t_far = torch.minimum(torch.minimum(far[..., 0], far[..., 1]), far[..., 2])
        t = torch.where((t_near <= t_far) & (t_near > t_min), t_near, torch.full_like(t_near, MISS))
        return t, self.normal(origins + directions * t.nan_to_num(0.0, posinf=0.0).unsqueeze(-1))

    def normal(self, points):
        p = self.to_local(points, True)
        scaled = p / _vector(self.half, p)
        axis = scaled.abs().argmax(dim=-1, keepdim=True)  # the face the point lies on
        n = torch.zeros_like(p).scatter_(-1, axis, scaled.gather(-1, axis).sign())
        return self.to_world(n)

    def sdf(self, points):
        q = self.to_local(points, True).abs() - _vector(self.half, points)
        outside = torch.linalg.vector_norm(q.clamp_min(0.0), dim=-1)
        return outside + q.max(dim=-1).values.clamp_max(0.0)


@dataclass(frozen=True)
class Cylinder:
    """Capped cylinder with a vertical (world z) axis."""

    center: tuple[float, float, float]
    radius: float
    half_height: float

    def intersect(self, origins, directions, t_min: float = 1e-4):
        o = origins - _vector(self.center, origins)
        ox, oy, oz = o.unbind(-1)
        dx, dy, dz = directions.unbind(-1)
        radial = dx * dx + dy * dy
        t_side = _first_root(ox * dx + oy * dy, ox * ox + oy * oy - self.radius**2, radial.clamp_min(1e-12), t_min)
        t_side = torch.where((oz + t_side * dz).abs() <= self.half_height, t_side, torch.full_like(t_side, MISS))
        cap_z = torch.where(dz < 0, 1.0, -1.0).to(oz) * self.half_height  # the cap facing the ray
        safe_dz = torch.where(dz.abs() < 1e-12, torch.full_like(dz, 1e-12), dz)
        t_cap = (cap_z - oz) / safe_dz
        cap_x, cap_y = ox + t_cap * dx, oy + t_cap * dy
        on_cap = (cap_x * cap_x + cap_y * cap_y <= self.radius**2) & (t_cap > t_min)
        t_cap = torch.where(on_cap, t_cap, torch.full_like(t_cap, MISS))
        t = torch.minimum(t_side, t_cap)
        return t, self.normal(origins + directions * t.nan_to_num(0.0, posinf=0.0).unsqueeze(-1))

    def normal(self, points):
        p = points - _vector(self.center, points)
        radial = torch.sqrt(p[..., 0] ** 2 + p[..., 1] ** 2)
        on_cap = (p[..., 2].abs() - self.half_height) > (radial - self.radius)
        side = torch.stack([p[..., 0], p[..., 1], torch.zeros_like(radial)], -1) / radial.clamp_min(1e-12).unsqueeze(-1)
        cap = torch.zeros_like(p)
        cap[..., 2] = p[..., 2].sign()
        return torch.where(on_cap.unsqueeze(-1), cap, side)

    def sdf(self, points):
        p = points - _vector(self.center, points)
        radial = torch.sqrt(p[..., 0] ** 2 + p[..., 1] ** 2)
        q = torch.stack([radial - self.radius, p[..., 2].abs() - self.half_height], -1)
        return torch.linalg.vector_norm(q.clamp_min(0.0), dim=-1) + q.max(dim=-1).values.clamp_max(0.0)
