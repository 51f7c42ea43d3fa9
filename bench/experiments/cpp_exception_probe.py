"""Why does a failing TORCH_CHECK in an extension segfault on some machines? A probe, run where it happens.

Builds one tiny extension per compiler/linker variant (``load_inline``, in parallel), then calls each of
its probes in a fresh subprocess, with a SIGSEGV handler installed that prints the faulting instruction's
library and symbol (``dladdr``) and a scan of the stack for return addresses (no unwinder: that may be what
crashes). Probes: throw std::runtime_error; fail TORCH_CHECK (through pybind and through the dispatcher);
capture c10's backtrace without throwing; glibc ``backtrace()``; ``_Unwind_Backtrace``; a torch error
raised from libtorch below an extension frame; a TORCH_CHECK caught inside the extension.

    python bench/experiments/cpp_exception_probe.py --json OUT.json

Writes every (variant, probe, environment) outcome and the process's loaded unwinder libraries.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

SOURCE = r"""
#include <torch/extension.h>
#include <torch/library.h>
#include <c10/util/Backtrace.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdexcept>
#include <ucontext.h>
#include <unistd.h>
#include <unwind.h>
#include <cstdio>

namespace {
void describe(const char* what, void* address) {
  Dl_info info{};
  char line[1024];
  int n;
  if (dladdr(address, &info) && info.dli_fname) {
    n = snprintf(line, sizeof line, "%s %p = %s+%#lx (%s+%#lx)\n", what, address, info.dli_fname,
                 (unsigned long)((char*)address - (char*)info.dli_fbase), info.dli_sname ? info.dli_sname : "?",
                 (unsigned long)((char*)address - (char*)(info.dli_saddr ? info.dli_saddr : info.dli_fbase)));
  } else {
    n = snprintf(line, sizeof line, "%s %p (no object)\n", what, address);
  }
  if (n > 0) (void)!write(2, line, n);
}

void on_segv(int, siginfo_t* si, void* context) {
  auto* uc = static_cast<ucontext_t*>(context);
  char line[128];
  int n = snprintf(line, sizeof line, "PROBE-SEGV fault address %p\n", si->si_addr);
  (void)!write(2, line, n);
  describe("PROBE-SEGV rip", (void*)uc->uc_mcontext.gregs[REG_RIP]);
  // stack scan: words that point into a mapped object's code are likely return addresses
  auto** sp = reinterpret_cast<void**>(uc->uc_mcontext.gregs[REG_RSP]);
  int shown = 0;
  for (int i = 0; i < 4096 && shown < 40; ++i) {
    Dl_info info{};
    void* word = sp[i];
    if (word && dladdr(word, &info) && info.dli_fname && info.dli_sname) {
      describe("PROBE-SEGV stack", word);
      ++shown;
    }
  }
  _exit(139);
}

_Unwind_Reason_Code count_frame(struct _Unwind_Context*, void* count) {
  ++*static_cast<int*>(count);
  return _URC_NO_REASON;
}
}  // namespace

void install_handler() {
  struct sigaction action {};
  action.sa_sigaction = on_segv;
  action.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &action, nullptr);
}
void throw_runtime() { throw std::runtime_error("probe: std::runtime_error"); }
void torch_check() { TORCH_CHECK(false, "probe: TORCH_CHECK failed"); }
std::string c10_backtrace() { return c10::get_backtrace(0, 64, true).substr(0, 200); }
int glibc_backtrace() { void* frames[64]; return backtrace(frames, 64); }
int unwind_backtrace() { int count = 0; _Unwind_Backtrace(count_frame, &count); return count; }
void torch_error_below() { at::zeros({2}).view({3}); }
std::string caught_inside() {
  try { TORCH_CHECK(false, "probe: caught"); } catch (const c10::Error& e) { return e.what_without_backtrace(); }
  return "not thrown";
}
void check_sizes(const at::Tensor& x) { TORCH_CHECK(false, "probe: sizes ", x.sizes()); }
std::string str_sizes(const at::Tensor& x) { return c10::str("sizes ", x.sizes()); }
void check_dtype_device(const at::Tensor& x) { TORCH_CHECK(false, "probe: ", x.scalar_type(), " on ", x.device()); }
at::Tensor dispatcher_check(const at::Tensor& x) { TORCH_CHECK(x.dim() == 99, "probe: dispatcher TORCH_CHECK"); return x; }

