"""Train a voxel-grid radiance field (or re-render a finished run) as the Hydra config says.

    python train.py                                  # built-in procedural scene, default settings
    python train.py ops=torch                        # PyTorch reference ops instead of our kernels
    python train.py +experiment=blender data.root=PATH
    python train.py render_only=true hydra.run.dir=outputs/DATE/TIME

Everything happens in models/trainer.py; this file only hands Hydra's config and run directory over.
"""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from models.trainer import run  # imported here so `--help` and config errors from Hydra stay fast

    sys.exit(run(cfg, HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
