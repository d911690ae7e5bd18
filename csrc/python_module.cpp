// Only in the Python build (setup.py): the module `attnops._C`. Importing it loads the library, whose static
// initializers run TORCH_LIBRARY; in CUDA builds with FlashInfer's tvm-ffi present it also carries the CUDA kernel
// of paged_attention (csrc/cuda/flashinfer_replay.cpp) and its bindings. The CMake build for C++ users leaves this
// file out.
#include <torch/extension.h>

#ifdef ATTNOPS_FLASHINFER_REPLAY
namespace attnops::flashinfer_replay {
void bind(pybind11::module_& m);
}
#endif

PYBIND11_MODULE(_C, m) {
#ifdef ATTNOPS_FLASHINFER_REPLAY
  m.attr("has_flashinfer_replay") = true;
  attnops::flashinfer_replay::bind(m);
#else
  m.attr("has_flashinfer_replay") = false;
#endif
}
