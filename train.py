"""Train a voxel-grid radiance field (or re-render a finished run) as the Hydra config says.

    python train.py                                  # built-in procedural scene, default settings
    python train.py ops=torch                        # PyTorch reference ops instead of our kernels
    python train.py +experiment=blender data.root=PATH
    python train.py render_only=true hydra.run.dir=outputs/DATE/TIME
    python train.py -m train.iters=500,1000          # a sweep: every job runs; failures are listed at the end

Everything happens in training/app.py; this file registers the config schema and hands Hydra's config and run
directory over.
"""

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from training.config import register_configs

register_configs()  # the typed schema (training/config.py) that configs/config.yaml starts from

# render_only keeps its own copy of the config next to the training run's (.hydra_render), not over it
OmegaConf.register_new_resolver(
    "config_subdir", lambda render_only: ".hydra_render" if render_only else ".hydra", replace=True
)

FAILED_JOBS: list[tuple[int, str, int]] = []  # (job number, run directory, exit code) of a sweep's failures


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from training.app import run  # imported here so `--help` and config errors from Hydra stay fast

    hydra_cfg = HydraConfig.get()
    code = run(cfg, hydra_cfg.runtime.output_dir)
    if code == 0:
        return
    if hydra_cfg.mode != RunMode.MULTIRUN or code >= 128:  # one run, or a signal: stop here
        sys.exit(code)
    # a sweep goes on with its next job (sys.exit here would end the whole sweep silently)
    FAILED_JOBS.append((hydra_cfg.job.num, hydra_cfg.runtime.output_dir, code))
    print(f"job #{hydra_cfg.job.num} failed (exit code {code}); the sweep continues", file=sys.stderr)


def read_only_run_dir(argv: list[str]) -> str | None:
    """The one-line error for a ``hydra.run.dir=...`` that exists but cannot be written, else None.

    Hydra writes its log and config copy there before any of our code runs, and on a read-only folder (an
    archived run, say) it fails with a traceback from its logging set-up; this says it first, in one line.
    """
    for arg in argv:
        if arg.startswith("hydra.run.dir="):
            folder = arg.split("=", 1)[1].strip("'\"")
            if os.path.isdir(folder) and not os.access(folder, os.W_OK):
                return (
                    f"error: hydra.run.dir: {folder} is read-only; a run writes its log, config and outputs there "
                    "(render_only too: copy the run to a writable folder first)"
                )
    return None


if __name__ == "__main__":
    refusal = read_only_run_dir(sys.argv[1:])
    if refusal:
        print(refusal, file=sys.stderr)
        sys.exit(2)
    main()
    if FAILED_JOBS:
        listed = ", ".join(f"#{num} ({folder}: exit {code})" for num, folder, code in FAILED_JOBS)
        print(f"error: {len(FAILED_JOBS)} job(s) of the sweep failed: {listed}", file=sys.stderr)
        sys.exit(FAILED_JOBS[0][2])
