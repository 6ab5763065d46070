/* x86 SIMD for the kernel sources: include this instead of <immintrin.h>.
 *
 * Gives every kernel file the same target attributes and CPU checks for its SIMD paths:
 *   A512   AVX-512 F/BW/VL/VNNI (+ FMA, F16C) functions   rq_cpu_has_avx512()
 *   AVNNI  AVX-VNNI (VEX vpdpbusd on 256-bit) functions   rq_cpu_has_avxvnni()
 * and, when built with -DRQ_SIMDE_AVX512 (the test-only extension, see tests/simde_build.py),
 * compiles both for plain AVX2 + FMA + F16C with SIMDe emulating the 512-bit and VNNI
 * intrinsics under their usual names. Then the CPU checks ask only for AVX2 + FMA + F16C, so
 * the AVX-512 and AVX-VNNI code runs (slowly) and is tested on machines without them. The kernel
 * sources themselves are the same in both builds.
 */
#ifndef RQLLM_SIMD_H
#define RQLLM_SIMD_H

#if defined(__x86_64__) || defined(__i386__)
#define RQ_HAVE_X86 1
#include <immintrin.h>

#ifdef RQ_SIMDE_AVX512
/* SIMDe picks native or emulated per instruction set from the target macros (__AVX2__ ...) at
 * its include: AVX2/FMA/F16C stay native, AVX-512 gets emulated and aliased to the _mm512_
 * names. The pragma sets those macros (and the target of SIMDe's inline functions) for this
 * block only, so the rest of each file compiles exactly as in the product build. */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include "simde_compat.h"
#pragma GCC pop_options

#define A512 __attribute__((target("avx2,fma,f16c")))
#define AVNNI __attribute__((target("avx2,fma,f16c")))
/* AVX-VNNI's VEX form computes what the AVX512VL+VNNI one does; SIMDe 0.7.4 has only the latter. */
#define _mm256_dpbusd_avx_epi32(src, a, b) _mm256_dpbusd_epi32((src), (a), (b))
#define _mm256_dpbusds_avx_epi32(src, a, b) _mm256_dpbusds_epi32((src), (a), (b))
#define _mm256_dpwssd_avx_epi32(src, a, b) _mm256_dpwssd_epi32((src), (a), (b))
#define _mm_dpbusd_avx_epi32(src, a, b) _mm_dpbusd_epi32((src), (a), (b))

static inline int rq_cpu_has_avx2_fma_f16c(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
static inline int rq_cpu_has_avx512(void) { return rq_cpu_has_avx2_fma_f16c(); }
static inline int rq_cpu_has_avxvnni(void) { return rq_cpu_has_avx2_fma_f16c(); }

#else /* native */

#define A512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#define AVNNI __attribute__((target("avxvnni,avx2,fma,f16c")))

static inline int rq_cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
static inline int rq_cpu_has_avxvnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#endif /* RQ_SIMDE_AVX512 */

#endif /* x86 */
#endif
