"""Builds the ``cuda_ext._C`` extension: C++ CPU kernels always, CUDA kernels where they can run.

Whether the CUDA kernels are built is decided as pytorch3d, torch-scatter and detectron2 do:

- ``FORCE_CUDA=0``: CPU kernels only.
- ``FORCE_CUDA=1``: CUDA kernels too, with or without a visible GPU (a Docker image build, a cluster's login
  node), as long as torch has CUDA and a CUDA toolkit (nvcc, ``CUDA_HOME``) is found.
- unset: CUDA kernels when torch has CUDA, a toolkit is found AND a GPU is visible; else CPU kernels only.

Without a visible GPU and without ``TORCH_CUDA_ARCH_LIST``, the CUDA kernels are built for
:data:`DEFAULT_ARCHS` (those the toolkit's nvcc supports), and the list used is printed. What was built is
written to ``cuda_ext/_build_config.py`` (``cuda_ext.build_info()`` reports it).
"""

import glob
import os
import subprocess
import sys

import torch
from setuptools import find_packages, setup
from torch.utils import cpp_extension
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("cuda_ext", "csrc")
# Ampere (A100, RTX 30xx), Ampere GA10x, Ada (RTX 40xx, L4/L40), Hopper (H100/H200) with PTX for newer GPUs.
DEFAULT_ARCHS = ("8.0", "8.6", "8.9", "9.0+PTX")
REBUILD_WITH_CUDA = "FORCE_CUDA=1 python3 -m pip install --no-build-isolation -e ."


def notice(message: str) -> None:
    print(f"cuda_ext setup: {message}", file=sys.stderr, flush=True)


def is_toolkit(folder) -> bool:
    """A CUDA toolkit's root: nvcc, the runtime's headers and the runtime library to link."""
    if not folder:
        return False
    lib_dirs = ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"))
    libs = [os.path.join(folder, lib, "libcudart.so") for lib in lib_dirs]
    return (
        os.path.exists(os.path.join(folder, "bin", "nvcc"))
        and os.path.exists(os.path.join(folder, "include", "cuda_runtime.h"))
        and any(os.path.exists(lib) for lib in libs)
    )


def cuda_home():
    """The toolkit to build with: torch's CUDA_HOME when it is one, else /usr/local/cuda; None without a toolkit.

    torch derives CUDA_HOME from `which nvcc` when the variable is unset, which is wrong where nvcc on PATH is a
    wrapper script outside the toolkit (seen: /usr/local/bin/nvcc -> CUDA_HOME=/usr/local, no headers, no libcudart:
    every file compiled, then the link failed on -lcudart)."""
    if is_toolkit(CUDA_HOME):
        return CUDA_HOME
    fallback = "/usr/local/cuda"
    if not os.environ.get("CUDA_HOME") and is_toolkit(fallback):
        notice(f"CUDA_HOME={CUDA_HOME} (from nvcc on PATH) is not a CUDA toolkit: using {fallback}")
        cpp_extension.CUDA_HOME = fallback  # read by CUDAExtension and BuildExtension when they run
        os.environ["CUDA_HOME"] = fallback
        return fallback
    return None


def nvcc_path():
    """The toolkit's nvcc, or None."""
    home = cuda_home()
    return os.path.join(home, "bin", "nvcc") if home else None


def with_cuda() -> bool:
    """Build the CUDA kernels? (see the module doc; prints why not when torch has CUDA)."""
    force = os.environ.get("FORCE_CUDA", "")
    if force not in ("", "0", "1"):
        raise SystemExit(f"cuda_ext setup: FORCE_CUDA must be 0 or 1, got {force!r}")
    if force == "0":
        notice("FORCE_CUDA=0: building the CPU kernels only")
        return False
    if torch.version.cuda is None:
        if force == "1":
            raise SystemExit("cuda_ext setup: FORCE_CUDA=1 but the installed torch has no CUDA (a CPU build)")
        return False
    if nvcc_path() is None:
        if force == "1":
            raise SystemExit(
                "cuda_ext setup: FORCE_CUDA=1 needs a CUDA toolkit (bin/nvcc, include/cuda_runtime.h, libcudart.so): "
                f"CUDA_HOME={CUDA_HOME} is none; set CUDA_HOME to the toolkit's folder"
            )
        notice(
            f"torch has CUDA {torch.version.cuda} but no CUDA toolkit (nvcc, CUDA_HOME) was found: building the CPU "
            f"kernels only; for the CUDA kernels install the toolkit and run `{REBUILD_WITH_CUDA}`"
        )
        return False
    if force == "1" or torch.cuda.is_available():
        return True
    notice(f"no GPU visible: building the CPU kernels only (for the CUDA kernels anyway: `{REBUILD_WITH_CUDA}`)")
    return False


