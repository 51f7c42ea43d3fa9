"""The labelled comparison image (ground truth | prediction | error on a fixed scale, with a colour bar) and the
depth map with a legend: where each part sits, that its pixels are the inputs' and the scale's, and bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training import visualize
from training.visualize import (
    _BAR_WIDTH,
    _TURBO_COEFFS,
    DEFAULT_ERROR_VMAX,
    colorize_depth,
    comparison_image,
    comparison_layout,
    depth_with_legend,
    error_map,
    to_uint8,
    turbo,
)

H, W = 41, 30  # 41 rows: bar row r shows error vmax * (1 - r / 40), exact for even r


def images(seed: int = 0, height: int = H, width: int = W) -> tuple[np.ndarray, np.ndarray]:
    generator = np.random.default_rng(seed)
    return generator.random((height, width, 3)), generator.random((height, width, 3))


def panel(image: np.ndarray, layout, index: int) -> np.ndarray:
    """Panel ``index`` (0 gt, 1 pred, 2 error) of a comparison image, (H, W, 3)."""
    row, col = layout.panels[index]
    return image[row : row + H, col : col + W]


def bar(image: np.ndarray, layout) -> np.ndarray:
    """The colour bar's colours, (H, _BAR_WIDTH, 3), top row the high end."""
    row, col = layout.bar
    return image[row : row + H, col : col + _BAR_WIDTH]


def test_shape_dtype_and_layout_fit_in_the_image():
    gt, pred = images()
    image = comparison_image(gt, pred)
    layout = comparison_layout(H, W)
    assert image.dtype == np.uint8 and image.shape == (*layout.shape, 3)
    assert image.shape[0] > H and image.shape[1] > 3 * W
    for (row, col), (start, stop) in zip(layout.panels, layout.columns):
        assert row >= layout.title_height and start <= col and col + W <= stop
        assert row + H <= image.shape[0]
    row, col = layout.bar
    assert col >= layout.columns[2][1] and col + _BAR_WIDTH < image.shape[1] and row + H <= image.shape[0]
    assert [stop for _, stop in layout.columns] == sorted(stop for _, stop in layout.columns)


@pytest.mark.parametrize("kind", ["uint8", "float32", "tensor"])
def test_the_panels_are_gt_pred_and_the_error_map_exactly(kind):
    gt, pred = images(1)
    expected_gt, expected_pred = to_uint8(gt), to_uint8(pred)
    if kind == "uint8":
        gt, pred = expected_gt, expected_pred
    elif kind == "float32":
        gt, pred = gt.astype(np.float32), pred.astype(np.float32)
    else:
        gt, pred = torch.from_numpy(gt), torch.from_numpy(pred)
    image, layout = comparison_image(gt, pred), comparison_layout(H, W)
    np.testing.assert_array_equal(panel(image, layout, 0), expected_gt)
    np.testing.assert_array_equal(panel(image, layout, 1), expected_pred)
    np.testing.assert_array_equal(panel(image, layout, 2), error_map(gt, pred))


def test_identical_images_give_the_bars_zero_colour_everywhere():
    gt, _ = images(2)
    image, layout = comparison_image(gt, gt.copy()), comparison_layout(H, W)
    zero = bar(image, layout)[-1]  # the bottom row, every column the same colour
    assert (zero == zero[0]).all()
    np.testing.assert_array_equal(zero[0], to_uint8(turbo(np.zeros(1)))[0])
    assert (panel(image, layout, 2) == zero[0]).all()
    top = bar(image, layout)[0, 0]
    np.testing.assert_array_equal(top, to_uint8(turbo(np.ones(1)))[0])  # the high end is the bar's top
    assert not (panel(image, layout, 2) == top).all(axis=-1).any()


