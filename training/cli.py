"""The package's commands (setup.py's console scripts), one per job, and ``voxel-field <verb>`` for all of them:

    voxel-field-train  [Hydra overrides...]      train.py: train a run (python train.py)
    voxel-field-process ...                      training.process: turn photos or a video into a capture
    voxel-field-view   RUN_DIR [--port 8080]     training.view: the run in the browser (record a camera path there)
    voxel-field-render RUN_DIR [--path ...]      training.render_path: a video along orbit / interpolate / spiral /...
    voxel-field-export {pointcloud,mesh,cameras,weights} RUN_DIR
    voxel-field-eval   RUN_DIR [--split ...]     training.eval: scores on any split, apart from the run's own

Every one answers ``--help``; each is also ``python -m <module>``. Training is Hydra's app in ``train.py`` beside the
packages (an editable install or a source checkout: ``pip install -e .``); its configs are in ``configs/`` there.
"""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERBS = {  # verb: (module, what it does)
    "train": ("train.py", "train a run (Hydra overrides, e.g. data=nerfstudio data.root=PATH)"),
    "process": ("training.process", "turn photos or a video into a capture"),
    "view": ("training.view", "open a finished run in the browser"),
    "render": ("training.render_path", "render a finished run along a camera path"),
    "export": ("training.export", "export a point cloud, mesh, cameras or weights"),
    "eval": ("training.eval", "evaluate a finished run on any split"),
}


def _module_main(verb: str, argv: list[str]) -> int:
    module_name = VERBS[verb][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        print(f"error: voxel-field {verb}: {module_name} is not part of this install", file=sys.stderr)
        return 2
    sys.argv = [f"voxel-field-{verb}", *argv]
    return int(module.main(argv) or 0)


def train(argv: list[str] | None = None) -> int:
    """``voxel-field-train``: ``python train.py`` with the same arguments (train.py is Hydra's app)."""
    script = ROOT / "train.py"
    if not script.is_file() or not (ROOT / "configs").is_dir():
        print(
            f"error: voxel-field-train: {script} and its configs/ are not beside the installed packages; install the "
            "project editable (pip install -e .) or run python train.py in a checkout",
            file=sys.stderr,
        )
        return 2
    sys.argv = [str(script), *(sys.argv[1:] if argv is None else argv)]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return 0


def process() -> int:
    return _module_main("process", sys.argv[1:])


def view() -> int:
    return _module_main("view", sys.argv[1:])


def render() -> int:
    return _module_main("render", sys.argv[1:])


def export() -> int:
    return _module_main("export", sys.argv[1:])


def evaluate() -> int:
    return _module_main("eval", sys.argv[1:])


def usage() -> str:
    lines = ["usage: voxel-field <verb> [arguments...]   (voxel-field <verb> --help: the verb's own)", "", "verbs:"]
    lines += [f"  {verb:<8} {what}" for verb, (_, what) in VERBS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``voxel-field <verb> ...``: the verb's command with the rest of the arguments."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"error: voxel-field: unknown verb {verb!r} (one of {', '.join(VERBS)})", file=sys.stderr)
        return 2
    return train(rest) if verb == "train" else _module_main(verb, rest)


if __name__ == "__main__":
    sys.exit(main())
