// The AVX2 copy of the attention inner loops (attention_kernels.h), with ATen's AVX2 Vectorized<float>.
// See isa_preamble.h for why the instruction set is enabled by a pragma, after the shared headers.
#include "isa_preamble.h"

#if ATTNOPS_ISA_PRAGMAS

#pragma GCC push_options
#pragma GCC target("avx2,avx,fma,f16c")
#include "isa_avx2_features.h"  // the feature macros the pragma does not define
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2

#define ATTNOPS_ISA isa_avx2
#include "attention_kernels.h"

#pragma GCC pop_options

namespace attnops::cpu {

const KernelTable* kernels_avx2() {
  // the instructions the pragma enabled (every AVX2 CPU also has F16C)
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return supported ? isa_avx2::table("avx2") : nullptr;
}

}  // namespace attnops::cpu

#else

namespace attnops::cpu {
const KernelTable* kernels_avx2() { return nullptr; }
}  // namespace attnops::cpu

#endif
