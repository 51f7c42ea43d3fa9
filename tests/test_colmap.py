"""COLMAP models (data/colmap.py) and ``data=colmap``: our reader against models written here by hand (binary and
text, COLMAP's documented layout) and against pycolmap's own reader and writer; the conversion to nerfstudio's
transforms (pixels project where pycolmap projects them); a COLMAP folder loads exactly as the transforms.json made
of it; clear errors for broken models."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from data.colmap import (
    CAMERA_MODELS,
    MODEL_IDS,
    camera_to_world,
    find_model,
    read_model,
    rotation_matrix,
    transforms_from_model,
    write_points_ply,
)
from data.errors import SceneError
from data.images import write_png
from data.nerfstudio import load_nerfstudio, read_capture, read_colmap_capture
from data.rays import camera_rays

RNG = np.random.default_rng(7)


def random_rotation(rng) -> np.ndarray:
    """A unit quaternion (w, x, y, z) with w > 0."""
    q = rng.normal(size=4)
    q /= np.linalg.norm(q)
    return q * np.sign(q[0])


def random_model(rng, sizes, models) -> dict:
    """cameras: {id: (model, w, h, params)}, images: {id: (qvec, tvec, camera_id, name)}, points (N, 3), colors."""
    cameras = {}
    for index, ((w, h), model) in enumerate(zip(sizes, models), start=1):
        count = CAMERA_MODELS[MODEL_IDS[model]][1]
        params = rng.uniform(-0.05, 0.05, count)
        focal = rng.uniform(300, 500)
        head = {"SIMPLE_PINHOLE": 1, "SIMPLE_RADIAL": 1, "RADIAL": 1}.get(model, 2)
        params[:head] = focal + rng.uniform(-5, 5, head)
        params[head : head + 2] = (w / 2 + rng.uniform(-3, 3), h / 2 + rng.uniform(-3, 3))
        cameras[index] = (model, w, h, params)
    images = {}
    for index in range(1, 7):
        camera = 1 + (index - 1) % len(cameras)
        images[index * 3] = (random_rotation(rng), rng.normal(size=3), camera, f"img_{index:02d}.png")
    points = rng.normal(size=(25, 3))
    colors = rng.integers(0, 256, (25, 3)).astype(np.uint8)
    return {"cameras": cameras, "images": images, "points": points, "colors": colors}


def write_binary(folder, model, tracks: bool = True) -> None:
    """COLMAP's binary layout; ``tracks``: keypoints and tracks that refer to each other loosely (our reader skips
    them), else none (pycolmap checks that they agree)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "cameras.bin", "wb") as f:
        f.write(struct.pack("<Q", len(model["cameras"])))
        for camera_id, (name, w, h, params) in model["cameras"].items():
            f.write(struct.pack("<iiQQ", camera_id, MODEL_IDS[name], w, h))
            f.write(struct.pack(f"<{len(params)}d", *params))
    with open(folder / "images.bin", "wb") as f:
        f.write(struct.pack("<Q", len(model["images"])))
        for image_id, (q, t, camera_id, name) in model["images"].items():
            f.write(struct.pack("<i7di", image_id, *q, *t, camera_id) + name.encode() + b"\0")
            f.write(
                struct.pack("<Q", 2)
                + struct.pack("<ddq", 1.5, 2.5, -1)
                + struct.pack("<ddq", 3.0, 4.0, 7 if tracks else -1)
            )
    with open(folder / "points3D.bin", "wb") as f:
        f.write(struct.pack("<Q", len(model["points"])))
        for index, (xyz, rgb) in enumerate(zip(model["points"], model["colors"])):
            track = struct.pack("<Q4i", 2, 3, 0, 6, 1) if tracks else struct.pack("<Q", 0)
            f.write(struct.pack("<Q3d3Bd", index + 1, *xyz, *rgb.tolist(), 0.5) + track)


