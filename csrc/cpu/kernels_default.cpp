// The portable copy of the attention inner loops (attention_kernels.h): at::vec's generic Vectorized<float>,
// compiled with the build's baseline flags. Used on CPUs without AVX2, on non-x86 hosts, and when
// ATEN_CPU_CAPABILITY=default.
#define ATTNOPS_ISA isa_default
#include "attention_kernels.h"

namespace attnops::cpu {

const KernelTable* kernels_default() { return isa_default::table("default"); }

}  // namespace attnops::cpu
