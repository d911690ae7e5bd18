// Included first by the per-instruction-set kernel files (kernels_avx2.cpp, kernels_avx512.cpp), before they turn
// on wider instructions with `#pragma GCC target`.
//
// Why: setup.py compiles every source with the same flags (no -mavx2 / -mavx512f), so those files enable their
// instruction set with a pragma, for the code that follows it. Every inline function defined after the pragma is
// compiled with the wider instructions; if one of them is also defined in other translation units (a c10::Half
// conversion, a std:: template), the linker keeps a single copy, possibly this one, and a CPU without the
// instructions would crash in code that has nothing to do with these kernels. So everything that
// <ATen/cpu/vec/vec.h> depends on, apart from vec.h's own headers, is included here, before the pragma, and compiled
// for the baseline; what comes after the pragma lives in namespaces of its own: at::vec::AVX2 / at::vec::AVX512
// (ATen's CPU_CAPABILITY convention) and attnops::cpu::isa_avx2 / isa_avx512.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>

#include <ATen/AccumulateType.h>
#include <ATen/NumericUtils.h>
#include <ATen/native/Math.h>
#include <ATen/native/cpu/zmath.h>
#include <ATen/native/quantized/AffineQuantizerBase.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <c10/util/complex.h>
#include <c10/util/irange.h>

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

#include "cpu_kernels.h"

// The instruction-set copies are built with GCC's target pragma; other compilers get the portable copy only.
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define ATTNOPS_ISA_PRAGMAS 1
#else
#define ATTNOPS_ISA_PRAGMAS 0
#endif
