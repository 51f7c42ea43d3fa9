"""Camera placement: look-at poses and positions on a sphere around the origin (numpy float64)."""

from __future__ import annotations

import numpy as np


def look_at(positions: np.ndarray, target=(0.0, 0.0, 0.0), up=(0.0, 0.0, 1.0)) -> np.ndarray:
    """(V, 3) camera positions -> (V, 4, 4) camera-to-world, OpenGL convention (looking down -z, y up).

    Columns are right, up, backward and position; ``up`` is the world's up (never parallel to a view direction).
    """
    positions = np.asarray(positions, np.float64)
    backward = positions - np.asarray(target, np.float64)
    backward /= np.linalg.norm(backward, axis=-1, keepdims=True)
    right = np.cross(np.asarray(up, np.float64), backward)
    right /= np.linalg.norm(right, axis=-1, keepdims=True)
    camera_up = np.cross(backward, right)
    c2w = np.zeros(positions.shape[:-1] + (4, 4))
    c2w[..., :3, 0], c2w[..., :3, 1], c2w[..., :3, 2], c2w[..., :3, 3] = right, camera_up, backward, positions
    c2w[..., 3, 3] = 1.0
    return c2w


def spherical_positions(radius: float, elevations: np.ndarray, azimuths: np.ndarray) -> np.ndarray:
    """Elevation above the xy plane and azimuth from +x (radians), each (V,) -> (V, 3) positions (z up)."""
    return radius * np.stack(
        [np.cos(elevations) * np.cos(azimuths), np.cos(elevations) * np.sin(azimuths), np.sin(elevations)], -1
    )


def random_zone_positions(
    count: int, radius: float, min_elevation: float, max_elevation: float, rng: np.random.Generator
) -> np.ndarray:
    """``count`` positions uniform (by area) on the sphere zone between two elevations (radians) -> (V, 3)."""
    heights = rng.uniform(np.sin(min_elevation), np.sin(max_elevation), count)
    azimuths = rng.uniform(0.0, 2.0 * np.pi, count)
    return spherical_positions(radius, np.arcsin(heights), azimuths)


def orbit_positions(count: int, radius: float, elevation: float, phase: float = 0.0) -> np.ndarray:
    """``count`` positions evenly spaced on a circle at one elevation (radians) -> (V, 3)."""
    azimuths = phase + 2.0 * np.pi * np.arange(count) / max(count, 1)
    return spherical_positions(radius, np.full(count, elevation), azimuths)