def nvcc_archs() -> set:
    """Compute capabilities the toolkit's nvcc compiles for, e.g. {"8.0", "9.0"} (empty if it cannot say)."""
    try:
        listed = subprocess.run([nvcc_path(), "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError, TypeError):
        return set()
    archs = set()
    for token in listed.split():
        digits = token.removeprefix("compute_")
        if digits.isdigit():
            archs.add(f"{digits[:-1]}.{digits[-1]}")
    return archs


def cuda_arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST for this build: the user's, the visible GPUs' (torch's own choice), or the default."""
    chosen = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if chosen:
        return chosen
    if torch.cuda.is_available():
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        return ";".join(f"{major}.{minor}" for major, minor in caps)
    supported = nvcc_archs()
    archs = [a for a in DEFAULT_ARCHS if not supported or a.removesuffix("+PTX") in supported]
    if not archs:
        raise SystemExit(f"cuda_ext setup: nvcc supports none of {DEFAULT_ARCHS}; set TORCH_CUDA_ARCH_LIST")
    if not archs[-1].endswith("+PTX"):
        archs[-1] += "+PTX"
    return ";".join(archs)


def write_build_config(folder: str, cuda: bool, archs: str) -> None:
    """<folder>/cuda_ext/_build_config.py: what this build holds, for cuda_ext.build_info() (not tracked by git)."""
    lines = [
        '"""Written by setup.py at build time: what cuda_ext._C was built with."""',
        f"CUDA = {cuda!r}",
        f"CUDA_ARCH_LIST = {archs!r}",
        f"TORCH_VERSION = {torch.__version__!r}",
        f"TORCH_CUDA_VERSION = {torch.version.cuda!r}",
        "",
    ]
    os.makedirs(os.path.join(folder, "cuda_ext"), exist_ok=True)
    with open(os.path.join(folder, "cuda_ext", "_build_config.py"), "w") as out:
        out.write("\n".join(lines))


class BuildExtensionWithConfig(BuildExtension):
    """torch's BuildExtension that also records what it built (only when building: `setup.py --name` writes nothing)."""

    def run(self) -> None:
        cuda = any("WITH_CUDA" in dict(ext.define_macros or []) for ext in self.extensions)
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if cuda else ""
        write_build_config(ROOT, cuda, archs)  # the source tree: editable and in-place builds import it from here
        if not self.inplace:
            write_build_config(self.build_lib, cuda, archs)
        super().run()


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
    cuda = with_cuda()
    if cuda:
        archs = cuda_arch_list()
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs  # read by BuildExtension when it compiles
        notice(f"building the CUDA kernels for TORCH_CUDA_ARCH_LIST={archs}")
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
    cmdclass={"build_ext": BuildExtensionWithConfig},
    entry_points={  # one command per job (training/cli.py); each is also `python -m <module>`
        "console_scripts": [
            "voxel-field = training.cli:main",
            "voxel-field-train = training.cli:train",
            "voxel-field-process = training.process:main",
            "voxel-field-view = training.view:main",
            "voxel-field-render = training.render_path:main",
            "voxel-field-export = training.export:main",
            "voxel-field-eval = training.eval:main",
        ]
    },
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "numpy", "hydra-core>=1.3", "tqdm", "imageio>=2.9", "pillow"],
    extras_require={
        # the optional extras' tests run in CI too (TensorBoard events, MP4, mesh export)
        "test": [
            "pytest",
            "tensorboard",
            "imageio-ffmpeg",
            "pymcubes",
            "plyfile",
            "viser>=1.0",
            "hydra-submitit-launcher>=1.2",
            "pycolmap>=4.0",
            "trimesh",
        ],
        "lint": ["ruff==0.17.5", "clang-format==23.1.3"],
        "tensorboard": ["tensorboard"],
        "video": ["imageio-ffmpeg"],
        "mesh": ["pymcubes", "plyfile", "trimesh"],  # trimesh: GLB / OBJ
        "viewer": ["viser>=1.0"],
        "cluster": ["hydra-submitit-launcher>=1.2"],
        # training.process: COLMAP's structure from motion (CPU wheels) and a video reader (ships its own ffmpeg)
        "process": ["pycolmap>=4.0", "imageio-ffmpeg"],
    },
)
