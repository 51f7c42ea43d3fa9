"""Builds the ``cuda_ext._C`` extension: C++ CPU kernels always, CUDA kernels when torch has CUDA.

CUDA is decided at build time from ``torch.version.cuda`` (or ``FORCE_CUDA=1``), never from a
visible GPU, so a GPU-less build machine can still produce CUDA kernels.
``FORCE_CUDA=0`` builds the CPU kernels only, even with a CUDA torch.
"""

import glob
import os
import sys

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("cuda_ext", "csrc")


def with_cuda() -> bool:
    force = os.environ.get("FORCE_CUDA")
    if force is not None:
        return force == "1"
    return torch.version.cuda is not None


def shared_libstdcxx_link_args() -> list:
    """The shared libstdc++ that torch runs with, as a link input (Linux), so the extension uses it.

    Why: a compiler set up to link libstdc++ statically (seen on the lent GPU machines: Python's own
    /opt/gcc/bin/g++) copies iostreams and locales from libstdc++.a into the extension. That copy's locale
    is never initialised, so formatting a number there (any TORCH_CHECK message with a size) segfaults.
    Naming the process's libstdc++.so first makes the linker resolve against it and take nothing from the
    archive (bench/experiments/cpp_exception_probe.py: the same probe crashes without it, raises with it).
    Where the compiler links the shared library anyway, this is the same library and changes nothing.
    """
    if not sys.platform.startswith("linux"):
        return []
    with open("/proc/self/maps") as maps:  # torch (imported above) has loaded the process's libstdc++
        for line in maps:
            path = line.split()[-1]
            if "libstdc++.so" in path and os.path.exists(path):
                return [os.path.realpath(path)]
    return []


def extension():
    cpp_sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))
    cxx_flags = ["-O3"]  # no -std: BuildExtension picks the standard this torch was built with (C++20 from 2.10 on)
    # We never read floating-point exception flags; without this GCC will not if-convert the clamps in
    # cpu/fast_float.h, and the CPU GELU loops stay scalar. Results are unchanged (no -ffast-math).
    cxx_flags.append("-fno-trapping-math")
    # Each multiply and add rounded on its own (as in PyTorch's elementwise ops): march_rays' samples must be bit
    # for bit the reference's, which a contracted a * b + c (an FMA on machines that have one) would break.
    cxx_flags.append("-ffp-contract=off")
    if sys.platform.startswith("linux"):
        cxx_flags.append("-fopenmp")  # at::parallel_for is header-inlined OpenMP: without it, CPU kernels run serially
    link_args = ["-fopenmp"] if sys.platform.startswith("linux") else []
    link_args = shared_libstdcxx_link_args() + link_args
    if with_cuda():
        cu_sources = sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
        nvcc_flags = ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]
        return CUDAExtension(
            "cuda_ext._C",
            cpp_sources + cu_sources,
            include_dirs=[os.path.join(ROOT, CSRC)],
            define_macros=[("WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            extra_link_args=link_args,
        )
    return CppExtension(
        "cuda_ext._C",
        cpp_sources,
        include_dirs=[os.path.join(ROOT, CSRC)],
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_args,
    )


setup(
    name="voxel-field",
    version="0.1.0",
    description="A voxel-grid neural-field trainer with hand-written CPU and CUDA ops",
    packages=find_packages(
        include=["cuda_ext", "cuda_ext.*", "models", "models.*", "data", "data.*", "training", "training.*"]
    ),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "numpy", "hydra-core>=1.3", "tqdm", "imageio>=2.9", "pillow"],
    extras_require={
        # the optional extras' tests run in CI too (TensorBoard events, MP4, mesh export)
        "test": ["pytest", "tensorboard", "imageio-ffmpeg", "pymcubes", "plyfile", "viser>=1.0"],
        "lint": ["ruff==0.17.5", "clang-format==23.1.3"],
        "tensorboard": ["tensorboard"],
        "video": ["imageio-ffmpeg"],
        "mesh": ["pymcubes", "plyfile"],
        "viewer": ["viser>=1.0"],
    },
)
