// See tvm_ffi_call.h. The C API is resolved with dlsym from the library the tvm_ffi Python package loaded, so that
// attnops._C neither links against tvm-ffi nor fails to import where FlashInfer is not installed.
#include "tvm_ffi_call.h"

#include <dlfcn.h>

#include <vector>

#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

namespace attnops::tvm_ffi_call {
namespace {

struct Api {
  decltype(&TVMFFIFunctionCall) function_call = nullptr;
  decltype(&TVMFFIEnvSetStream) set_stream = nullptr;
  decltype(&TVMFFIObjectIncRef) inc_ref = nullptr;
  decltype(&TVMFFIObjectDecRef) dec_ref = nullptr;
  decltype(&TVMFFIErrorMoveFromRaised) move_error = nullptr;
};
Api api;

constexpr int kMaxArgs = 64;

}  // namespace

std::string load(const std::string& path) {
  if (loaded()) return "";
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return std::string("dlopen failed: ") + dlerror();
  Api found;
  found.function_call = reinterpret_cast<decltype(found.function_call)>(dlsym(lib, "TVMFFIFunctionCall"));
  found.set_stream = reinterpret_cast<decltype(found.set_stream)>(dlsym(lib, "TVMFFIEnvSetStream"));
  found.inc_ref = reinterpret_cast<decltype(found.inc_ref)>(dlsym(lib, "TVMFFIObjectIncRef"));
  found.dec_ref = reinterpret_cast<decltype(found.dec_ref)>(dlsym(lib, "TVMFFIObjectDecRef"));
  found.move_error = reinterpret_cast<decltype(found.move_error)>(dlsym(lib, "TVMFFIErrorMoveFromRaised"));
  if (!found.function_call || !found.set_stream || !found.inc_ref || !found.dec_ref || !found.move_error) {
    return "the tvm-ffi library at " + path + " lacks part of the C API (TVMFFIFunctionCall, TVMFFIEnvSetStream...)";
  }
  api = found;
  return "";
}

bool loaded() { return api.function_call != nullptr; }

void inc_ref(void* object) { api.inc_ref(object); }
void dec_ref(void* object) { api.dec_ref(object); }

int32_t object_type_index(void* object) { return static_cast<TVMFFIObject*>(object)->type_index; }

std::string call(void* function, const Arg* args, int num_args, int device_id, void* stream) {
  if (num_args > kMaxArgs) return "too many arguments";
  DLTensor tensors[kMaxArgs];
  TVMFFIAny packed[kMaxArgs];
  for (int i = 0; i < num_args; ++i) {
    TVMFFIAny& any = packed[i];
    any.zero_padding = 0;
    any.v_int64 = 0;
    switch (args[i].kind) {
      case Arg::kNone: any.type_index = kTVMFFINone; break;
      case Arg::kInt: any.type_index = kTVMFFIInt; any.v_int64 = args[i].i; break;
      case Arg::kBool: any.type_index = kTVMFFIBool; any.v_int64 = args[i].i != 0; break;
      case Arg::kFloat: any.type_index = kTVMFFIFloat; any.v_float64 = args[i].f; break;
      case Arg::kObject:
        any.type_index = object_type_index(args[i].object);
        any.v_obj = static_cast<TVMFFIObject*>(args[i].object);
        break;
      case Arg::kTensor: {
        const TensorArg& t = args[i].tensor;
        DLTensor& dl = tensors[i];
        dl.data = t.data;
        dl.device = DLDevice{static_cast<DLDeviceType>(t.device_type), t.device_id};
        dl.ndim = t.ndim;
        dl.dtype = DLDataType{t.dtype_code, t.dtype_bits, 1};
        dl.shape = const_cast<int64_t*>(t.shape);
        dl.strides = const_cast<int64_t*>(t.strides);
        dl.byte_offset = 0;
        any.type_index = kTVMFFIDLTensorPtr;
        any.v_ptr = &dl;
        break;
      }
    }
  }
  TVMFFIStreamHandle previous = nullptr;
  if (api.set_stream(kDLCUDA, device_id, stream, &previous) != 0) return "TVMFFIEnvSetStream failed";
  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  const int rc = api.function_call(function, packed, num_args, &result);
  api.set_stream(kDLCUDA, device_id, previous, nullptr);
  if (rc != 0) {
    TVMFFIObjectHandle error = nullptr;
    api.move_error(&error);
    std::string message = "tvm-ffi call failed";
    if (error != nullptr) {
      const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(error);
      message = std::string(cell->kind.data, cell->kind.size) + ": " + std::string(cell->message.data, cell->message.size);
      api.dec_ref(error);
    }
    return message;
  }
  if (result.type_index >= kTVMFFIStaticObjectBegin) api.dec_ref(result.v_obj);
  return "";
}

}  // namespace attnops::tvm_ffi_call
