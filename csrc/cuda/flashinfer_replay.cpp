// The CUDA kernel of attnops::paged_attention in the Python package, when FlashInfer's tvm-ffi is there at build time.
//
// Every call goes to the Python implementation (attnops/ops.py: validation, dispatch, the backend), except one
// kind: a call that FlashInfer served in this step before, with arguments of the same shapes, strides, dtypes and
// devices. For those, attnops/backends/flashinfer_replay.py recorded the arguments that FlashInfer's run() handed
// its JIT-built kernel (the "paged_run" tvm-ffi function) and armed an entry here; the call replays them with this
// call's q, caches and out swapped in. That skips the Python of every later call (FlashInfer's run() alone is most of
// it) where launch cost dominates: benchmarks/overhead.py measures it.
//
// An entry applies only while everything the Python path would decide from stays the same: the argument signature
// (what validation and dispatch read), the step's metadata tensors (same objects, not written since: the plan
// FlashInfer made for them), the thread that armed it (backend pinning is per thread), ATTNOPS_BACKEND and
// ATTNOPS_CHECK, and no CUDA graph capture in progress. Python disarms an entry before it re-plans its wrapper.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <pybind11/stl.h>
#include <torch/extension.h>
#include <torch/library.h>

#include "tvm_ffi_call.h"

namespace attnops::flashinfer_replay {
namespace {

namespace tvm = attnops::tvm_ffi_call;
namespace py = pybind11;

// What validation and dispatch read from one tensor argument (None: undefined).
struct TensorSignature {
  bool defined = false;
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device = c10::Device(c10::DeviceType::CPU);

  static TensorSignature of(const at::Tensor* t) {
    TensorSignature s;
    if (t == nullptr || !t->defined()) return s;
    s.defined = true;
    s.sizes = t->sizes().vec();
    s.strides = t->strides().vec();
    s.dtype = t->scalar_type();
    s.device = t->device();
    return s;
  }
  bool matches(const at::Tensor* t) const {
    if (t == nullptr || !t->defined()) return !defined;
    return defined && t->scalar_type() == dtype && t->device() == device && t->sizes().equals(sizes) &&
           t->strides().equals(strides);
  }
};

struct OpArgs {
  const at::Tensor &q, &k_cache, &v_cache, &block_table, &seq_lens;
  const std::optional<at::Tensor>& cu_seqlens_q;
  std::optional<double> scale;
  double soft_cap;
  int64_t window_left;
  c10::string_view kv_format;
  const std::optional<at::Tensor>&k_scale, &v_scale, &sinks, &tree_mask;
  const at::Tensor& out;

  std::array<const at::Tensor*, 9> tensors() const {
    auto opt = [](const std::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; };
    return {&q, &k_cache, &v_cache, &block_table, &seq_lens, opt(cu_seqlens_q), opt(k_scale), opt(v_scale), &out};
  }
  std::array<const at::Tensor*, 3> step_tensors() const {
    return {&block_table, &seq_lens, cu_seqlens_q.has_value() ? &*cu_seqlens_q : nullptr};
  }
};

int64_t version_of(const at::Tensor& t) {
  return t.is_inference() ? -1 : static_cast<int64_t>(t.unsafeGetTensorImpl()->version_counter().current_version());
}

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

// A call's own q, k_cache, v_cache or out, as a kernel argument: CUDA tensors of a bf16/fp16 case (the only cases
// Python arms; FlashInfer's own buffers travel as tvm-ffi objects).
tvm::TensorArg tensor_arg(const at::Tensor& t) {
  tvm::TensorArg a;
  a.data = t.data_ptr();
  a.device_type = 2;  // kDLCUDA
  a.device_id = t.get_device();
  a.ndim = static_cast<int32_t>(t.dim());
  a.shape = t.sizes().data();
  a.strides = t.strides().data();
  switch (t.scalar_type()) {
    case at::kBFloat16: a.dtype_code = 4; a.dtype_bits = 16; break;  // kDLBfloat
    case at::kHalf: a.dtype_code = 2; a.dtype_bits = 16; break;      // kDLFloat
    default: TORCH_CHECK(false, "attnops FlashInfer replay: unsupported tensor dtype ", t.scalar_type());
  }
  return a;
}

// One armed FlashInfer call.
struct Entry {
  int64_t slot = 0;  // the Python side's id for the wrapper (one entry per wrapper: its current plan)
  std::array<TensorSignature, 9> signature;
  std::optional<double> scale;
  double soft_cap = 0.0;
  int64_t window_left = -1;
  std::string kv_format;
  std::array<std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>>, 3> step;
  std::array<int64_t, 3> step_versions{};
  std::thread::id thread;
  std::string env_backend, env_check;

  void* function = nullptr;           // tvm-ffi Function, one reference held
  std::vector<tvm::Arg> args;         // the recorded call; kTensor slots of q/k/v/out are refilled per call
  std::array<int, 4> slot_positions;  // where q, k_cache, v_cache, out go in args
  std::vector<void*> objects;         // tvm-ffi objects (FlashInfer's buffers as ffi.Tensor, the plan info), one
                                      // reference each

