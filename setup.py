"""Builds hookstats._C: the CPU kernels always, the CUDA kernels when torch is a CUDA build and
a CUDA toolkit is found (no GPU is needed to compile them).

Environment:
  HOOKSTATS_FORCE_CPU=1   skip the CUDA kernels even where they could be built
  TORCH_CUDA_ARCH_LIST    GPU architectures (default "8.0;9.0+PTX": A100, H100/H200, PTX for newer)
  CUDA_HOME               the toolkit; /usr/local/cuda is used when it is unset and exists
"""
import glob
import os

from setuptools import find_packages, setup

if not os.environ.get("CUDA_HOME") and os.path.exists("/usr/local/cuda/bin/nvcc"):
    # torch otherwise derives the toolkit from `which nvcc`, which can point at /usr/local
    # and then fails to link -lcudart.
    os.environ["CUDA_HOME"] = "/usr/local/cuda"
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def build_cuda() -> bool:
    if os.environ.get("HOOKSTATS_FORCE_CPU", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def extension():
    sources = [os.path.join("csrc", "hookstats.cpp")] + sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp"))) \
        + sorted(glob.glob(os.path.join("csrc", "monitor", "*.cpp")))
    cxx = ["-O3", "-ffp-contract=fast", "-fno-math-errno", "-fopenmp", "-fvisibility=hidden", "-Wall", "-Wno-unknown-pragmas", "-Wno-psabi"]
    link = ["-fopenmp"]  # at::parallel_for is OpenMP inline code: without it the kernels run on one thread
    if build_cuda():
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        nvcc = ["-O3", "--expt-relaxed-constexpr", "-Xcompiler", "-fno-math-errno"]
        print(f"hookstats: building CPU and CUDA kernels (CUDA_HOME={CUDA_HOME}, "
              f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']})")
        return CUDAExtension("hookstats._C", sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                             extra_link_args=link)
    print("hookstats: building CPU kernels only")
    return CppExtension("hookstats._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=link)


setup(
    packages=find_packages(include=["hookstats", "hookstats.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