def write_text(folder, model) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["# Camera list with one line of data per camera:"]
    for camera_id, (name, w, h, params) in model["cameras"].items():
        lines.append(" ".join([str(camera_id), name, str(w), str(h), *(repr(float(p)) for p in params)]))
    (folder / "cameras.txt").write_text("\n".join(lines) + "\n")
    lines = ["# Image list with two lines of data per image:"]
    for image_id, (q, t, camera_id, name) in model["images"].items():
        lines.append(" ".join([str(image_id), *(repr(float(v)) for v in (*q, *t)), str(camera_id), name]))
        lines.append("" if image_id % 2 else "1.5 2.5 -1 3.0 4.0 7")  # an image without keypoints has an empty line
    (folder / "images.txt").write_text("\n".join(lines) + "\n")
    lines = ["# 3D point list"]
    for index, (xyz, rgb) in enumerate(zip(model["points"], model["colors"])):
        lines.append(" ".join([str(index + 1), *(repr(float(v)) for v in xyz), *map(str, rgb.tolist()), "0.5 3 0"]))
    (folder / "points3D.txt").write_text("\n".join(lines) + "\n")


def check_same(read, model) -> None:
    assert set(read.cameras) == set(model["cameras"])
    for camera_id, (name, w, h, params) in model["cameras"].items():
        camera = read.cameras[camera_id]
        assert (camera.model, camera.width, camera.height) == (name, w, h)
        np.testing.assert_array_equal(camera.params, params)
    assert set(read.images) == set(model["images"])
    for image_id, (q, t, camera_id, name) in model["images"].items():
        image = read.images[image_id]
        assert (image.camera_id, image.name) == (camera_id, name)
        np.testing.assert_array_equal(image.qvec, q)
        np.testing.assert_array_equal(image.tvec, t)
    np.testing.assert_array_equal(read.points, model["points"])
    np.testing.assert_array_equal(read.colors, model["colors"])


@pytest.mark.parametrize("writer", [write_binary, write_text])
def test_reader_reads_what_was_written(tmp_path, writer):
    model = random_model(RNG, [(64, 48), (48, 64), (80, 60)], ["OPENCV", "PINHOLE", "SIMPLE_RADIAL"])
    writer(tmp_path / "sparse" / "0", model)
    assert find_model(tmp_path) == tmp_path / "sparse" / "0"
    check_same(read_model(tmp_path / "sparse" / "0"), model)


def test_reader_matches_pycolmap(tmp_path):
    """pycolmap writes a model (binary and text); ours reads the same cameras, poses, names and points."""
    pycolmap = pytest.importorskip("pycolmap")
    model = random_model(RNG, [(64, 48), (40, 30)], ["OPENCV", "OPENCV_FISHEYE"])
    write_binary(tmp_path / "ours", model, tracks=False)
    reconstruction = pycolmap.Reconstruction(str(tmp_path / "ours"))  # pycolmap reads what we wrote...
    for kind in ("bin", "txt"):
        folder = tmp_path / kind
        folder.mkdir()
        (reconstruction.write_binary if kind == "bin" else reconstruction.write_text)(str(folder))
        read = read_model(folder)  # ... and we read what pycolmap wrote
        for camera_id, camera in reconstruction.cameras.items():
            ours = read.cameras[camera_id]
            assert (ours.model, ours.width, ours.height) == (camera.model.name, camera.width, camera.height)
            np.testing.assert_allclose(ours.params, camera.params, rtol=1e-12)
        for image_id, image in reconstruction.images.items():
            pose = image.cam_from_world() if callable(image.cam_from_world) else image.cam_from_world
            np.testing.assert_allclose(rotation_matrix(read.images[image_id].qvec), pose.rotation.matrix(), atol=1e-9)
            np.testing.assert_allclose(read.images[image_id].tvec, pose.translation, atol=1e-9)
            assert read.images[image_id].name == image.name
        ids = sorted(reconstruction.points3D)
        np.testing.assert_allclose(read.points, [reconstruction.points3D[i].xyz for i in ids], atol=1e-9)


