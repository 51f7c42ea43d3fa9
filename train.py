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
from training.sweep import quiet_preset_notice

quiet_preset_notice()  # configs/hydra/launcher: our presets of the submitit launcher's names
register_configs()  # the typed schema (training/config.py) that configs/config.yaml starts from

# render_only keeps its own copy of the config next to the training run's (.hydra_render), not over it
OmegaConf.register_new_resolver(
    "config_subdir", lambda render_only: ".hydra_render" if render_only else ".hydra", replace=True
)


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg: DictConfig) -> int:
    from training.app import run  # imported here so `--help` and config errors from Hydra stay fast

    hydra_cfg = HydraConfig.get()
    code = run(cfg, hydra_cfg.runtime.output_dir)
    if code == 0:
        return 0
    if hydra_cfg.mode != RunMode.MULTIRUN:
        sys.exit(code)
    if code >= 128 and hydra_cfg.launcher._target_.endswith("BasicLauncher"):  # a signal: the sweep stops here
        sys.exit(code)
    # a sweep goes on with its next job; training.sweep.SweepJobs records the code (this job may run in a process
    # of its own: submitit) and the launching process lists every job at the end
    print(f"job #{hydra_cfg.job.num} failed (exit code {code}); the sweep continues", file=sys.stderr)
    return code


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
    from training.sweep import FAILED  # filled at the end of a sweep (training.sweep.SweepJobs)

    if FAILED:
        listed = ", ".join(f"#{job['num']} ({job['dir']}: exit {job['code']})" for job in FAILED)
        print(f"error: {len(FAILED)} job(s) of the sweep failed: {listed}", file=sys.stderr)
        sys.exit(next((job["code"] for job in FAILED if job["code"]), 1))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) > 0:
        # A torchrun rank other than 0 has finished its share (rank 0 alone writes) and destroyed its process
        # group: it leaves without the interpreter's and C++ libraries' teardown. In that teardown a finished rank
        # was seen to abort (SIGABRT, "terminate called without an active exception"; torch 2.14, gloo, about one
        # job in 200 on a 2-core machine), which fails the whole job after its training completed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
