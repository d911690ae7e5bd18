"""Builds attnops._C: the operator schemas (csrc/ops.cpp) and the CPU kernels (csrc/cpu), plus, where this torch has
CUDA and nvcc is found, the CUDA kernels (csrc/cuda/*.cu: 4-bit KV decode and verify, latent-attention decode on
sm_90a) and, where FlashInfer's tvm-ffi headers are installed too, the C++ replay of FlashInfer calls
(csrc/cuda/*.cpp; build after FlashInfer to get it). torch must be installed first; build with
`pip install --no-build-isolation -e .` (an isolated build would fetch another torch). ATTNOPS_NO_CUDA=1 builds the
CPU part only.
"""
import glob
import os

from setuptools import setup
from torch.utils import cpp_extension

sources = ["csrc/ops.cpp", "csrc/python_module.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
use_cuda = cpp_extension.CUDA_HOME is not None and os.environ.get("ATTNOPS_NO_CUDA") != "1"
try:
    import torch

    use_cuda = use_cuda and torch.version.cuda is not None
except ImportError:  # pragma: no cover - setup.py needs torch
    raise SystemExit("attnops: install torch first, then build with --no-build-isolation")


def tvm_ffi_include_dirs() -> list[str]:
    """tvm-ffi's C headers (FlashInfer's dependency apache-tvm-ffi), for csrc/cuda: the CUDA kernel of
    paged_attention that replays FlashInfer calls from C++. Without them the CUDA calls stay in Python."""
    if os.environ.get("ATTNOPS_NO_FLASHINFER_REPLAY") == "1":
        return []
    try:
        from tvm_ffi import libinfo
        return sorted({libinfo.find_include_path(), libinfo.find_dlpack_include_path()})
    except Exception:
        return []


def hopper_arch_list() -> None:
    """Builds for the visible GPUs' archs (torch's default), sm_90 as sm_90a: the latent-attention kernel
    (csrc/cuda/mla_decode_sm90.cuh) uses Hopper's wgmma, which only sm_90a code has. A TORCH_CUDA_ARCH_LIST set by
    the user is kept as it is."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or not torch.cuda.is_available():
        return
    archs = sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join("9.0a" if arch == "9.0" else arch for arch in archs)


if use_cuda:
    hopper_arch_list()
replay_includes = tvm_ffi_include_dirs() if use_cuda else []
cxx_flags = ["-O3", "-std=c++17", "-fopenmp"]
if use_cuda:
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
if replay_includes:
    sources += sorted(glob.glob("csrc/cuda/*.cpp"))
    cxx_flags.append("-DATTNOPS_FLASHINFER_REPLAY")
extension = cpp_extension.CUDAExtension if use_cuda else cpp_extension.CppExtension
ext = extension(
    name="attnops._C",
    sources=sources,
    include_dirs=replay_includes,
    extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17"]} if use_cuda else cxx_flags,
    extra_link_args=["-fopenmp"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": cpp_extension.BuildExtension})
