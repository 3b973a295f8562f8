"""Builds hookstats._C: the CPU kernels always; the CUDA kernels when torch is a CUDA build, a CUDA
toolkit is found, and they are wanted: a GPU is visible, or the build asks for them (a machine with
no GPU has no use for them, and they are most of the build time). docs/development.md has the table.

Environment:
  HOOKSTATS_CUDA=1        build the CUDA kernels even without a GPU (CI does: every .cu must compile);
                          =0 never
  TORCH_CUDA_ARCH_LIST    GPU architectures; setting it also asks for the CUDA kernels. Unset: the
                          visible GPUs' architectures, or "8.0;9.0+PTX" (A100, H100/H200, PTX for newer)
                          when HOOKSTATS_CUDA=1 and no GPU is visible
  HOOKSTATS_FORCE_CPU=1   the same as HOOKSTATS_CUDA=0 (kept for old scripts)
  CUDA_HOME               the toolkit; /usr/local/cuda is used when it is unset and exists
  MAX_JOBS                parallel compile jobs (ninja); the .cu files are split so that they can use them
"""
import glob
import os

from setuptools import find_packages, setup

if not os.environ.get("CUDA_HOME") and os.path.exists("/usr/local/cuda/bin/nvcc"):
    # torch otherwise derives the toolkit from `which nvcc`, which can point at /usr/local
    # and then fails to link -lcudart.
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def cuda_wanted() -> tuple[bool, str]:
    """Whether to compile the CUDA kernels, and why (printed by the build)."""
    if os.environ.get("HOOKSTATS_FORCE_CPU", "0") == "1" or os.environ.get("HOOKSTATS_CUDA") == "0":
        return False, "HOOKSTATS_CUDA=0 / HOOKSTATS_FORCE_CPU=1"
    if torch.version.cuda is None or CUDA_HOME is None:
        return False, "torch is a CPU build" if torch.version.cuda is None else "no CUDA toolkit (set CUDA_HOME)"
    if os.environ.get("HOOKSTATS_CUDA") == "1":
        return True, "HOOKSTATS_CUDA=1"
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return True, "TORCH_CUDA_ARCH_LIST is set"
    if torch.cuda.is_available():
        return True, "a GPU is visible"
    return False, "no GPU visible (HOOKSTATS_CUDA=1 or TORCH_CUDA_ARCH_LIST builds them anyway)"


def extension():
    sources = [os.path.join("csrc", "hookstats.cpp")] + sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp"))) \
        + sorted(glob.glob(os.path.join("csrc", "monitor", "*.cpp"))) \
        + sorted(glob.glob(os.path.join("csrc", "anomaly", "*.cpp")))
    cxx = ["-O3", "-ffp-contract=fast", "-fno-math-errno", "-fopenmp", "-fvisibility=hidden", "-Wall", "-Wno-unknown-pragmas", "-Wno-psabi"]
    link = ["-fopenmp"]  # at::parallel_for is OpenMP inline code: without it the kernels run on one thread
    want, why = cuda_wanted()
    if want:
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"  # else torch would compile every architecture
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "**", "*.cu"), recursive=True)) \
            + sorted(glob.glob(os.path.join("csrc", "anomaly", "*.cu")))
        nvcc = ["-O3", "--expt-relaxed-constexpr", "-Xcompiler", "-fno-math-errno"]
        arches = os.environ.get("TORCH_CUDA_ARCH_LIST") or "the visible GPUs'"
        print(f"hookstats: building CPU and CUDA kernels ({why}; CUDA_HOME={CUDA_HOME}, "
              f"TORCH_CUDA_ARCH_LIST={arches})")
        return CUDAExtension("hookstats._C", sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                             extra_link_args=link)
    print(f"hookstats: building CPU kernels only ({why})")
    return CppExtension("hookstats._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=link)


setup(
    packages=find_packages(include=["hookstats", "hookstats.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
