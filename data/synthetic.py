"""The built-in procedural scene: analytic solids on a pedestal, ray traced on the CPU, saved in blender format.

Scene (world z up, everything inside [-1.5, 1.5]^3): a round pedestal (top at z = -0.3) with a soft checker top;
on it a shiny red sphere (Blinn-Phong highlight: view dependence), a turned box with fine diagonal stripes, a
cylinder with low-frequency value noise and a lying ellipsoid with a latitude/longitude checker. A directional
light casts hard shadows (antialiased by supersampling like the silhouettes). Rays that miss everything are
transparent (alpha 0). Cameras sit on a sphere of radius 4 looking at the origin with the NeRF-synthetic field of
view; train and val views are random over the upper hemisphere, test views orbit at 30 degrees elevation.

Everything is a deterministic function of the parameters and the seed (which places the cameras and draws the
noise texture): the same call writes the same bytes, whatever the thread count. :func:`intersect` and
:func:`scene_sdf` expose the exact geometry.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from data.blender import write_blender_split
from data.camera_models import Lens
from data.cameras import look_at, orbit_positions, random_zone_positions
from data.geometry import Box, Cylinder, Ellipsoid, Sphere, dot
from data.images import area_downscale, round_to_uint8
from data.rays import camera_rays

GENERATOR_VERSION = 1  # bump when the rendering changes, so cached scenes are regenerated
CAMERA_ANGLE_X = 0.6911112070083618  # the NeRF-synthetic scenes' horizontal field of view
CAMERA_RADIUS = 4.0
SUPERSAMPLE = 2  # rays per pixel side; pixels are their area average (antialiased edges, fractional alpha)
LIGHT = (0.45, -0.5, 0.75)  # towards the light (normalised below)
AMBIENT = 0.3
RAYS_PER_CHUNK = 1 << 18
BACKGROUND_RADIUS = 40.0  # the unbounded variant's room: a textured sphere ~13x the scene box's side

PEDESTAL = Cylinder(center=(0.0, 0.0, -0.4), radius=1.2, half_height=0.1)
SHAPES = (
    PEDESTAL,
    Sphere(center=(0.5, 0.45, 0.15), radius=0.45),
    Box(center=(-0.5, -0.35, 0.0), half=(0.3, 0.3, 0.3), yaw=math.radians(25.0)),
    Cylinder(center=(-0.45, 0.6, 0.05), radius=0.22, half_height=0.35),
    Ellipsoid(center=(0.55, -0.55, -0.12), radii=(0.38, 0.22, 0.18)),
)


@dataclass
class Hit:
    """Nearest intersection of each ray: t (N,) (+inf on a miss), normal (N, 3), shape index (N,) (-1 on a miss)."""

    t: torch.Tensor
    normal: torch.Tensor
    shape: torch.Tensor

    @property
    def hit(self) -> torch.Tensor:
        return self.shape >= 0


def intersect(origins: torch.Tensor, directions: torch.Tensor, t_min: float = 1e-4) -> Hit:
    """Nearest hit of (N, 3) rays (unit directions) with the scene's solids."""
    t = torch.full(origins.shape[:-1], math.inf, dtype=origins.dtype, device=origins.device)
    normal = torch.zeros_like(origins)
    shape = torch.full(origins.shape[:-1], -1, dtype=torch.long, device=origins.device)
    for index, solid in enumerate(SHAPES):
        t_solid, n_solid = solid.intersect(origins, directions, t_min)
        closer = t_solid < t
        t = torch.where(closer, t_solid, t)
        normal = torch.where(closer.unsqueeze(-1), n_solid, normal)
        shape = torch.where(closer, torch.full_like(shape, index), shape)
    return Hit(t, normal, shape)


def scene_sdf(points: torch.Tensor) -> torch.Tensor:
    """(..., 3) points -> (...) signed distance to the union of the solids (negative inside)."""
    distance = SHAPES[0].sdf(points)
    for solid in SHAPES[1:]:
        distance = torch.minimum(distance, solid.sdf(points))
    return distance


# ---- textures -------------------------------------------------------------------------------------------------


def _smoothstep(edge0: float, edge1: float, x: torch.Tensor) -> torch.Tensor:
    x = ((x - edge0) / (edge1 - edge0)).clamp(0.0, 1.0)
    return x * x * (3.0 - 2.0 * x)