TORCH_LIBRARY(LIBNAME, m) { m.def("check(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(LIBNAME, CPU, m) { m.impl("check", &dispatcher_check); }
"""

FUNCTIONS = [
    "install_handler",
    "throw_runtime",
    "torch_check",
    "c10_backtrace",
    "glibc_backtrace",
    "unwind_backtrace",
    "torch_error_below",
    "caught_inside",
    "check_sizes",
    "str_sizes",
    "check_dtype_device",
]
TENSOR_PROBES = {"check_sizes", "str_sizes", "check_dtype_device"}
PROBES = FUNCTIONS[1:] + ["dispatcher_check"]

# (name, extra_cflags, extra_ldflags)
VARIANTS = [
    ("default", [], []),
    ("frame_pointer", ["-fno-omit-frame-pointer"], []),
    ("no_cf_protection", ["-fcf-protection=none"], []),
    ("static_libgcc", [], ["-static-libgcc"]),
    ("shared_libgcc_first", [], ["-shared-libgcc", "-Wl,--no-as-needed", "-lgcc_s"]),
    ("no_async_unwind", ["-fno-asynchronous-unwind-tables"], []),
    # link the shared libstdc++ the interpreter already runs with (a compiler that only has libstdc++.a
    # otherwise puts a second, uninitialised copy of iostreams and locales into the extension)
    ("dynamic_libstdcxx", [], ["LOADED_LIBSTDCXX"]),
    ("system_gxx", [], []),  # CXX=/usr/bin/g++ instead of whatever c++ is first on PATH
]


def loaded_libstdcxx() -> str:
    import torch  # noqa: F401  (loads the libstdc++ every extension will run with)

    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libstdc++.so" in path:
                return os.path.realpath(path)
    return ""


ENVIRONMENTS = {
    "plain": {},
    "show_cpp_stacktraces": {"TORCH_SHOW_CPP_STACKTRACES": "1"},
    "no_shadow_stack": {"GLIBC_TUNABLES": "glibc.cpu.x86_shstk=off"},
}


def build(variant: tuple[str, list[str], list[str]], root: str) -> dict:
    name, cflags, ldflags = variant
    from torch.utils.cpp_extension import load_inline

    ldflags = [loaded_libstdcxx() if flag == "LOADED_LIBSTDCXX" else flag for flag in ldflags]
    if name == "system_gxx":
        os.environ["CXX"] = "/usr/bin/g++"

    directory = os.path.join(root, name)
    os.makedirs(directory, exist_ok=True)
    module_name = f"probe_{name}"
    try:
        module = load_inline(
            module_name,
            SOURCE.replace("LIBNAME", module_name),
            functions=FUNCTIONS,
            extra_cflags=["-O2", *cflags],
            extra_ldflags=ldflags,
            build_directory=directory,
            verbose=False,
        )
        return {"variant": name, "path": module.__file__, "ok": True}
    except Exception as error:  # noqa: BLE001 - a variant that does not build is a result too
        return {"variant": name, "ok": False, "error": str(error)[-2000:]}


CALL = r"""
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location(sys.argv[2], sys.argv[1])
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
module.install_handler()
probe = sys.argv[3]
TENSOR_PROBES = %r
try:
    if probe == "dispatcher_check":
        result = getattr(torch.ops, sys.argv[2]).check(torch.zeros(2))
    else:
        args = (torch.zeros(2, 3),) if probe in TENSOR_PROBES else ()
        result = getattr(module, probe)(*args)
    print("RETURNED", repr(result)[:200])
except BaseException as error:
    print("RAISED", type(error).__name__, str(error).splitlines()[0][:200])
"""


CALL = CALL % (sorted(TENSOR_PROBES),)


def call(path: str, module_name: str, probe: str, env: dict) -> dict:
    completed = subprocess.run(
        [sys.executable, "-c", CALL, path, module_name, probe],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    segv = [line for line in completed.stderr.splitlines() if line.startswith("PROBE-SEGV")]
    return {
        "rc": completed.returncode,
        "stdout": completed.stdout.strip()[-300:],
        "segv": segv[:45],
        "stderr_tail": completed.stderr.strip()[-600:] if not segv else "",
    }


# direct torch.ops calls into the project's extension (no Python-side checks in between)
PROJECT_CALLS = {
    "tri_feats_2d": "trilinear_interpolate(torch.rand(4, 8, device=D), torch.rand(4, 3, device=D))",
    "tri_7_corners": "trilinear_interpolate(torch.rand(4, 7, 5, device=D), torch.rand(4, 3, device=D))",
    "tri_n_mismatch": "trilinear_interpolate(torch.rand(4, 8, 5, device=D), torch.rand(3, 3, device=D))",
    "tri_int_feats": "trilinear_interpolate(torch.ones(4, 8, 5, dtype=torch.int32, device=D), torch.rand(4, 3, device=D))",
    "grid_3d": "grid_interpolate(torch.rand(4, 4, 4, device=D), torch.rand(5, 3, device=D))",
    "grid_4_columns": "grid_interpolate(torch.rand(4, 4, 4, 2, device=D), torch.rand(5, 4, device=D))",
    "grid_empty_axis": "grid_interpolate(torch.rand(4, 0, 4, 2, device=D), torch.rand(5, 3, device=D))",
    "upsample_3d": "upsample_bilinear2d(torch.rand(2, 4, 4, device=D), 2, False)",
    "upsample_scale_0": "upsample_bilinear2d(torch.rand(1, 2, 4, 4, device=D), 0, False)",
    "gelu_bad_approximate": "gelu(torch.rand(3, device=D), 'bogus')",
}

PROJECT_CALL = r"""
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location(sys.argv[2], sys.argv[1])
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
import cuda_ext
module.install_handler()
D = sys.argv[4]
try:
    result = eval("torch.ops.cuda_ext." + sys.argv[3])
    print("RETURNED", tuple(result.shape))
except BaseException as error:
    print("RAISED", type(error).__name__, str(error).splitlines()[0][:200])
"""


def project_calls(probe_path: str, devices: list[str]) -> list[dict]:
    results = []
    for device in devices:
        for name, expression in PROJECT_CALLS.items():
            completed = subprocess.run(
                [sys.executable, "-c", PROJECT_CALL, probe_path, "probe_default", expression, device],
                capture_output=True,
                text=True,
                timeout=120,
            )
            segv = [line for line in completed.stderr.splitlines() if line.startswith("PROBE-SEGV")]
            results.append(
                {
                    "device": device,
                    "call": name,
                    "rc": completed.returncode,
                    "stdout": completed.stdout.strip()[-300:],
                    "segv": segv[:45],
                    "stderr_tail": completed.stderr.strip()[-600:] if not segv else "",
                }
            )
            outcome = (
                completed.stdout.strip().split("\n")[-1] if completed.returncode == 0 else f"rc={completed.returncode}"
            )
            print(f"project {device:5s} {name:22s} {outcome}")
            for line in segv[:8]:
                print("    " + line)
    return results


def loaded_unwinders() -> dict:
    import torch  # noqa: F401

    libraries = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if any(key in path for key in ("libgcc", "libstdc++", "libunwind", "libc10", "libc.so")):
                libraries.add(os.path.realpath(path))
    return {"loaded": sorted(libraries)}


def facts() -> dict:
    import torch

    def out(command: list[str]) -> str:
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()[:400]
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"unavailable: {error}"

    flags = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            words = set(cpuinfo.read().split())
        flags = " ".join(sorted(w for w in words if w in {"user_shstk", "shstk", "ibt"}))
    except OSError:
        pass
    import sysconfig

    return {
        "sysconfig_cxx": [sysconfig.get_config_var(k) for k in ("CXX", "LDCXXSHARED", "LDSHARED")],
        "which_cxx": out(
            [
                "sh",
                "-c",
                "command -v c++ g++; c++ --version | head -1; "
                "c++ -print-file-name=libstdc++.so; c++ -print-file-name=libstdc++.a",
            ]
        ),
        "libstdcxx_loaded": loaded_libstdcxx(),
        "torch": torch.__version__,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python": sys.version,
        "platform": platform.platform(),
        "glibc": platform.libc_ver(),
        "gcc": out(["gcc", "--version"]).splitlines()[:1],
        "cpu_flags": flags,
        "compiled_with_cxx11_abi": torch.compiled_with_cxx11_abi(),
        "torch_config_compiler": [
            line for line in torch.__config__.show().splitlines() if "GCC" in line or "CXX_COMPILER" in line
        ][:4],
        **loaded_unwinders(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--variants", default=",".join(v[0] for v in VARIANTS))
    parser.add_argument(
        "--project", action="store_true", help="also call the project's ops (import cuda_ext) with bad inputs"
    )
    args = parser.parse_args()
    chosen = [v for v in VARIANTS if v[0] in args.variants.split(",")]
    report = {"facts": facts(), "builds": [], "calls": []}
    root = tempfile.mkdtemp(prefix="cpp_probe_")
    with ProcessPoolExecutor(max_workers=len(chosen)) as pool:
        report["builds"] = list(pool.map(build, chosen, [root] * len(chosen)))
    for built in report["builds"]:
        if not built["ok"]:
            print(f"{built['variant']}: build failed", file=sys.stderr)
            continue
        environments = ENVIRONMENTS if built["variant"] == "default" else {"plain": {}}
        for env_name, env in environments.items():
            for probe in PROBES:
                result = call(built["path"], f"probe_{built['variant']}", probe, env)
                result.update(variant=built["variant"], env=env_name, probe=probe)
                report["calls"].append(result)
                outcome = result["stdout"].split("\n")[-1] if result["rc"] == 0 else f"rc={result['rc']}"
                print(f"{built['variant']:20s} {env_name:22s} {probe:18s} {outcome}")
                for line in result["segv"][:6]:
                    print("    " + line)
    default = next((b for b in report["builds"] if b["variant"] == "default" and b["ok"]), None)
    if args.project and default is not None:
        import torch

        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        report["project"] = project_calls(default["path"], devices)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