@pytest.mark.parametrize("vmax", [None, 0.5, 0.1])
def test_a_known_error_has_the_colour_at_its_height_on_the_bar(vmax):
    scale = DEFAULT_ERROR_VMAX if vmax is None else vmax
    gt = np.full((H, W, 3), 0.25)
    pred = gt.copy()
    rows = [0, 8, 10, 20, 30, 40]  # bar row r shows error scale * (1 - r / (H - 1))
    for i, r in enumerate(rows):
        pred[:, i] += scale * (1 - r / (H - 1))  # the whole column i has that error in every channel
    rows.append(20)  # and the error is the channel mean: three times the error in one channel only
    pred[:, len(rows) - 1, 0] += 3 * scale * 0.5
    image, layout = comparison_image(gt, pred, vmax), comparison_layout(H, W, vmax)
    colours = bar(image, layout)[:, 0]
    errors = panel(image, layout, 2)
    for i, r in enumerate(rows):
        assert (errors[:, i] == errors[0, i]).all()
        np.testing.assert_allclose(errors[0, i].astype(int), colours[r].astype(int), atol=1)
    assert len({tuple(errors[0, i]) for i in range(len(rows))}) == len(set(rows))  # distinct heights, colours


def test_the_scale_is_fixed_not_the_images_maximum():
    gt = np.full((H, W, 3), 0.5)
    small = gt.copy()
    small[..., :] += 0.05  # error 0.05 everywhere
    large = small.copy()
    large[0, 0] = 0.0  # one pixel of error 0.5, twice the default scale: clipped, and no effect elsewhere
    a, b = comparison_image(gt, small), comparison_image(gt, large)
    layout = comparison_layout(H, W)
    np.testing.assert_array_equal(panel(a, layout, 2)[5:, 5:], panel(b, layout, 2)[5:, 5:])
    np.testing.assert_array_equal(panel(a, layout, 2)[5, 5], to_uint8(turbo(np.array([0.05 / DEFAULT_ERROR_VMAX])))[0])
    np.testing.assert_array_equal(panel(b, layout, 2)[0, 0], bar(b, layout)[0, 0])  # above the scale: the top
    assert not (panel(a, layout, 2) == bar(a, layout)[0, 0]).all(axis=-1).any()  # 0.05 is not the top colour
    np.testing.assert_array_equal(error_map(gt, small), error_map(gt, small, DEFAULT_ERROR_VMAX))
    # different image sizes: the same error, the same colour
    c = comparison_image(gt[:20, :10], small[:20, :10])
    row, col = comparison_layout(20, 10).panels[2]
    np.testing.assert_array_equal(c[row + 3, col + 3], panel(a, layout, 2)[5, 5])


def test_each_panel_has_a_title_and_the_bar_has_tick_labels():
    gt, pred = images(3)
    image, layout = comparison_image(gt, pred), comparison_layout(H, W)
    assert [t.split()[0] for t in layout.titles] == ["ground", "prediction", "error"]
    assert layout.titles[2].endswith(f"(0 .. {DEFAULT_ERROR_VMAX:.4g})")
    for start, stop in layout.columns:
        strip = image[: layout.title_height, start:stop].astype(int)
        dark = (strip < 100).all(axis=-1)
        assert dark.sum() > 20, "no text in the title strip"
        assert (strip[0] == 255).all() and (strip[-1] == 255).all()  # text inside the strip, white around it
    labels = dict(layout.ticks)
    assert labels[0] == "0.25" and labels[H - 1] == "0"
    row, col = layout.bar
    right = image[row - 4 : row + H + 4, col + _BAR_WIDTH :].astype(int)
    assert (right < 100).all(axis=-1).sum() > 20, "no tick labels beside the bar"
    assert comparison_layout(H, W, 0.5).titles[2].endswith("(0 .. 0.5)")


def test_small_images_still_get_whole_titles():
    gt, pred = images(4, 8, 8)
    image = comparison_image(gt, pred)
    layout = comparison_layout(8, 8)
    assert image.shape == (*layout.shape, 3)
    for start, stop in layout.columns:
        assert stop - start > 8  # widened to its title
        strip = image[: layout.title_height, start:stop].astype(int)
        assert (strip[:, 0] == 255).all() and (strip[:, -1] == 255).all()  # not cut at the column's edges


