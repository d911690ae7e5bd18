// The AVX-512 copy of the attention inner loops (attention_kernels.h), with ATen's AVX-512 Vectorized<float>.
// See isa_preamble.h for why the instruction set is enabled by a pragma, after the shared headers.
#include "isa_preamble.h"

#if ATTNOPS_ISA_PRAGMAS

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,avx,fma,f16c")
// GCC's target pragma does not define the feature macros that vec.h and sleef.h test; a build with -mavx512f (or
// -march=native) already has them.
#ifndef __AVX512F__
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#endif
#include "isa_avx2_features.h"
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512

#define ATTNOPS_ISA isa_avx512
#include "attention_kernels.h"

#pragma GCC pop_options

namespace attnops::cpu {

const KernelTable* kernels_avx512() {
  // the instructions the pragma enabled; ATen asks for the same four AVX-512 subsets for its AVX512 kernels
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                                __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2");
  return supported ? isa_avx512::table("avx512") : nullptr;
}

}  // namespace attnops::cpu

#else

namespace attnops::cpu {
const KernelTable* kernels_avx512() { return nullptr; }
}  // namespace attnops::cpu

#endif
