"""Lens distortion: OpenCV's radial-tangential model and its equidistant fisheye model, forward and inverse.

Conventions
-----------
Distortion acts on normalised image coordinates in OpenCV's camera frame (x right, y down, z forward), as
COLMAP, instant-ngp and nerfstudio write the coefficients: a pixel (u, v) of a camera (fx, fy, cx, cy) has the
distorted coordinates ``xd = (u - cx) / fx``, ``yd = (v - cy) / fy``. Our rays use OpenGL camera axes
(data/rays.py), so an OpenCV direction (X, Y, Z) is the OpenGL direction (X, -Y, -Z).

Coefficients are six numbers ``k1 k2 k3 k4 p1 p2`` (nerfstudio's layout):

- radial-tangential (``OPENCV``; SIMPLE_RADIAL and RADIAL are its special cases): the undistorted point (x, y) =
  (X/Z, Y/Z), r = x^2 + y^2, d = 1 + k1 r + k2 r^2 + k3 r^3 + k4 r^4 (k3, k4 as nerfstudio reads them; OpenCV's
  own 5-coefficient model has k3 only), ``xd = x d + 2 p1 x y + p2 (r + 2 x^2)``,
  ``yd = y d + p1 (r + 2 y^2) + 2 p2 x y``.
- fisheye (``OPENCV_FISHEYE``, equidistant): theta = the angle between the ray and the optical axis,
  ``theta_d = theta (1 + k1 theta^2 + k2 theta^4 + k3 theta^6 + k4 theta^8)``, (xd, yd) = theta_d times the unit
  vector (X, Y) / |(X, Y)|. p1, p2 must be zero (the model has no tangential terms).

Inverting (a pixel -> its ray) has no closed form: Newton's method, from the distorted point, for a fixed number
of iterations (``ITERATIONS``: no data-dependent stopping, so a batch of rays costs the same elementwise kernels
every step and never waits on the device). :func:`check_invertible` verifies once per camera, in float64, that
those iterations converge everywhere on the image and that the distortion does not fold over there; the rays
are then exact to the working precision.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

COEFFICIENTS = ("k1", "k2", "k3", "k4", "p1", "p2")
ITERATIONS = 10  # Newton steps: quadratic convergence from the distorted point; checked per camera at load time
MAX_FISHEYE_ANGLE = 3.1  # radians from the optical axis (just under pi): a fisheye ray must point somewhere


@dataclass(frozen=True)
class Lens:
    """The distortion of one or more cameras: ``coefficients`` (..., 6) k1 k2 k3 k4 p1 p2 (float), ``fisheye``
    False for radial-tangential, True for the equidistant fisheye. Broadcasts with pixel positions like the
    intrinsics (data.rays)."""

    coefficients: torch.Tensor
    fisheye: bool = False

    def __post_init__(self) -> None:
        c = self.coefficients
        if not isinstance(c, torch.Tensor) or not c.is_floating_point() or c.shape[-1:] != (6,):
            shape = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
            raise ValueError(
                f"Lens.coefficients must be a float tensor of shape (..., 6) ({COEFFICIENTS}), got {shape}"
            )
        if not isinstance(self.fisheye, bool):
            raise ValueError(f"Lens.fisheye must be a bool, got {self.fisheye!r}")

    def to(self, device=None, dtype: torch.dtype | None = None) -> Lens:
        return dataclasses.replace(self, coefficients=self.coefficients.to(device=device, dtype=dtype))

    def take(self, views: torch.Tensor, extra_dims: int = 0) -> Lens:
        """The lenses of ``views`` (an index tensor into the first dimension), with ``extra_dims`` singleton
        dimensions before the coefficients (to broadcast with a grid of pixels)."""
        picked = self.coefficients[views]
        return dataclasses.replace(self, coefficients=picked.reshape(picked.shape[:-1] + (1,) * extra_dims + (6,)))

    def unproject(self, xd: torch.Tensor, yd: torch.Tensor) -> torch.Tensor:
        """Distorted normalised coordinates (*S) -> (*S, 3) OpenCV camera-space directions (not unit length for
        radial-tangential: (x, y, 1); unit length for the fisheye)."""
        if self.fisheye:
            return fisheye_unproject(xd, yd, self.coefficients)
        x, y = undistort(xd, yd, self.coefficients)
        return torch.stack([x, y, torch.ones_like(x)], -1)

    def project(self, directions: torch.Tensor) -> torch.Tensor:
        """(*S, 3) OpenCV camera-space directions (in front of the camera for radial-tangential) -> (*S, 2)
        distorted normalised coordinates (xd, yd)."""
        if self.fisheye:
            return fisheye_project(directions, self.coefficients)
        z = directions[..., 2]
        xd, yd = distort(directions[..., 0] / z, directions[..., 1] / z, self.coefficients)
        return torch.stack([xd, yd], -1)


def _split(coefficients: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(coefficients[..., i] for i in range(6))


def distort(x: torch.Tensor, y: torch.Tensor, coefficients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Radial-tangential distortion of undistorted normalised coordinates (*S) -> (xd, yd), each (*S)."""
    k1, k2, k3, k4, p1, p2 = _split(coefficients)
    r = x * x + y * y
    d = 1.0 + r * (k1 + r * (k2 + r * (k3 + r * k4)))
    xy = x * y
    return x * d + 2.0 * p1 * xy + p2 * (r + 2.0 * x * x), y * d + p1 * (r + 2.0 * y * y) + 2.0 * p2 * xy


