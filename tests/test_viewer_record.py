"""The viewer's record panel without a browser: keyframes from a client's camera, the camera-path JSON it saves (in
the run's camera_paths/), and render_path rendering that file."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_train import finished_run, scene_cache  # noqa: F401  (fixtures: a 12-step CPU run of the built-in scene)
from test_viewer import HAS_VISER, free_port

from data.cameras import look_at
from training import render_path, view
from training.viewer import Viewer
from training.viewer_frames import c2w_to_viser

pytestmark = pytest.mark.skipif(not HAS_VISER, reason='viser is not installed (pip install -e ".[test]")')


def test_recorded_keyframes_save_a_path_that_render_path_renders(finished_run, tmp_path):  # noqa: F811
    model, state, cameras = view.open_run(str(finished_run), torch.device("cpu"), False)
    data = state["config"]["data"]
    viewer = Viewer(
        model, cameras, data["near"], data["far"], port=free_port(), training=False, resolution=32, path_dir=tmp_path
    )
    try:
        assert viewer.url.startswith("http://127.0.0.1:")  # loopback by default
        with pytest.raises(ValueError, match="no keyframes"):
            viewer.save_camera_path()
        keys = look_at(np.array([[4.0, 0.0, 1.0], [0.0, 4.0, 1.5], [-4.0, 0.0, 1.0]]))
        for c2w in keys[:2]:  # as the "Add keyframe" button does, from the clicking browser's camera
            wxyz, position = c2w_to_viser(c2w)
            camera = SimpleNamespace(wxyz=wxyz, position=position, fov=math.radians(50.0), aspect=1.5)
            viewer._record(SimpleNamespace(camera=camera))
        assert viewer.add_keyframe(keys[2], math.radians(50.0), 1.5) == 3
        np.testing.assert_allclose(viewer.keyframes[0][0], keys[0], atol=1e-9)
        path = viewer.save_camera_path("my path", frames=9)
        assert path == tmp_path / "my_path.json" and not list(tmp_path.glob(".*"))
        content = json.loads(path.read_text())
        assert len(content["camera_path"]) == 9 and len(content["keyframes"]) == 3
        assert content["render_width"] / content["render_height"] == pytest.approx(1.5, rel=0.1)
        matrices = np.array([np.reshape(c["camera_to_world"], (4, 4)) for c in content["camera_path"]])
        np.testing.assert_allclose(matrices[[0, 4, 8]], keys, atol=1e-9)  # through the keyframes
        assert content["camera_path"][0]["fov"] == pytest.approx(50.0)
        viewer.clear_keyframes()
        assert viewer.keyframes == []
    finally:
        viewer.close()
    out = tmp_path / "render"
    assert render_path.main([str(finished_run), "--path", str(path), "--out", str(out), "--device", "cpu"]) == 0
    written = json.loads((out / "cameras.json").read_text())
    assert len(written["frames"]) == 9
    np.testing.assert_allclose(np.array(written["frames"][4]["transform_matrix"]), keys[1], atol=1e-5)