def test_transforms_project_like_colmap(tmp_path):
    """A world point projects to the same pixel through pycolmap's camera and through the frame our conversion
    makes (OpenGL camera-to-world in nerfstudio's turned world, applied_transform taking COLMAP's world there)."""
    model = random_model(RNG, [(64, 48)], ["PINHOLE"])
    write_binary(tmp_path / "sparse" / "0", model)
    read = read_model(tmp_path / "sparse" / "0")
    meta = transforms_from_model(read)
    applied = np.vstack([np.array(meta["applied_transform"]), [0, 0, 0, 1]])
    fx, fy, cx, cy = (meta[k] for k in ("fl_x", "fl_y", "cx", "cy"))
    for frame, (q, t, _, name) in zip(meta["frames"], sorted(model["images"].values(), key=lambda i: i[3])):
        assert frame["file_path"] == f"images/{name}"
        point = rotation_matrix(q).T @ (np.array([0.1, -0.2, 3.0]) - t)  # camera-space (0.1, -0.2, 3) in COLMAP's world
        c2w = np.array(frame["transform_matrix"])
        local = np.linalg.inv(c2w) @ applied @ np.append(point, 1.0)  # OpenGL camera space: looking down -z, y up
        u, v = cx + fx * local[0] / -local[2], cy - fy * local[1] / -local[2]
        np.testing.assert_allclose([u, v], [cx + fx * 0.1 / 3.0, cy + fy * -0.2 / 3.0], atol=1e-9)
    np.testing.assert_allclose(camera_to_world(read.images[3])[3], [0, 0, 0, 1])


def _colmap_folder(root, sizes, models, rng=RNG) -> dict:
    model = random_model(rng, sizes, models)
    # cameras looking at the origin from ~4 away, so the scene box is well defined
    for image_id, (_, _, camera_id, name) in list(model["images"].items()):
        angle = image_id * 0.4
        centre = np.array([4 * np.cos(angle), 4 * np.sin(angle), 1.0])
        forward = -centre / np.linalg.norm(centre)
        right = np.cross(forward, [0, 0, 1.0])
        right /= np.linalg.norm(right)
        down = np.cross(forward, right)
        rotation = np.stack([right, down, forward])  # world -> camera rows (OpenCV axes)
        w, x, y, z = _quaternion(rotation)
        model["images"][image_id] = (np.array([w, x, y, z]), -rotation @ centre, camera_id, name)
    write_binary(root / "sparse" / "0", model)
    (root / "images").mkdir(parents=True)
    for _, _, camera_id, name in model["images"].values():
        _, w, h, _ = model["cameras"][camera_id]
        write_png(root / "images" / name, rng.integers(0, 256, (h, w, 3)).astype(np.uint8))
    return model


def _quaternion(rotation: np.ndarray) -> tuple[float, float, float, float]:
    w = np.sqrt(max(0.0, 1 + np.trace(rotation))) / 2
    x = (rotation[2, 1] - rotation[1, 2]) / (4 * w)
    y = (rotation[0, 2] - rotation[2, 0]) / (4 * w)
    z = (rotation[1, 0] - rotation[0, 1]) / (4 * w)
    return w, x, y, z


def test_colmap_folder_loads_as_its_transforms(tmp_path):
    """data=colmap on a folder of per-image PINHOLE cameras of mixed orientation gives the same scenes as
    data=nerfstudio on the transforms.json (with the points as sparse_pc.ply) made of it."""
    pytest.importorskip("plyfile")
    model = _colmap_folder(tmp_path, [(64, 48), (48, 64)], ["PINHOLE", "PINHOLE"])
    train, evaluation, bounds = load_nerfstudio(tmp_path, colmap=True, eval_interval=3)
    meta = transforms_from_model(read_model(tmp_path / "sparse" / "0"))
    applied = np.array(meta["applied_transform"])  # sparse_pc.ply holds the points in the poses' world
    write_points_ply(tmp_path / "sparse_pc.ply", model["points"] @ applied[:, :3].T + applied[:, 3], model["colors"])
    (tmp_path / "transforms.json").write_text(json.dumps(meta))
    train2, evaluation2, bounds2 = load_nerfstudio(tmp_path, eval_interval=3)
    np.testing.assert_allclose(bounds.box, bounds2.box, rtol=1e-6)  # the PLY holds float32
    for a, b in ((train, train2), (evaluation, evaluation2)):
        assert a.names == b.names
        torch.testing.assert_close(a.c2w, b.c2w)
        torch.testing.assert_close(a.intrinsics, b.intrinsics)
        torch.testing.assert_close(a.images, b.images)
        assert a.sizes is not None and a.sizes.tolist() == b.sizes.tolist()
    assert sorted(map(tuple, train.sizes.tolist())) == [(48, 64)] * 2 + [(64, 48)] * 2  # portrait and landscape
    assert read_colmap_capture(tmp_path).points.shape == (25, 3)
    assert read_capture(tmp_path).ply is not None and "25 sparse points" in bounds.source


