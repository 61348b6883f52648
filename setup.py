"""Build kvx and its compiled extension `kvx._C`.

The extension is torch-free (raw pointers + pybind11), so one build works with any torch.
- CPU kernels: always (host C++ compiler).
- CUDA kernels: whenever nvcc is found, with their CPU emulation (impl "cuda_sim": the kernel's source run
  on the host, so CI without a GPU executes it). KVX_CUDA=0 skips both, KVX_CUDA=1 makes a missing nvcc an
  error. KVX_CUDA_ARCHS="80;90;100;120" picks the SASS targets (PTX of the last one is embedded
  too). The CUDA runtime is linked statically, so the module imports on machines without a driver.
"""

import os
import shutil
import subprocess

import pybind11
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

# copy_sim.cu: impl "cuda_sim", the kernel body of copy_kernel.cuh compiled by nvcc as host code (CPU CI
# runs the CUDA kernel's own source); built with the kernels, absent without nvcc.
CUDA_SOURCES = [
    "csrc/cuda/copy_cuda.cu",
    "csrc/cuda/copy_sim.cu",
    "csrc/plan/copy_plan_cuda.cu",
    "csrc/plan/queues_cuda.cu",
]
# Sources nvcc compiles for their host code only (no __global__ function): one virtual arch instead of
# every SASS target skips device passes that would produce nothing (~5 s of a 2-core build).
HOST_ONLY_CUDA_SOURCES = {"csrc/cuda/copy_sim.cu", "csrc/plan/copy_plan_cuda.cu", "csrc/plan/queues_cuda.cu"}
DEFAULT_ARCHS = "80;90;100;120"


def find_nvcc():
    mode = os.environ.get("KVX_CUDA", "auto").lower()
    if mode in ("0", "off", "false", "no"):
        return None
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.realpath(c)
    if mode in ("1", "on", "true", "yes"):
        raise RuntimeError("KVX_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    return None


def cuda_roots(nvcc):
    """CUDA install roots: the one nvcc reports (it may be a wrapper script), then the usual places."""
    roots = []
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "x.cu"], capture_output=True, text=True, timeout=60)
        for line in (out.stdout + out.stderr).splitlines():
            if "TOP=" in line:
                roots.append(os.path.realpath(line.split("TOP=", 1)[1].strip()))
    except (OSError, subprocess.SubprocessError):
        pass
    roots += [os.path.dirname(os.path.dirname(nvcc)), os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    return [r for r in roots if r]


def find_cudart_static(nvcc):
    for root in cuda_roots(nvcc):
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            d = os.path.join(root, sub)
            if os.path.isfile(os.path.join(d, "libcudart_static.a")):
                return d
    raise RuntimeError(f"libcudart_static.a not found under {cuda_roots(nvcc)}")


class BuildExt(build_ext):
    def build_extensions(self):
        nvcc = find_nvcc()
        ext = self.extensions[0]
        if nvcc:
            print(f"kvx: building CUDA kernels with {nvcc}")
            ext.extra_objects += self._compile_cuda(nvcc)
            ext.define_macros.append(("KVX_WITH_CUDA", "1"))
            ext.library_dirs.append(find_cudart_static(nvcc))
            ext.libraries += ["cudart_static", "rt", "dl", "pthread"]
        else:
            print("kvx: nvcc not found or KVX_CUDA=0: building the CPU kernels only")
        super().build_extensions()

    def _compile_cuda(self, nvcc):
        archs = [a.strip() for a in os.environ.get("KVX_CUDA_ARCHS", DEFAULT_ARCHS).split(";") if a.strip()]
        gencode = []
        for a in archs:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        gencode += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
        os.makedirs(self.build_temp, exist_ok=True)
        objects = []
        for src in CUDA_SOURCES:
            obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
            targets = gencode if src not in HOST_ONLY_CUDA_SOURCES else gencode[-2:]
            cmd = [
                nvcc,
                "-c",
                src,
                "-o",
                obj,
                "-O3",
                "-std=c++17",
                "-Xcompiler",
                "-fPIC,-fvisibility=hidden",
                "-cudart",
                "static",
                "-lineinfo",
                *targets,
            ]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            objects.append(obj)
        return objects


ext = Extension(
    "kvx._C",
    sources=[
        "csrc/bindings.cpp",
        "csrc/cpu/copy_cpu.cpp",
        "csrc/cpu/crc32c.cpp",
        "csrc/plan/copy_plan.cpp",
        "csrc/plan/queues.cpp",
        "csrc/plan/bindings.cpp",
    ],
    include_dirs=[pybind11.get_include(), "csrc"],
    extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", "-pthread"],
    extra_link_args=["-pthread"],
    language="c++",
)

setup(
    packages=find_packages(include=["kvx", "kvx.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
)