  Entry() = default;
  Entry(const Entry&) = delete;
  Entry& operator=(const Entry&) = delete;
  ~Entry() {
    if (!tvm::loaded()) return;
    if (function != nullptr) tvm::dec_ref(function);
    for (void* object : objects) tvm::dec_ref(object);
  }

  // What this entry applies to: calls like `a` (the call it was armed in), on this thread.
  void bind(const OpArgs& a) {
    const auto op_tensors = a.tensors();
    for (size_t i = 0; i < op_tensors.size(); ++i) signature[i] = TensorSignature::of(op_tensors[i]);
    scale = a.scale;
    soft_cap = a.soft_cap;
    window_left = a.window_left;
    kv_format = std::string(a.kv_format);
    const auto step_ = a.step_tensors();
    for (size_t i = 0; i < step_.size(); ++i) {
      if (step_[i] == nullptr) continue;
      step[i].emplace(step_[i]->getIntrusivePtr());
      step_versions[i] = version_of(*step_[i]);
    }
    thread = std::this_thread::get_id();
    env_backend = env("ATTNOPS_BACKEND");
    env_check = env("ATTNOPS_CHECK");
  }

  bool matches(const OpArgs& a) const {
    if (std::this_thread::get_id() != thread) return false;
    const auto tensors_ = a.tensors();
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (!signature[i].matches(tensors_[i])) return false;
    }
    if (a.scale != scale || a.soft_cap != soft_cap || a.window_left != window_left || a.kv_format != kv_format) {
      return false;
    }
    const auto step_ = a.step_tensors();
    for (size_t i = 0; i < step_.size(); ++i) {
      if ((step_[i] != nullptr) != step[i].has_value()) return false;
      if (step_[i] == nullptr) continue;
      // a weak reference keeps the TensorImpl's memory, so an equal address is the same live tensor
      if (step[i]->_unsafe_get_target() != step_[i]->unsafeGetTensorImpl() || version_of(*step_[i]) != step_versions[i]) {
        return false;
      }
    }
    return env("ATTNOPS_BACKEND") == env_backend && env("ATTNOPS_CHECK") == env_check;
  }
};

std::mutex table_mutex;
// Never freed: entries hold tvm-ffi references, which must not be dropped after the library has shut down.
auto& table = *new std::vector<std::unique_ptr<Entry>>();
// Armed by Python during the call this thread is running; the kernel binds it to that call's arguments.
thread_local std::unique_ptr<Entry> pending;
std::atomic<int64_t> armed{0}, hits{0}, misses{0}, replay_errors{0};
py::object* python_impl = nullptr;  // attnops.ops._run_paged_attention, set at import (never freed: outlives Python)

void insert(std::unique_ptr<Entry> entry) {
  std::lock_guard<std::mutex> lock(table_mutex);
  for (auto& existing : table) {
    if (existing->slot == entry->slot) {
      existing = std::move(entry);
      return;
    }
  }
  table.push_back(std::move(entry));
  armed.store(static_cast<int64_t>(table.size()));
}

// Replays an armed entry for these arguments; false when none applies.
bool replay(const OpArgs& a) {
  // after a failed replay, every call goes through Python for the rest of the process
  if (armed.load(std::memory_order_relaxed) == 0 || replay_errors.load(std::memory_order_relaxed) != 0) return false;
  // FlashInfer serves neither sinks nor tree masks (attnops/backends/flashinfer.py declines them): never armed
  if (a.sinks.has_value() || a.tree_mask.has_value()) return false;
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return false;
  std::lock_guard<std::mutex> lock(table_mutex);
  for (const auto& entry : table) {
    if (!entry->matches(a)) continue;
    std::vector<tvm::Arg> args = entry->args;
    const at::Tensor* slots[4] = {&a.q, &a.k_cache, &a.v_cache, &a.out};
    for (int i = 0; i < 4; ++i) args[entry->slot_positions[i]].tensor = tensor_arg(*slots[i]);
    c10::cuda::CUDAGuard guard(a.q.device());
    const std::string error = tvm::call(entry->function, args.data(), static_cast<int>(args.size()),
                                        a.q.get_device(), c10::cuda::getCurrentCUDAStream().stream());
    if (!error.empty()) {
      // FlashInfer rejected the replayed call (an argument convention this file does not know): drop the entry
      // and let Python serve the call, which surfaces any error that is real
      TORCH_WARN_ONCE("attnops: a replayed FlashInfer call failed; FlashInfer calls go through Python: ", error);
      replay_errors.fetch_add(1, std::memory_order_relaxed);
      table.erase(std::find(table.begin(), table.end(), entry));
      armed.store(static_cast<int64_t>(table.size()));
      return false;
    }
    hits.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  return false;
}

void paged_attention_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_table, const at::Tensor& seq_lens,
                         const std::optional<at::Tensor>& cu_seqlens_q, std::optional<double> scale, double soft_cap,
                         int64_t window_left, c10::string_view kv_format, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& sinks,
                         const std::optional<at::Tensor>& tree_mask, at::Tensor& out) {
  const OpArgs a{q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left, kv_format,
                 k_scale, v_scale, sinks, tree_mask, out};
  if (replay(a)) return;
  misses.fetch_add(1, std::memory_order_relaxed);
  TORCH_CHECK(python_impl != nullptr, "attnops: the Python implementation of paged_attention is not registered "
                                      "(import attnops first)");
  pending.reset();
  {
    py::gil_scoped_acquire gil;
    (*python_impl)(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                   std::string(kv_format), k_scale, v_scale, sinks, tree_mask, out);
  }
  if (pending) {
    pending->bind(a);
    insert(std::move(pending));
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens,
                           const std::optional<at::Tensor>& cu_seqlens_q, std::optional<double> scale, double soft_cap,
                           int64_t window_left, c10::string_view kv_format, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& sinks,
                           const std::optional<at::Tensor>& tree_mask) {
  at::Tensor out = at::empty_like(q);
  paged_attention_out(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                      kv_format, k_scale, v_scale, sinks, tree_mask, out);
  return out;
}

// Arms the entry of wrapper `slot` with the kernel call FlashInfer's run() just made, for the op call in progress on
// this thread (paged_attention_out binds it to that call's arguments when Python returns). `kinds` says, per kernel
// argument, where its value comes from: 0 None, 1 int (next of ints), 2 bool (next of ints), 3 float (next of
// floats), 5 tvm-ffi object handle (next of objects), 10-13 the call's q, k_cache, v_cache, out.
void arm(int64_t slot, int64_t function, const std::vector<int64_t>& kinds, const std::vector<int64_t>& ints,
         const std::vector<double>& floats, const std::vector<int64_t>& objects) {
  TORCH_CHECK(tvm::loaded(), "attnops FlashInfer replay: call flashinfer_replay_load first");
  auto entry = std::make_unique<Entry>();
  entry->slot = slot;
  entry->function = reinterpret_cast<void*>(function);
  tvm::inc_ref(entry->function);
  entry->slot_positions.fill(-1);
  size_t next_int = 0, next_float = 0, next_object = 0;
  for (size_t i = 0; i < kinds.size(); ++i) {
    tvm::Arg arg;
    const int64_t kind = kinds[i];
    if (kind == 0) {
      arg.kind = tvm::Arg::kNone;
    } else if (kind == 1 || kind == 2) {
      TORCH_CHECK(next_int < ints.size(), "attnops FlashInfer replay: too few ints");
      arg.kind = kind == 1 ? tvm::Arg::kInt : tvm::Arg::kBool;
      arg.i = ints[next_int++];
    } else if (kind == 3) {
      TORCH_CHECK(next_float < floats.size(), "attnops FlashInfer replay: too few floats");
      arg.kind = tvm::Arg::kFloat;
      arg.f = floats[next_float++];
    } else if (kind == 5) {
      TORCH_CHECK(next_object < objects.size(), "attnops FlashInfer replay: too few objects");
      arg.kind = tvm::Arg::kObject;
      arg.object = reinterpret_cast<void*>(objects[next_object++]);
      tvm::inc_ref(arg.object);
      entry->objects.push_back(arg.object);
    } else if (kind >= 10 && kind <= 13) {
      arg.kind = tvm::Arg::kTensor;
      entry->slot_positions[kind - 10] = static_cast<int>(i);
    } else {
      TORCH_CHECK(false, "attnops FlashInfer replay: unknown argument kind ", kind);
    }
    entry->args.push_back(arg);
  }
  for (int position : entry->slot_positions) {
    TORCH_CHECK(position >= 0, "attnops FlashInfer replay: the recorded call lacks one of q, k_cache, v_cache, out");
  }
  pending = std::move(entry);
}

void disarm(int64_t slot) {
  std::lock_guard<std::mutex> lock(table_mutex);
  for (auto it = table.begin(); it != table.end(); ++it) {
    if ((*it)->slot == slot) {
      table.erase(it);
      break;
    }
  }
  armed.store(static_cast<int64_t>(table.size()));
}

void clear() {
  std::lock_guard<std::mutex> lock(table_mutex);
  table.clear();
  armed.store(0);
}

}  // namespace

void bind(py::module_& m) {
  m.def("set_paged_attention_python_impl", [](py::object impl) { python_impl = new py::object(std::move(impl)); },
        "the Python implementation the CUDA kernel calls for every call it does not replay");
  m.def("flashinfer_replay_load", [](const std::string& path) { return tvm::load(path); },
        "resolve the tvm-ffi C API from this library; returns '' or the error");
  m.def("flashinfer_replay_arm", &arm);
  m.def("flashinfer_replay_disarm", &disarm);
  m.def("flashinfer_replay_clear", &clear);
  m.def("flashinfer_replay_stats", []() {
    return py::dict(py::arg("armed") = armed.load(), py::arg("hits") = hits.load(), py::arg("misses") = misses.load(),
                    py::arg("errors") = replay_errors.load());
  });
}

TORCH_LIBRARY_IMPL(attnops, CUDA, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention.out", &paged_attention_out);
}

}  // namespace attnops::flashinfer_replay