def test_bad_inputs_raise_value_errors_naming_the_argument():
    gt, pred = images(5)
    with pytest.raises(ValueError, match="gt and pred must have the same shape"):
        comparison_image(gt, pred[:-1])
    with pytest.raises(ValueError, match="pred must have shape"):
        comparison_image(gt, pred[..., :2])
    with pytest.raises(ValueError, match="gt must have shape"):
        comparison_image(gt[..., 0], pred)
    with pytest.raises(ValueError, match="pred contains NaN"):
        comparison_image(gt, np.full_like(pred, np.nan))
    for vmax in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="vmax"):
            comparison_image(gt, pred, vmax)
    with pytest.raises(ValueError, match="near < far"):
        depth_with_legend(np.ones((4, 4)), 2.0, 2.0)
    with pytest.raises(ValueError, match="depth must have shape"):
        depth_with_legend(np.ones((4, 4, 2)), 1.0, 2.0)


def test_depth_with_legend_shows_the_depth_and_a_near_to_far_bar():
    height, width, near, far = 50, 40, 2.0, 6.0
    depth = np.linspace(near, far, width)[None].repeat(height, 0)
    depth[:5, :5] = np.nan
    image = depth_with_legend(depth[..., None], near, far)
    colours = colorize_depth(depth, near, far)
    assert colours.shape == (height, width, 3)  # the old call is unchanged
    assert image.dtype == np.uint8 and image.shape[0] > height and image.shape[1] > width + _BAR_WIDTH
    found = np.argwhere((image[: image.shape[0] - height + 1, : image.shape[1] - width + 1] == colours[0, 0]).all(-1))
    row, col = next((r, c) for r, c in found if (image[r : r + height, c : c + width] == colours).all())  # the panel
    assert (image[row : row + 5, col : col + 5] == 0).all()  # NaN depth: black
    bar_col = col + width + 1 + np.argmax((image[row + height // 2, col + width + 1 :] != 255).any(-1))
    bar_colours = image[row : row + height, bar_col]
    np.testing.assert_array_equal(bar_colours[0], colorize_depth(np.array([[far]]), near, far)[0, 0])
    np.testing.assert_array_equal(bar_colours[-1], colorize_depth(np.array([[near]]), near, far)[0, 0])
    text = image[: row - 1].astype(int)
    assert (text < 100).all(-1).sum() > 20  # the title
    labels = image[row - 4 : row + height + 4, bar_col + _BAR_WIDTH :].astype(int)
    assert (labels < 100).all(-1).sum() > 20  # the near .. far tick labels


def test_turbo_is_the_polynomial():
    # Horner's rule per channel against the (..., 6) powers times the coefficients, on random values and the ends
    values = np.concatenate([np.random.default_rng(3).random(1000), [0.0, 1.0, -0.5, 1.5]])
    t = np.clip(values, 0.0, 1.0)[:, None]
    want = np.clip((t ** np.arange(6)) @ _TURBO_COEFFS, 0.0, 1.0)
    np.testing.assert_allclose(turbo(values), want, rtol=0, atol=1e-12)
    assert turbo(values[:1000].reshape(10, 100)).shape == (10, 100, 3)


def turntable_frames(count: int = 5) -> list[np.ndarray]:
    """Smooth frames (a colour ramp and a moving disc), each different, as a render's are."""
    y, x = np.mgrid[0:48, 0:64]
    frames = []
    for i in range(count):
        frame = np.stack([x * 4, y * 5, np.full_like(x, 60 + 30 * i)], -1).astype(np.float64)
        frame[(x - 10 - 8 * i) ** 2 + (y - 24) ** 2 < 80] = (250, 250, 250)
        frames.append(frame.astype(np.uint8))
    return frames


@pytest.mark.parametrize("suffix", [".gif", ".mp4"])
def test_a_turntable_without_ffmpeg_is_a_gif_of_every_frame(tmp_path, monkeypatch, suffix):
    import imageio.v3 as iio

    monkeypatch.setattr(visualize, "ffmpeg_available", lambda: False)
    frames = turntable_frames()
    path = visualize.write_turntable(frames, tmp_path / f"turntable{suffix}", fps=10.0)
    assert path == tmp_path / "turntable.gif" and not (tmp_path / f"turntable{suffix}").with_suffix(".mp4").exists()
    back = iio.imread(path, index=None)[..., :3]
    assert back.shape == (len(frames), 48, 64, 3)
    for written, read in zip(frames, back):  # 256 colours a frame: close to the frame, not a copy of another
        error = np.abs(read.astype(np.int64) - written.astype(np.int64))
        assert error.mean() < 4 and error.max() < 48
