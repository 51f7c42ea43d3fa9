"""Shared pytest setup.

``@pytest.mark.requires_cuda`` marks a test that needs a CUDA device and the extension's CUDA kernels;
without them the test is reported as skipped (never as passed).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from training.config import register_configs

register_configs()  # tests that compose configs/ with Hydra's API need the schema, as train.py registers it


def cuda_kernels_available() -> bool:
    """A GPU is visible and cuda_ext was built with its CUDA kernels."""
    if not torch.cuda.is_available():
        return False
    import cuda_ext

    return cuda_ext.has_cuda_kernels()


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if cuda_kernels_available():
        return
    reason = "no CUDA device" if not torch.cuda.is_available() else "cuda_ext was built without CUDA kernels"
    skip = pytest.mark.skip(reason=f"requires_cuda: {reason}")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def load_bench():
    """``load_bench(name)``: bench/<name>.py loaded as a module, registered in sys.modules until the test module
    ends (dataclasses resolve their annotations through sys.modules)."""
    loaded: list[str] = []

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        loaded.append(name)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in loaded:
        sys.modules.pop(name, None)


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator: every test draws reproducible random inputs."""
    return torch.Generator().manual_seed(1234)


def _poison_cuda_cache() -> None:
    # All-ones bytes are NaN in float64/32/16 and bfloat16 alike. Many small blocks feed the
    # allocator's small pool (< 1 MB requests), one big block its large pool.
    blocks = [torch.full((1 << 16,), -1, dtype=torch.int32, device="cuda") for _ in range(64)]
    blocks.append(torch.full((1 << 26,), -1, dtype=torch.int32, device="cuda"))
    del blocks


@pytest.fixture
def poison_cuda_cache():
    """A callable that leaves NaN-filled blocks in the CUDA caching allocator, so an output element a
    kernel forgets to write shows up as NaN instead of a lucky zero. Call it right before the op."""
    return _poison_cuda_cache


@pytest.fixture
def blender_scene(tmp_path):
    """A tiny NeRF-synthetic scene (5 train, 3 val views of 16x16 random RGBA) under a path with a space."""
    import numpy as np

    from data import write_blender_split
    from data.cameras import look_at, random_zone_positions

    rng = np.random.default_rng(0)
    root = tmp_path / "tiny blender"  # a space: the override must be quoted
    for split, count in (("train", 5), ("val", 3)):
        c2w = look_at(random_zone_positions(count, 4.0, 0.1, 1.0, rng))
        images = [rng.integers(0, 256, (16, 16, 4), dtype=np.uint8) for _ in range(count)]
        write_blender_split(root, split, images, c2w, 0.7)
    return root
