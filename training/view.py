"""Open a finished run in the browser: ``python -m training.view RUN_DIR [--port P] [--host H]``.

Loads ``RUN_DIR/checkpoints/last.pt``, rebuilds the model from the checkpoint's own config (our compiled ops when
the extension loads, else the PyTorch references), draws the training cameras (read from the run's scene: the
built-in scene is regenerated into its cache if it is gone; a scene that cannot be read is noted and left out)
and serves the live viewer (training/viewer.py) until Ctrl-C. Errors (missing run folder or checkpoint, no viser,
port in use) are one line on stderr and exit code 2. Needs the ``viewer`` extra: ``pip install -e ".[viewer]"``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from data import SceneError
from models.model import VoxelNeRF
from training.finished_run import RunReadError, fast_ops, load_run, load_split
from training.scenes import resolve_device
from training.viewer import TrainCameras, Viewer, ViewerError, import_viser

EXIT_OK = 0
EXIT_USAGE = 2


def training_cameras(data_cfg: dict) -> TrainCameras | None:
    """The run's training views (None, with a note, when the scene cannot be read)."""
    try:
        scene = load_split(dict(data_cfg), "train")  # a blender, generated or capture scene, in the run's frame
    except (SceneError, RunReadError, ValueError, OSError, KeyError) as error:
        print(f"note: training cameras not shown ({' '.join(str(error).split())})", file=sys.stderr)
        return None
    return TrainCameras.of_scene(scene)


def open_run(run_dir: str, device: torch.device, with_cameras: bool = True) -> tuple[VoxelNeRF, dict, TrainCameras]:
    """(model on ``device`` in eval mode, checkpoint state, training cameras or None) of a run folder."""
    model, state = load_run(run_dir, fast_ops())
    cameras = training_cameras(dict(state["config"]["data"])) if with_cameras else None
    return model.to(device).eval(), state, cameras


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voxel-field-view", description="Open a finished run in the browser.")
    parser.add_argument("run_dir", help="the run folder (holds model.pt)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    parser.add_argument("--resolution", type=int, default=512, help="starting longer side of a frame in pixels")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--no-cameras", action="store_true", help="do not read the scene for the training cameras")
    args = parser.parse_args(argv)
    try:
        import_viser("training.view")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ViewerError("--device: cuda requested but CUDA is not available")
        model, state, cameras = open_run(args.run_dir, resolve_device(args.device), not args.no_cameras)
        data = state["config"]["data"]
        viewer = Viewer(
            model,
            cameras,
            float(data["near"]),
            float(data["far"]),
            host=args.host,
            port=args.port,
            resolution=args.resolution,
            training=False,
            port_key="--port",
            path_dir=Path(args.run_dir) / "camera_paths",
        )
    except (RunReadError, ViewerError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return EXIT_USAGE
    history = state.get("history") or {}
    psnr = history.get("psnr") or [None]
    viewer.set_progress(int(state["step"]), int(state["config"]["train"]["iters"]), psnr[-1])
    print(f"viewer: {viewer.url} (step {state['step']} of {args.run_dir}); Ctrl-C to stop", flush=True)
    try:
        viewer.serve()
    except KeyboardInterrupt:
        pass
    finally:
        viewer.close()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
