"""How setup.py decides to build the CUDA kernels, and what a build without them does with CUDA tensors.

setup.py is run as `python setup.py --name`: that evaluates the decision (and prints its notices) without
compiling anything, so each case takes a torch import, not a build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cuda_ext

REPO = Path(__file__).resolve().parents[1]
NO_GPU = not torch.cuda.is_available()
CUDA_TORCH = torch.version.cuda is not None


def setup_decision(**env: str) -> subprocess.CompletedProcess:
    """`python setup.py --name` with env overrides (a value of None removes the variable)."""
    full = {k: v for k, v in os.environ.items() if k not in ("FORCE_CUDA", "TORCH_CUDA_ARCH_LIST")}
    for key, value in env.items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    return subprocess.run(
        [sys.executable, "setup.py", "--name"], cwd=REPO, env=full, capture_output=True, text=True, timeout=120
    )


def test_force_cuda_0_builds_cpu_kernels_only():
    result = setup_decision(FORCE_CUDA="0")
    assert result.returncode == 0, result.stderr
    assert "FORCE_CUDA=0: building the CPU kernels only" in result.stderr


def test_force_cuda_must_be_0_or_1():
    result = setup_decision(FORCE_CUDA="yes")
    assert result.returncode != 0
    assert "FORCE_CUDA must be 0 or 1, got 'yes'" in result.stderr


@pytest.mark.skipif(not (NO_GPU and CUDA_TORCH), reason="needs a CUDA build of torch on a machine without a GPU")
def test_no_visible_gpu_builds_cpu_kernels_with_a_notice():
    result = setup_decision()
    assert result.returncode == 0, result.stderr
    assert "no GPU visible: building the CPU kernels only" in result.stderr
    assert "FORCE_CUDA=1 python3 -m pip install --no-build-isolation -e ." in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(not CUDA_TORCH, reason="needs a CUDA build of torch")
def test_no_toolkit_builds_cpu_kernels_or_says_what_force_needs(tmp_path):
    no_nvcc_path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvcc").exists())
    env = {"CUDA_HOME": str(tmp_path / "no-toolkit"), "PATH": no_nvcc_path}
    result = setup_decision(**env)
    assert result.returncode == 0, result.stderr
    assert "no CUDA toolkit (nvcc, CUDA_HOME) was found: building the CPU kernels only" in result.stderr
    forced = setup_decision(FORCE_CUDA="1", **env)
    assert forced.returncode != 0
    assert "FORCE_CUDA=1 needs a CUDA toolkit" in forced.stderr and "Traceback" not in forced.stderr


@pytest.mark.skipif(
    not (NO_GPU and CUDA_TORCH and shutil.which("nvcc")), reason="needs a CUDA torch, nvcc and no visible GPU"
)
def test_force_cuda_without_gpu_uses_the_default_arch_list():
    result = setup_decision(FORCE_CUDA="1")
    assert result.returncode == 0, result.stderr
    assert "building the CUDA kernels for TORCH_CUDA_ARCH_LIST=8.0;8.6;8.9;9.0+PTX" in result.stderr
    chosen = setup_decision(FORCE_CUDA="1", TORCH_CUDA_ARCH_LIST="9.0")
    assert "building the CUDA kernels for TORCH_CUDA_ARCH_LIST=9.0" in chosen.stderr


def test_build_info_says_what_was_built():
    info = cuda_ext.build_info()
    assert info["extension"] is cuda_ext.has_extension() is True
    assert info["cuda"] is cuda_ext.has_cuda_kernels()
    assert info["torch"] == torch.__version__
    assert bool(info["cuda_arch_list"]) == info["cuda"]
    assert float(cuda_ext.gelu(torch.ones(1, dtype=torch.float64))) == pytest.approx(0.8413447460685429, abs=1e-15)


@pytest.mark.skipif(cuda_ext.has_cuda_kernels(), reason="the extension has CUDA kernels")
def test_a_build_without_cuda_kernels_refuses_cuda_tensors_naming_the_fix():
    # No GPU here: call the kernel registered under the CUDA key directly, as the dispatcher would for CUDA tensors.
    cuda_only = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    with pytest.raises(RuntimeError, match=r"cuda_ext.gelu: got CUDA tensors, but cuda_ext was built without its CUDA"):
        torch.ops.cuda_ext.gelu.default.redispatch(cuda_only, torch.randn(2), "none")
    with pytest.raises(RuntimeError, match=r"FORCE_CUDA=1 python3 -m pip install --no-build-isolation -e \."):
        torch.ops.cuda_ext.grid_interpolate.default.redispatch(cuda_only, torch.randn(2, 2, 2, 3), torch.rand(4, 3))
    # every op (backward ops included) has that stand-in, so no CUDA call reaches the dispatcher's generic error
    ops = [name for name in torch._C._dispatch_get_all_op_names() if name.startswith("cuda_ext::")]
    assert len(ops) >= 10
    assert all(torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA") for name in ops)
