"""Camera rays (data.cameras / data.rays): known directions through a known camera, low-resolution rays through the
centres of pixel blocks, and bilinear upsampling of low-resolution ray features aligned with the pixels."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_data import some_camera

from data import (
    camera_rays,
    pixel_rays,
    project_to_pixels,
)


def test_known_camera_ray_directions():
    origins, directions = camera_rays(torch.eye(4, dtype=torch.float64), 5, 7, 10.0)
    assert origins.shape == directions.shape == (5, 7, 3) and (origins == 0).all()
    expected = {
        (2, 3): (0.0, 0.0, -1.0),
        (0, 0): (-0.3, 0.2, -1.0),
        (4, 6): (0.3, -0.2, -1.0),
        (0, 6): (0.3, 0.2, -1.0),
    }
    for (row, col), d in expected.items():
        d = torch.tensor(d, dtype=torch.float64)
        assert torch.allclose(directions[row, col], d / d.norm(), atol=1e-12)
    assert torch.allclose(directions.norm(dim=-1), torch.ones(5, 7, dtype=torch.float64))

    c2w = torch.stack([some_camera(), some_camera((-2.0, 1.0, 3.0))])
    o, d = camera_rays(c2w, 5, 7, 10.0)
    assert o.shape == d.shape == (2, 5, 7, 3)
    assert torch.allclose(d, torch.einsum("vij,hwj->vhwi", c2w[:, :3, :3], directions), atol=1e-12)
    assert torch.equal(o, c2w[:, None, None, :3, 3].expand_as(o))
    assert torch.allclose(d[:, 2, 3], -c2w[:, :3, 2], atol=1e-12)  # the centre ray looks at the origin


def test_low_resolution_rays_pass_through_block_centres():
    c2w = some_camera()
    for scale, (height, width) in [(2, (6, 8)), (3, (9, 6)), (4, (8, 12))]:
        _, directions = camera_rays(c2w, height, width, 7.0, scale=scale)
        assert directions.shape == (height // scale, width // scale, 3)
        uv = project_to_pixels(c2w, directions, 7.0, width, height)
        rows, cols = torch.meshgrid(torch.arange(height // scale), torch.arange(width // scale), indexing="ij")
        assert torch.allclose(uv[..., 0], scale * (cols + 0.5).double(), atol=1e-9)
        assert torch.allclose(uv[..., 1], scale * (rows + 0.5).double(), atol=1e-9)
    _, full = camera_rays(c2w, 9, 6, 7.0)
    _, low = camera_rays(c2w, 9, 6, 7.0, scale=3)
    assert torch.allclose(low, full[1::3, 1::3], atol=1e-12)  # odd scale: block centres are pixel centres
    with pytest.raises(ValueError, match="scale 2"):
        camera_rays(c2w, 7, 8, 7.0, scale=2)


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_bilinear_upsampling_aligns_low_resolution_rays_with_pixels(scale):
    """Low-res ray (i, j) sits at position s*(j+0.5): where F.interpolate(align_corners=False) puts sample j."""
    height, width, focal = 8 * scale, 6 * scale, 30.0 * scale
    c2w = some_camera()
    _, low = camera_rays(c2w, height, width, focal, scale=scale)
    _, full = camera_rays(c2w, height, width, focal)

    def upsample(x):  # (h, w, C) -> (s h, s w, C)
        return F.interpolate(x.permute(2, 0, 1)[None], scale_factor=scale, mode="bilinear", align_corners=False)[
            0
        ].permute(1, 2, 0)

    # a linear function of where each low-res ray passes is reproduced exactly at the pixel centres inside the border
    uv = project_to_pixels(c2w, low, focal, width, height)
    field = lambda u, v: torch.stack([0.7 * u - 1.3 * v + 2.0, 0.25 * v + 0.1], -1)  # noqa: E731
    upsampled = upsample(field(uv[..., 0], uv[..., 1]))
    rows, cols = torch.meshgrid(
        torch.arange(height, dtype=torch.float64), torch.arange(width, dtype=torch.float64), indexing="ij"
    )
    target = field(cols + 0.5, rows + 0.5)
    border = math.ceil((scale - 1) / 2)  # pixels whose centre lies outside the outermost samples: clamped
    inner = (slice(border, height - border), slice(border, width - border))
    assert torch.allclose(upsampled[inner], target[inner], atol=1e-9)
    assert not torch.allclose(upsampled[:border], target[:border], atol=1e-3)  # clamping at the border is real

    # the rays themselves (smooth, nearly linear in the position) upsample to the full-res rays; rays placed at
    # the blocks' top-left corners instead (a half low-res pixel off) would not
    error = (upsample(low) - full)[inner].norm(dim=-1).max()
    rows, cols = torch.meshgrid(torch.arange(height // scale), torch.arange(width // scale), indexing="ij")
    _, corners = pixel_rays(c2w, scale * cols.double(), scale * rows.double(), focal, width, height)
    shifted_error = (upsample(corners) - full)[inner].norm(dim=-1).max()
    assert error < 2e-3 < shifted_error