def test_points_ply_reads_back(tmp_path):
    plyfile = pytest.importorskip("plyfile")
    points, colors = RNG.normal(size=(40, 3)), RNG.integers(0, 256, (40, 3)).astype(np.uint8)
    write_points_ply(tmp_path / "p.ply", points, colors)
    vertex = plyfile.PlyData.read(str(tmp_path / "p.ply"))["vertex"]
    np.testing.assert_allclose(np.stack([vertex[a] for a in "xyz"], -1), points, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.stack([vertex[c] for c in ("red", "green", "blue")], -1), colors)


def test_colmap_camera_models_make_rays(tmp_path):
    """Each supported model trains through the ray generator: rays of a pixel pass through what COLMAP's model
    projects there (checked for a distorted OPENCV camera by projecting the rays' points back)."""
    pycolmap = pytest.importorskip("pycolmap")
    _colmap_folder(tmp_path, [(64, 48)], ["OPENCV"])
    capture = read_colmap_capture(tmp_path, orient="none")
    ours = read_model(tmp_path / "sparse" / "0").cameras[1]
    camera = pycolmap.Camera(model=ours.model, width=ours.width, height=ours.height, params=ours.params)
    frame = capture.frames[0]
    fx, fy, cx, cy = frame.intrinsics
    from data.camera_models import Lens

    lens = Lens(torch.tensor([frame.distortion], dtype=torch.float64), False).take(torch.tensor(0))
    _, directions = camera_rays(torch.eye(4, dtype=torch.float64), 48, 64, torch.tensor([fx, fy, cx, cy]), lens=lens)
    local = directions.reshape(-1, 3).numpy()
    opencv = np.stack([local[:, 0] / -local[:, 2], -local[:, 1] / -local[:, 2]], -1)  # OpenGL -> normalised OpenCV
    pixels = np.asarray(camera.img_from_cam(np.concatenate([opencv, np.ones((len(opencv), 1))], 1)))
    v, u = np.meshgrid(np.arange(48) + 0.5, np.arange(64) + 0.5, indexing="ij")
    np.testing.assert_allclose(pixels[:, :2], np.stack([u.ravel(), v.ravel()], -1), atol=1e-4)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda folder: (folder / "cameras.bin").write_bytes(b"\x05\x00"), "ends early"),
        (lambda folder: (folder / "images.bin").unlink(), "images.bin not found"),
    ],
)
def test_broken_models_say_what_is_wrong(tmp_path, damage, message):
    write_binary(tmp_path / "sparse" / "0", random_model(RNG, [(64, 48)], ["PINHOLE"]))
    damage(tmp_path / "sparse" / "0")
    with pytest.raises(SceneError, match=message):
        read_model(tmp_path / "sparse" / "0")


def test_unsupported_model_and_missing_folders(tmp_path):
    write_binary(tmp_path / "sparse" / "0", random_model(RNG, [(64, 48)], ["FULL_OPENCV"]))
    with pytest.raises(SceneError, match="FULL_OPENCV is not supported"):
        transforms_from_model(read_model(tmp_path / "sparse" / "0"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SceneError, match="no COLMAP model"):
        find_model(tmp_path / "empty")
    with pytest.raises(SceneError, match="no images/ folder"):
        read_colmap_capture(tmp_path)


def test_a_colmap_runs_scene_reads_back_for_the_tools_after_training(tmp_path):
    """training.eval / export / view / render_path read a data=colmap run's splits and frame like a nerfstudio one's."""
    from training.finished_run import load_split, scene_of, scene_transform

    _colmap_folder(tmp_path, [(64, 48), (48, 64)], ["PINHOLE", "PINHOLE"])
    data = {"name": "colmap", "root": str(tmp_path), "downscale": 1, "background": [1.0, 1.0, 1.0], "near": None,
            "far": None, "scene_box": None, "eval_interval": 3, "orient": "up"}  # fmt: skip
    train, _, _ = load_nerfstudio(tmp_path, colmap=True, eval_interval=3)
    again = load_split(data, "train")
    assert again.names == train.names and torch.equal(again.c2w, train.c2w)
    assert scene_transform(data).scale != 1.0  # data.orient=up scaled the cameras into [-1, 1]^3
    assert scene_of(data)["far"] > scene_of(data)["near"] >= 0
