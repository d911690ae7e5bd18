"""Builds attnops._C: the operator schemas (csrc/ops.cpp) and the CPU kernels (csrc/cpu), plus CUDA sources
(csrc/cuda) where this torch has CUDA and nvcc is there. torch must be installed first; build with
`pip install --no-build-isolation -e .` (an isolated build would fetch another torch)."""
import glob
import os

from setuptools import setup
from torch.utils import cpp_extension

sources = ["csrc/ops.cpp", "csrc/python_module.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
use_cuda = bool(cuda_sources) and cpp_extension.CUDA_HOME is not None and os.environ.get("ATTNOPS_NO_CUDA") != "1"
try:
    import torch

    use_cuda = use_cuda and torch.version.cuda is not None
except ImportError:  # pragma: no cover - setup.py needs torch
    raise SystemExit("attnops: install torch first, then build with --no-build-isolation")

cxx_flags = ["-O3", "-std=c++17", "-fopenmp"]
extension = cpp_extension.CUDAExtension if use_cuda else cpp_extension.CppExtension
ext = extension(
    name="attnops._C",
    sources=sources + (cuda_sources if use_cuda else []),
    extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17"]} if use_cuda else cxx_flags,
    extra_link_args=["-fopenmp"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": cpp_extension.BuildExtension})