def distortion_jacobian(x: torch.Tensor, y: torch.Tensor, coefficients: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """d(xd, yd) / d(x, y) of :func:`distort` at (x, y): the four entries (dxd/dx, dxd/dy, dyd/dx, dyd/dy)."""
    k1, k2, k3, k4, p1, p2 = _split(coefficients)
    r = x * x + y * y
    d = 1.0 + r * (k1 + r * (k2 + r * (k3 + r * k4)))
    d_r = k1 + r * (2.0 * k2 + r * (3.0 * k3 + r * 4.0 * k4))  # dd/dr
    cross = 2.0 * x * y * d_r + 2.0 * p1 * x + 2.0 * p2 * y  # both off-diagonal entries
    return (
        d + 2.0 * x * x * d_r + 2.0 * p1 * y + 6.0 * p2 * x,
        cross,
        cross,
        d + 2.0 * y * y * d_r + 6.0 * p1 * y + 2.0 * p2 * x,
    )


def undistort(
    xd: torch.Tensor, yd: torch.Tensor, coefficients: torch.Tensor, iterations: int = ITERATIONS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`distort`: (xd, yd) (*S) -> (x, y) (*S) by ``iterations`` Newton steps from (xd, yd).

    With all coefficients zero the result is (xd, yd) bit for bit (every residual is exactly zero)."""
    x, y = xd, yd
    for _ in range(iterations):
        fx, fy = distort(x, y, coefficients)
        fx, fy = fx - xd, fy - yd
        a, b, c, d = distortion_jacobian(x, y, coefficients)
        det = a * d - b * c
        # a singular Jacobian (only outside a checked image) takes no step instead of dividing by zero
        safe = torch.where(det.abs() > 1e-12, det, torch.ones_like(det))
        x = x - torch.where(det.abs() > 1e-12, (d * fx - b * fy) / safe, torch.zeros_like(det))
        y = y - torch.where(det.abs() > 1e-12, (a * fy - c * fx) / safe, torch.zeros_like(det))
    return x, y


def fisheye_radius(theta: torch.Tensor, coefficients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """theta_d(theta) of the equidistant fisheye and its derivative, each shaped like ``theta``."""
    k1, k2, k3, k4, _, _ = _split(coefficients)
    t2 = theta * theta
    radial = 1.0 + t2 * (k1 + t2 * (k2 + t2 * (k3 + t2 * k4)))
    slope = 1.0 + t2 * (3.0 * k1 + t2 * (5.0 * k2 + t2 * (7.0 * k3 + t2 * 9.0 * k4)))
    return theta * radial, slope


def fisheye_angle(rho: torch.Tensor, coefficients: torch.Tensor, iterations: int = ITERATIONS) -> torch.Tensor:
    """The angle theta whose distorted radius is ``rho`` (*S) (Newton from theta = rho), clamped to
    [0, MAX_FISHEYE_ANGLE]."""
    theta = rho
    for _ in range(iterations):
        value, slope = fisheye_radius(theta, coefficients)
        safe = torch.where(slope.abs() > 1e-12, slope, torch.ones_like(slope))
        theta = (theta - torch.where(slope.abs() > 1e-12, (value - rho) / safe, torch.zeros_like(slope))).clamp(
            0.0, MAX_FISHEYE_ANGLE
        )
    return theta


def fisheye_unproject(
    xd: torch.Tensor, yd: torch.Tensor, coefficients: torch.Tensor, iterations: int = ITERATIONS
) -> torch.Tensor:
    """Distorted fisheye coordinates (*S) -> (*S, 3) unit OpenCV directions (sin t * (xd, yd) / rho, cos t)."""
    rho = torch.sqrt(xd * xd + yd * yd)
    theta = fisheye_angle(rho, coefficients, iterations)
    # sin(theta) / rho -> 1 at the centre (theta ~ rho): the optical axis stays (0, 0, 1)
    ratio = torch.where(rho > 1e-12, torch.sin(theta) / rho.clamp_min(1e-12), torch.ones_like(rho))
    return torch.stack([xd * ratio, yd * ratio, torch.cos(theta)], -1)


def fisheye_project(directions: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """(*S, 3) OpenCV directions -> (*S, 2) distorted fisheye coordinates."""
    x, y, z = directions[..., 0], directions[..., 1], directions[..., 2]
    radius = torch.sqrt(x * x + y * y)
    theta_d, _ = fisheye_radius(torch.atan2(radius, z), coefficients)
    ratio = torch.where(radius > 0, theta_d / radius.clamp_min(1e-300), torch.ones_like(radius))
    return torch.stack([x * ratio, y * ratio], -1)


def _image_grid(intrinsics: torch.Tensor, size: tuple[int, int], count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, count) distorted normalised coordinates over the whole image, its outer edges and corners included."""
    fx, fy, cx, cy = intrinsics.tolist()
    height, width = size
    u = torch.linspace(0.0, float(width), count, dtype=torch.float64)
    v = torch.linspace(0.0, float(height), count, dtype=torch.float64)
    vv, uu = torch.meshgrid(v, u, indexing="ij")
    return (uu - cx) / fx, (vv - cy) / fy


def check_invertible(
    coefficients, fisheye: bool, intrinsics, size: tuple[int, int], count: int = 65, tolerance: float = 1e-9
) -> None:
    """ValueError (one line, saying what fails) unless the lens' rays are well defined over the image.

    coefficients: 6 numbers k1 k2 k3 k4 p1 p2; intrinsics: fx, fy, cx, cy; size: (height, width) in pixels.
    Checked in float64 on a count x count grid over the image (edges and corners included): every position's
    ITERATIONS Newton steps land within ``tolerance`` of a true inverse (re-distorted), and the distortion is
    one-to-one between the optical axis and the image's edge (its Jacobian, or for the fisheye theta_d's slope,
    stays positive there), so the inverse found is the one that images the pixel."""
    coefficients = torch.as_tensor(coefficients, dtype=torch.float64).reshape(6)
    if not bool(torch.isfinite(coefficients).all()):
        raise ValueError(f"distortion coefficients must be finite, got {coefficients.tolist()}")
    if fisheye and bool((coefficients[4:] != 0).any()):
        raise ValueError(
            f"the fisheye model has no tangential terms: p1, p2 must be 0, got {coefficients[4:].tolist()}"
        )
    xd, yd = _image_grid(torch.as_tensor(intrinsics, dtype=torch.float64).reshape(4), size, count)
    lens = Lens(coefficients, fisheye)
    directions = lens.unproject(xd, yd)
    back = lens.project(directions)
    error = torch.maximum((back[..., 0] - xd).abs(), (back[..., 1] - yd).abs())
    worst = int(error.argmax())
    if not bool(torch.isfinite(error).all()) or float(error.max()) > tolerance:
        row, col = divmod(worst, count)
        raise ValueError(
            f"the distortion cannot be inverted over the image: {ITERATIONS} Newton steps leave an error of "
            f"{float(error.reshape(-1)[worst]):.3g} at pixel ({col * size[1] / (count - 1):.0f}, "
            f"{row * size[0] / (count - 1):.0f}) (coefficients too strong for the image, or wrong)"
        )
    # one-to-one: along each ray from the axis to an image position the map must keep increasing
    steps = torch.linspace(0.0, 1.0, 33, dtype=torch.float64)[:, None, None]
    if fisheye:
        theta = torch.atan2(torch.linalg.vector_norm(directions[..., :2], dim=-1), directions[..., 2])
        if float(theta.max()) >= MAX_FISHEYE_ANGLE:
            raise ValueError(f"the fisheye's rays reach {float(theta.max()):.3g} rad from the axis (at most 3.1)")
        _, slope = fisheye_radius(steps * theta, coefficients)
        folded = float(slope.min()) <= 0
    else:
        a, b, c, d = distortion_jacobian(steps * directions[..., 0], steps * directions[..., 1], coefficients)
        folded = float((a * d - b * c).min()) <= 0 or float(torch.minimum(a, d).min()) <= 0
    if folded:
        raise ValueError(
            "the distortion folds over within the image (its derivative changes sign between the optical axis "
            "and the edge): the coefficients do not describe a real lens there"
        )


__all__ = [
    "COEFFICIENTS",
    "ITERATIONS",
    "Lens",
    "check_invertible",
    "distort",
    "distortion_jacobian",
    "fisheye_project",
    "fisheye_unproject",
    "undistort",
]
