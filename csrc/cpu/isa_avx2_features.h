// The feature macros of AVX2 + FMA + F16C, for a file that enables them with `#pragma GCC target`: GCC's target
// pragma does not define the macros that vec.h and sleef.h test (a build with -mavx2 or -march=native already has
// them). Included by kernels_avx2.cpp and kernels_avx512.cpp (AVX-512 implies these), after their pragma.
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
