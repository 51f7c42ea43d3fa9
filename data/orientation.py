"""Orienting, centring and scaling a capture's world, as nerfstudio does (``auto_orient_and_center_poses`` with
method "up", then ``auto_scale_poses``), so that orbits, turntables and the viewer (all z up) are upright.

``up``: the world's up axis is the mean of the cameras' up vectors (a hand-held capture is mostly level, so its
cameras' y axes average to the gravity's opposite); a rotation takes it to +z (the smallest such rotation). The
world is then centred on the cameras' focus point (the point nearest every optical axis, data.bounds.focus_point:
the object of an object-centred capture) or, when the axes do not meet in front of the cameras, on the cameras'
mean position, and scaled so the farthest camera coordinate is 1 (the cameras fit in [-1, 1]^3). ``none`` keeps
the poses as given. A similarity (rotation, translation, uniform scale) keeps every angle and ratio, so the
images and intrinsics stay valid; near, far and the scene box are derived afterwards, in the new frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.bounds import focus_point

ORIENT_METHODS = ("up", "none")


@dataclass(frozen=True)
class Similarity:
    """x -> scale * (rotation @ x + translation): rotation (3, 3), translation (3,), scale > 0 (float64)."""

    rotation: np.ndarray
    translation: np.ndarray
    scale: float

    @staticmethod
    def identity() -> Similarity:
        return Similarity(np.eye(3), np.zeros(3), 1.0)

    def points(self, points: np.ndarray) -> np.ndarray:
        """(..., 3) points -> (..., 3)."""
        return self.scale * (points @ self.rotation.T + self.translation)

    def poses(self, c2w: np.ndarray) -> np.ndarray:
        """(V, 4, 4) camera-to-world -> (V, 4, 4): rotated axes (still orthonormal), moved and scaled positions."""
        out = np.array(c2w, dtype=np.float64, copy=True)
        out[:, :3, :3] = self.rotation @ c2w[:, :3, :3]
        out[:, :3, 3] = self.points(c2w[:, :3, 3])
        return out

    def box(self, box: np.ndarray) -> np.ndarray:
        """(2, 3) min and max corners -> (2, 3) the axis-aligned box around the moved corners."""
        corners = self.points(np.stack(np.meshgrid(*np.asarray(box, np.float64).T, indexing="ij"), -1).reshape(-1, 3))
        return np.stack([corners.min(0), corners.max(0)])


def rotation_between(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(3, 3) the smallest rotation taking the direction of ``a`` to that of ``b`` (Rodrigues' formula; a half
    turn about an axis perpendicular to both when they are opposite)."""
    a, b = a / np.linalg.norm(a), b / np.linalg.norm(b)
    axis, cos = np.cross(a, b), float(np.dot(a, b))
    if cos < -1.0 + 1e-12:  # opposite: any perpendicular axis, half a turn
        perpendicular = np.cross(a, np.eye(3)[int(np.argmin(np.abs(a)))])
        perpendicular /= np.linalg.norm(perpendicular)
        return 2.0 * np.outer(perpendicular, perpendicular) - np.eye(3)
    skew = np.array([[0.0, -axis[2], axis[1]], [axis[2], 0.0, -axis[0]], [-axis[1], axis[0], 0.0]])
    return np.eye(3) + skew + skew @ skew / (1.0 + cos)


def orientation(c2w: np.ndarray, method: str) -> Similarity:
    """The similarity that orients, centres and scales the (V, 4, 4) cameras ``c2w`` by ``method`` (module doc).

    ValueError naming data.orient for an unknown method, or when the cameras' up vectors cancel out."""
    if method not in ORIENT_METHODS:
        raise ValueError(f"data.orient must be one of {', '.join(ORIENT_METHODS)}, got {method!r}")
    if method == "none":
        return Similarity.identity()
    up = c2w[:, :3, 1].mean(0)  # OpenGL cameras: column 1 is the camera's up
    if not np.linalg.norm(up) > 1e-6:
        raise ValueError("data.orient=up: the cameras' up vectors cancel out (set data.orient=none)")
    rotation = rotation_between(up, np.array([0.0, 0.0, 1.0]))
    rotated = Similarity(rotation, np.zeros(3), 1.0).poses(c2w)
    centre = focus_point(rotated)
    if centre is None:
        centre = rotated[:, :3, 3].mean(0)
    extent = float(np.abs(rotated[:, :3, 3] - centre).max())
    return Similarity(rotation, -centre, 1.0 / extent if extent > 1e-12 else 1.0)


__all__ = ["ORIENT_METHODS", "Similarity", "orientation", "rotation_between"]
