// Calling a tvm-ffi function (FlashInfer's JIT-built kernels are tvm-ffi modules) from C++ with no Python in between.
// This header names neither torch nor DLPack, so that torch's DLPack header and tvm-ffi's never meet in one file.
#pragma once

#include <cstdint>
#include <string>

namespace attnops::tvm_ffi_call {

// A tensor argument, as DLPack describes it (the caller keeps shape and strides alive through the call).
struct TensorArg {
  void* data = nullptr;
  int32_t device_type = 0;  // DLPack's kDLCUDA is 2
  int32_t device_id = 0;
  int32_t ndim = 0;
  uint8_t dtype_code = 0;  // DLPack's kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4
  uint8_t dtype_bits = 0;
  const int64_t* shape = nullptr;
  const int64_t* strides = nullptr;
};

struct Arg {
  enum Kind : uint8_t { kNone, kInt, kBool, kFloat, kTensor, kObject } kind = kNone;
  int64_t i = 0;          // kInt, kBool
  double f = 0.0;         // kFloat
  TensorArg tensor;       // kTensor
  void* object = nullptr; // kObject: a tvm-ffi object handle (an Array, say), owned by the caller
};

// Resolves the tvm-ffi C API from the library at `path` (already loaded by the tvm_ffi Python package). Returns
// an empty string on success, else what went wrong.
std::string load(const std::string& path);
bool loaded();

void inc_ref(void* object);
void dec_ref(void* object);
// The type index of a tvm-ffi object handle (what an argument slot holding it must say).
int32_t object_type_index(void* object);

// Calls `function` (a tvm-ffi Function handle) with `args` while `stream` is tvm-ffi's current stream for CUDA
// device `device_id` (FlashInfer launches on that stream). Returns an empty string on success, else the error.
std::string call(void* function, const Arg* args, int num_args, int device_id, void* stream);

}  // namespace attnops::tvm_ffi_call