def _mix(a, b, weight: torch.Tensor) -> torch.Tensor:
    """Blend two RGB colours by (N,) weights in [0, 1] -> (N, 3)."""
    a, b = torch.as_tensor(a, dtype=weight.dtype), torch.as_tensor(b, dtype=weight.dtype)
    return a + (b - a) * weight.unsqueeze(-1)


def _soft_checker(u: torch.Tensor, v: torch.Tensor, softness: float = 0.35) -> torch.Tensor:
    """Checker of unit cells with blurred edges (band-limited so it does not alias): (N,) in [0, 1]."""
    return _smoothstep(-softness, softness, torch.sin(math.pi * u) * torch.sin(math.pi * v))


class ValueNoise:
    """Smooth 3-D value noise from a periodic lattice of random values drawn from the seed."""

    SIZE = 32

    def __init__(self, seed: int):
        rng = np.random.default_rng([seed, 0x6E6F697365])
        self.table = torch.from_numpy(rng.random(self.SIZE**3)).float()

    def __call__(self, points: torch.Tensor) -> torch.Tensor:
        """(N, 3) points in lattice units -> (N,) values in [0, 1]."""
        cell = torch.floor(points)
        f = points - cell
        w = f * f * (3.0 - 2.0 * f)
        cell = cell.long()
        value = None
        for corner in range(8):  # trilinear blend of the 8 lattice values around each point
            offset = torch.tensor([(corner >> 2) & 1, (corner >> 1) & 1, corner & 1])
            index = (cell + offset) % self.SIZE
            flat = (index[:, 0] * self.SIZE + index[:, 1]) * self.SIZE + index[:, 2]
            weight = torch.where(offset.bool(), w, 1.0 - w)
            term = self.table[flat] * (weight[:, 0] * weight[:, 1] * weight[:, 2])
            value = term if value is None else value + term
        return value


@dataclass(frozen=True)
class Material:
    albedo: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (points, normals) (N, 3) -> (N, 3) colour
    specular: float = 0.0
    shininess: float = 1.0


def _materials(noise: ValueNoise) -> list[Material]:
    """One material per entry of SHAPES, textured at different spatial frequencies."""
    box = SHAPES[2]
    ellipsoid = SHAPES[4]

    def pedestal(p, n):
        top = _mix((0.93, 0.89, 0.8), (0.3, 0.42, 0.55), _soft_checker(p[:, 0] / 0.3, p[:, 1] / 0.3))
        side = torch.tensor([0.45, 0.3, 0.2]).expand_as(p)
        return torch.where((n[:, 2] > 0.5).unsqueeze(-1), top, side)

    def sphere(p, n):
        return torch.tensor([0.78, 0.1, 0.08]).expand_as(p)

    def striped_box(p, n):
        q = box.to_local(p, True)
        return _mix((0.96, 0.78, 0.2), (0.15, 0.3, 0.72), 0.5 + 0.5 * torch.sin(2 * math.pi * (q.sum(-1) / 0.2)))

    def noisy_cylinder(p, n):
        value = 0.65 * noise(p / 0.3) + 0.35 * noise(p / 0.12 + 11.0)
        return _mix((0.1, 0.35, 0.12), (0.75, 0.9, 0.45), _smoothstep(0.25, 0.75, value))

    def banded_ellipsoid(p, n):
        q = (p - torch.tensor(ellipsoid.center)) / torch.tensor(ellipsoid.radii)
        longitude = torch.atan2(q[:, 1], q[:, 0]) / (2 * math.pi) * 8  # 8 sectors around
        latitude = torch.asin(q[:, 2].clamp(-1, 1)) / math.pi * 4 + 0.5  # 4 bands pole to pole
        pattern = (_soft_checker(longitude, latitude) - 0.5) * _smoothstep(0.9, 0.6, q[:, 2].abs()) + 0.5
        return _mix((0.98, 0.95, 0.98), (0.7, 0.15, 0.6), pattern)  # plain near the poles, where sectors meet

    return [
        Material(pedestal),
        Material(sphere, specular=0.8, shininess=40.0),
        Material(striped_box, specular=0.1, shininess=8.0),
        Material(noisy_cylinder),
        Material(banded_ellipsoid, specular=0.3, shininess=20.0),
    ]


# ---- rendering -------------------------------------------------------------------------------------------------


def background_colour(origins: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """The unbounded variant's room seen by (N, 3) rays from inside it (unit directions) -> (N, 3) colour: an unlit
    sphere of radius BACKGROUND_RADIUS around the origin, a soft latitude/longitude checker (12 sectors, 6 bands)
    in sky colours above the horizon and earth colours below, so it shows parallax and is learnable at low res."""
    b = dot(origins, directions)
    t = -b + torch.sqrt(b * b - (dot(origins, origins) - BACKGROUND_RADIUS**2))  # the far root: origins are inside
    v = (origins + t.unsqueeze(-1) * directions) / BACKGROUND_RADIUS
    longitude = torch.atan2(v[:, 1], v[:, 0]) / (2 * math.pi) * 12
    latitude = torch.asin(v[:, 2].clamp(-1, 1)) / math.pi * 6
    checker = _soft_checker(longitude, latitude)
    sky = _mix((0.55, 0.7, 0.92), (0.95, 0.85, 0.6), checker)
    ground = _mix((0.35, 0.25, 0.15), (0.55, 0.6, 0.35), checker)
    return torch.where((v[:, 2] > 0).unsqueeze(-1), sky, ground)


def _shade(
    origins: torch.Tensor, directions: torch.Tensor, materials: list[Material], unbounded: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 3) rays -> colour (N, 3) in [0, 1] (0 where missed) and coverage (N,) in {0, 1}; ``unbounded``: rays
    that miss the solids see the background room (:func:`background_colour`; coverage 1 everywhere)."""
    hit = intersect(origins, directions)
    colour = background_colour(origins, directions) if unbounded else torch.zeros_like(origins)
    light = torch.tensor(LIGHT, dtype=origins.dtype)
    light = light / torch.linalg.vector_norm(light)
    for index, material in enumerate(materials):
        rows = (hit.shape == index).nonzero().squeeze(-1)
        if rows.numel() == 0:
            continue
        d, n = directions[rows], hit.normal[rows]
        p = origins[rows] + d * hit.t[rows].unsqueeze(-1)
        lit = (dot(n, light) > 0) & ~intersect(p + 2e-3 * n, light.expand_as(p)).hit  # facing the light, unshadowed
        diffuse = dot(n, light).clamp_min(0.0) * lit
        half = light - d
        half = half / torch.linalg.vector_norm(half, dim=-1, keepdim=True)
        specular = material.specular * dot(n, half).clamp_min(0.0) ** material.shininess * lit
        shaded = material.albedo(p, n) * (AMBIENT + (1.0 - AMBIENT) * diffuse).unsqueeze(-1) + specular.unsqueeze(-1)
        colour[rows] = shaded.clamp(0.0, 1.0)
    return colour, torch.ones_like(hit.t) if unbounded else hit.hit.to(origins.dtype)


def render_views(
    c2w: np.ndarray,
    resolution: int,
    seed: int,
    intrinsics: np.ndarray | None = None,
    size: tuple[int, int] | None = None,
    lens: Lens | None = None,
    unbounded: bool = False,
) -> np.ndarray:
    """(V, 4, 4) camera-to-world -> (V, R, R, 4) uint8 RGBA (straight alpha), supersampled and area-averaged.
    ``unbounded``: inside a textured room far outside the scene box (:func:`background_colour`), every pixel opaque.

    With ``intrinsics`` (V, 4) fx, fy, cx, cy per view (pixels, data.rays conventions) and ``size`` (H, W), the
    views are (V, H, W, 4) through those pinhole cameras instead of the blender field of view; ``lens`` (coefficients
    (V, 6), data.camera_models) distorts them as a real lens would (a capture with known distortion).
    """
    materials = _materials(ValueNoise(seed))
    height, width = (resolution, resolution) if size is None else size
    focal = 0.5 * resolution * SUPERSAMPLE / math.tan(0.5 * CAMERA_ANGLE_X)
    cameras = torch.from_numpy(np.asarray(c2w, np.float32))
    views = []
    for index, camera in enumerate(cameras):
        # supersampled pixel positions are SUPERSAMPLE x the image's, and so are fx, fy, cx, cy
        k = focal if intrinsics is None else torch.tensor(intrinsics[index], dtype=torch.float64) * SUPERSAMPLE
        # distortion acts on normalised coordinates: the same coefficients at any pixel scale
        view_lens = None if lens is None else lens.take(torch.tensor(index))
        rays = camera_rays(camera, height * SUPERSAMPLE, width * SUPERSAMPLE, k, lens=view_lens)
        origins, directions = (x.reshape(-1, 3) for x in rays)
        chunks = [
            _shade(origins[i : i + RAYS_PER_CHUNK], directions[i : i + RAYS_PER_CHUNK], materials, unbounded)
            for i in range(0, origins.shape[0], RAYS_PER_CHUNK)
        ]
        shape = (height * SUPERSAMPLE, width * SUPERSAMPLE)
        colour = torch.cat([c for c, _ in chunks]).reshape(*shape, 3)
        coverage = torch.cat([a for _, a in chunks]).reshape(*shape, 1)
        premultiplied = torch.cat([colour * coverage, coverage], -1).double().numpy()
        pixel = area_downscale(premultiplied, SUPERSAMPLE)  # average premultiplied colour and coverage
        alpha = pixel[..., 3:]
        straight = np.where(alpha > 0, pixel[..., :3] / np.maximum(alpha, 1e-12), 0.0)
        views.append(round_to_uint8(np.concatenate([straight, alpha], -1) * 255.0))
    return np.stack(views)


def split_cameras(seed: int, n_train: int, n_val: int, n_test: int) -> dict[str, np.ndarray]:
    """Camera-to-world (V, 4, 4) per split: train/val random over the upper hemisphere, test on an orbit."""
    zone = (math.radians(8.0), math.radians(80.0))
    cameras = {
        "train": random_zone_positions(n_train, CAMERA_RADIUS, *zone, np.random.default_rng([seed, 1])),
        "val": random_zone_positions(n_val, CAMERA_RADIUS, *zone, np.random.default_rng([seed, 2])),
        "test": orbit_positions(
            n_test, CAMERA_RADIUS, math.radians(30.0), np.random.default_rng([seed, 3]).uniform(0, 2 * math.pi)
        ),
    }
    return {split: look_at(positions) for split, positions in cameras.items() if len(positions)}


# ---- the cached scene on disk ----------------------------------------------------------------------------------


def _check_count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"ensure_synthetic_scene: {name} must be an int >= {minimum}, got {value!r}")
    return value


def ensure_synthetic_scene(
    cache_dir: str | os.PathLike,
    resolution: int = 96,
    n_train: int = 48,
    n_val: int = 8,
    n_test: int = 16,
    seed: int = 0,
    unbounded: bool = False,
) -> Path:
    """Write the procedural scene in blender format under ``cache_dir`` once and return its folder. ``unbounded``:
    the variant inside a textured room far outside the box (data.synthetic.background_colour), for contraction.

    The folder name carries a hash of the parameters and the generator version, so each parameter set is rendered
    once; it is written to a temporary folder and renamed into place, so a folder that exists is complete.
    """
    params = {
        "version": GENERATOR_VERSION,
        "resolution": _check_count("resolution", resolution, 1),
        "n_train": _check_count("n_train", n_train, 1),
        "n_val": _check_count("n_val", n_val, 1),
        "n_test": _check_count("n_test", n_test, 0),
        "seed": _check_count("seed", seed, 0),
    }
    if unbounded:  # only then a key: the bounded scene keeps its folder name
        params["unbounded"] = True
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    cache_dir = Path(cache_dir)
    variant = "_unbounded" if unbounded else ""
    root = cache_dir / f"procedural{variant}_{resolution}px_seed{seed}_{digest}"
    if root.is_dir():
        return root
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=cache_dir))
    try:
        for split, c2w in split_cameras(seed, n_train, n_val, n_test).items():
            views = render_views(c2w, resolution, seed, unbounded=unbounded)
            write_blender_split(staging, split, views, c2w, CAMERA_ANGLE_X)
        (staging / "procedural_scene.json").write_text(json.dumps(params, indent=4) + "\n", encoding="utf-8")
        os.chmod(staging, 0o755)  # mkdtemp makes it private
        try:
            os.rename(staging, root)
        except OSError:
            if not root.is_dir():  # not a concurrent writer that got there first
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return root
