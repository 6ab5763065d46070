/* AVX-512 intrinsics our kernels use that SIMDe 0.7.4 (Debian 12's libsimde-dev) does not
 * implement, for the SIMDe test build only (included by simd.h under RQ_SIMDE_AVX512, inside
 * its avx2/fma/f16c target region). Each computes what the instruction computes; where the
 * result depends on an operation order (the float reductions) it follows GCC's own
 * avx512fintrin.h sequence, so the emulated build gives the native build's bits.
 *
 * A new kernel that uses another intrinsic SIMDe lacks fails to compile the SIMDe build with
 * "inlining failed in call to 'always_inline' '_mm512_...': target specific option mismatch"
 * (the native one cannot be inlined into AVX2 code): add it here.
 */
#ifndef RQLLM_SIMDE_COMPAT_H
#define RQLLM_SIMDE_COMPAT_H

#include <string.h>

#define RQ_SC static inline __attribute__((always_inline))

/* ---- SIMDe 0.7.4 bug: its roundscale macros use imm8 unparenthesized ((imm8 >> 4) & 15), so
 * _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC (3 | 8) reads as scale 3 | (8 >> 4) = 3 and rounds to
 * 1/8 instead of to an integer. Pass it parenthesized. ---- */
#undef _mm_roundscale_ps
#undef _mm256_roundscale_ps
#undef _mm512_roundscale_ps
#undef _mm512_mask_roundscale_ps
#undef _mm512_maskz_roundscale_ps
#undef _mm_roundscale_pd
#undef _mm256_roundscale_pd
#undef _mm512_roundscale_pd
#define _mm_roundscale_ps(a, imm8) simde_mm_roundscale_ps((a), (imm8))
#define _mm256_roundscale_ps(a, imm8) simde_mm256_roundscale_ps((a), (imm8))
#define _mm512_roundscale_ps(a, imm8) simde_mm512_roundscale_ps((a), (imm8))
#define _mm512_mask_roundscale_ps(src, k, a, imm8) simde_mm512_mask_roundscale_ps((src), (k), (a), (imm8))
#define _mm512_maskz_roundscale_ps(k, a, imm8) simde_mm512_maskz_roundscale_ps((k), (a), (imm8))
#define _mm_roundscale_pd(a, imm8) simde_mm_roundscale_pd((a), (imm8))
#define _mm256_roundscale_pd(a, imm8) simde_mm256_roundscale_pd((a), (imm8))
#define _mm512_roundscale_pd(a, imm8) simde_mm512_roundscale_pd((a), (imm8))

/* ---- mask conversions ---- */
#define _cvtu64_mask64(a) ((simde__mmask64)(a))
#define _cvtu32_mask16(a) ((simde__mmask16)(a))
#define _cvtmask16_u32(a) ((unsigned int)(simde__mmask16)(a))

/* ---- conversions (two 256-bit halves of the native AVX2/F16C instruction, or truncation) ---- */
RQ_SC simde__m512 rq_sc_mm512_cvtepi32_ps(simde__m512i a) {
    simde__m512i_private a_ = simde__m512i_to_private(a);
    simde__m512_private r_;
    for (int h = 0; h < 2; h++) r_.m256[h] = _mm256_cvtepi32_ps(a_.m256i[h]);
    return simde__m512_from_private(r_);
}
#define _mm512_cvtepi32_ps(a) rq_sc_mm512_cvtepi32_ps(a)

RQ_SC simde__m512i rq_sc_mm512_cvttps_epi32(simde__m512 a) {
    simde__m512_private a_ = simde__m512_to_private(a);
    simde__m512i_private r_;
    for (int h = 0; h < 2; h++) r_.m256i[h] = _mm256_cvttps_epi32(a_.m256[h]);
    return simde__m512i_from_private(r_);
}
#define _mm512_cvttps_epi32(a) rq_sc_mm512_cvttps_epi32(a)

RQ_SC simde__m512i rq_sc_mm512_cvtps_epi32(simde__m512 a) {
    simde__m512_private a_ = simde__m512_to_private(a);
    simde__m512i_private r_;
    for (int h = 0; h < 2; h++) r_.m256i[h] = _mm256_cvtps_epi32(a_.m256[h]);
    return simde__m512i_from_private(r_);
}
#define _mm512_cvtps_epi32(a) rq_sc_mm512_cvtps_epi32(a)

/* The widening conversions: two 256-bit ones over the source's halves (lo, hi). */
#define RQ_SC_WIDEN_PS(name, src, widen, halves) RQ_SC_WIDEN_(name, m512, m256, src, widen, halves)
#define RQ_SC_WIDEN_EPI(name, src, widen, halves) RQ_SC_WIDEN_(name, m512i, m256i, src, widen, halves)
#define RQ_SC_WIDEN_(...) RQ_SC_WIDEN__(__VA_ARGS__)
#define RQ_SC_WIDEN__(name, vec, lane, src, widen, lo, hi) \
    RQ_SC simde__##vec rq_sc_##name(src a) {                \
        simde__##vec##_private r_;                          \
        r_.lane[0] = widen(lo);                             \
        r_.lane[1] = widen(hi);                             \
        return simde__##vec##_from_private(r_);             \
    }
#define RQ_SC_HALVES_256 _mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)
#define RQ_SC_HALVES_128 a, _mm_srli_si128(a, 8)

RQ_SC_WIDEN_PS(mm512_cvtph_ps, simde__m256i, _mm256_cvtph_ps, RQ_SC_HALVES_256)
#define _mm512_cvtph_ps(a) rq_sc_mm512_cvtph_ps(a)

#define _mm512_cvtps_ph(a, imm)                                                                   \
    __extension__({                                                                               \
        simde__m512_private a_ = simde__m512_to_private(a);                                       \
        _mm256_set_m128i(_mm256_cvtps_ph(a_.m256[1], (imm)), _mm256_cvtps_ph(a_.m256[0], (imm))); \
    })

/* 16 bytes (low 8 / high 8) -> 16 dwords; 32 bytes -> 32 words; 16 words -> 16 dwords */
RQ_SC_WIDEN_EPI(mm512_cvtepi8_epi32, simde__m128i, _mm256_cvtepi8_epi32, RQ_SC_HALVES_128)
#define _mm512_cvtepi8_epi32(a) rq_sc_mm512_cvtepi8_epi32(a)
RQ_SC_WIDEN_EPI(mm512_cvtepu8_epi32, simde__m128i, _mm256_cvtepu8_epi32, RQ_SC_HALVES_128)
#define _mm512_cvtepu8_epi32(a) rq_sc_mm512_cvtepu8_epi32(a)
RQ_SC_WIDEN_EPI(mm512_cvtepu8_epi16, simde__m256i, _mm256_cvtepu8_epi16, RQ_SC_HALVES_256)
#define _mm512_cvtepu8_epi16(a) rq_sc_mm512_cvtepu8_epi16(a)
RQ_SC_WIDEN_EPI(mm512_cvtepi16_epi32, simde__m256i, _mm256_cvtepi16_epi32, RQ_SC_HALVES_256)
#define _mm512_cvtepi16_epi32(a) rq_sc_mm512_cvtepi16_epi32(a)
RQ_SC_WIDEN_EPI(mm512_cvtepu16_epi32, simde__m256i, _mm256_cvtepu16_epi32, RQ_SC_HALVES_256)
#define _mm512_cvtepu16_epi32(a) rq_sc_mm512_cvtepu16_epi32(a)

/* vpmovdb / vpmovdw: truncate */
RQ_SC simde__m128i rq_sc_mm512_cvtepi32_epi8(simde__m512i a) {
    simde__m512i_private a_ = simde__m512i_to_private(a);
    int8_t r[16];
    for (int i = 0; i < 16; i++) r[i] = (int8_t)a_.i32[i];
    return _mm_loadu_si128((const __m128i *)r);
}
#define _mm512_cvtepi32_epi8(a) rq_sc_mm512_cvtepi32_epi8(a)

RQ_SC simde__m256i rq_sc_mm512_cvtepi32_epi16(simde__m512i a) {
    simde__m512i_private a_ = simde__m512i_to_private(a);
    int16_t r[16];
    for (int i = 0; i < 16; i++) r[i] = (int16_t)a_.i32[i];
    return _mm256_loadu_si256((const __m256i *)r);
}
#define _mm512_cvtepi32_epi16(a) rq_sc_mm512_cvtepi32_epi16(a)

/* ---- masked loads and stores: masked-off elements are not touched (may be unmapped) ---- */
#define RQ_SC_MASKZ_LOAD(name, vtype, ptype, field, ety, nel)                     \
    RQ_SC vtype rq_sc_##name(uint64_t k, const void *p) {                         \
        ptype r_;                                                                 \
        for (int i = 0; i < (nel); i++) {                                         \
            ety v = 0;                                                            \
            if ((k >> i) & 1) memcpy(&v, (const char *)p + i * sizeof(ety), sizeof(ety)); \
            r_.field[i] = v;                                                      \
        }                                                                         \
        return vtype##_from_private(r_);                                          \
    }
RQ_SC_MASKZ_LOAD(mm512_maskz_loadu_ps, simde__m512, simde__m512_private, f32, float, 16)
RQ_SC_MASKZ_LOAD(mm512_maskz_loadu_epi32, simde__m512i, simde__m512i_private, i32, int32_t, 16)
RQ_SC_MASKZ_LOAD(mm512_maskz_loadu_epi16, simde__m512i, simde__m512i_private, i16, int16_t, 32)
RQ_SC_MASKZ_LOAD(mm512_maskz_loadu_epi8, simde__m512i, simde__m512i_private, i8, int8_t, 64)
RQ_SC_MASKZ_LOAD(mm256_maskz_loadu_ps, simde__m256, simde__m256_private, f32, float, 8)
RQ_SC_MASKZ_LOAD(mm256_maskz_loadu_epi32, simde__m256i, simde__m256i_private, i32, int32_t, 8)
RQ_SC_MASKZ_LOAD(mm256_maskz_loadu_epi16, simde__m256i, simde__m256i_private, i16, int16_t, 16)
RQ_SC_MASKZ_LOAD(mm256_maskz_loadu_epi8, simde__m256i, simde__m256i_private, i8, int8_t, 32)
#define _mm512_maskz_loadu_ps(k, p) rq_sc_mm512_maskz_loadu_ps((k), (p))
#define _mm512_maskz_loadu_epi32(k, p) rq_sc_mm512_maskz_loadu_epi32((k), (p))
#define _mm512_maskz_loadu_epi16(k, p) rq_sc_mm512_maskz_loadu_epi16((k), (p))
#define _mm512_maskz_loadu_epi8(k, p) rq_sc_mm512_maskz_loadu_epi8((k), (p))
#define _mm256_maskz_loadu_ps(k, p) rq_sc_mm256_maskz_loadu_ps((k), (p))
#define _mm256_maskz_loadu_epi32(k, p) rq_sc_mm256_maskz_loadu_epi32((k), (p))
#define _mm256_maskz_loadu_epi16(k, p) rq_sc_mm256_maskz_loadu_epi16((k), (p))
#define _mm256_maskz_loadu_epi8(k, p) rq_sc_mm256_maskz_loadu_epi8((k), (p))

RQ_SC simde__m512 rq_sc_mm512_mask_loadu_ps(simde__m512 src, simde__mmask16 k, const void *p) {
    return simde_mm512_mask_mov_ps(src, k, rq_sc_mm512_maskz_loadu_ps(k, p));
}
#define _mm512_mask_loadu_ps(src, k, p) rq_sc_mm512_mask_loadu_ps((src), (k), (p))

#define RQ_SC_MASK_STORE(name, vtype, field, ety, nel)                                      \
    RQ_SC void rq_sc_##name(void *p, uint64_t k, vtype a) {                                 \
        vtype##_private a_ = vtype##_to_private(a);                                         \
        for (int i = 0; i < (nel); i++)                                                     \
            if ((k >> i) & 1) {                                                             \
                ety v = a_.field[i];                                                        \
                memcpy((char *)p + i * sizeof(ety), &v, sizeof(ety));                       \
            }                                                                               \
    }
RQ_SC_MASK_STORE(mm512_mask_storeu_ps, simde__m512, f32, float, 16)
RQ_SC_MASK_STORE(mm512_mask_storeu_epi32, simde__m512i, i32, int32_t, 16)
RQ_SC_MASK_STORE(mm256_mask_storeu_ps, simde__m256, f32, float, 8)
#define _mm512_mask_storeu_ps(p, k, a) rq_sc_mm512_mask_storeu_ps((p), (k), (a))
#define _mm512_mask_storeu_epi32(p, k, a) rq_sc_mm512_mask_storeu_epi32((p), (k), (a))
#define _mm256_mask_storeu_ps(p, k, a) rq_sc_mm256_mask_storeu_ps((p), (k), (a))

/* ---- gathers: 16 elements at base + index * scale ---- */
RQ_SC simde__m512 rq_sc_mm512_i32gather_ps(simde__m512i idx, const void *base, int scale) {
    simde__m512i_private i_ = simde__m512i_to_private(idx);
    simde__m512_private r_;
    for (int i = 0; i < 16; i++) {
        float v;
        memcpy(&v, (const char *)base + (ptrdiff_t)i_.i32[i] * scale, sizeof v);
        r_.f32[i] = v;
    }
    return simde__m512_from_private(r_);
}
RQ_SC simde__m512i rq_sc_mm512_i32gather_epi32(simde__m512i idx, const void *base, int scale) {
    simde__m512i_private i_ = simde__m512i_to_private(idx), r_;
    for (int i = 0; i < 16; i++) {
        int32_t v;
        memcpy(&v, (const char *)base + (ptrdiff_t)i_.i32[i] * scale, sizeof v);
        r_.i32[i] = v;
    }
    return simde__m512i_from_private(r_);
}
#define _mm512_i32gather_ps(idx, base, scale) rq_sc_mm512_i32gather_ps((idx), (base), (scale))
#define _mm512_i32gather_epi32(idx, base, scale) rq_sc_mm512_i32gather_epi32((idx), (base), (scale))

/* ---- compares ---- */
RQ_SC simde__mmask16 rq_sc_mm512_cmplt_epi32_mask(simde__m512i a, simde__m512i b) {
    simde__m512i_private a_ = simde__m512i_to_private(a), b_ = simde__m512i_to_private(b);
    unsigned m = 0;
    for (int i = 0; i < 16; i++) m |= (unsigned)(a_.i32[i] < b_.i32[i]) << i;
    return (simde__mmask16)m;
}
#define _mm512_cmplt_epi32_mask(a, b) rq_sc_mm512_cmplt_epi32_mask((a), (b))
#define _mm512_mask_cmplt_epi32_mask(k, a, b) ((simde__mmask16)((k) & rq_sc_mm512_cmplt_epi32_mask((a), (b))))

/* ---- reductions: GCC's avx512fintrin.h sequences (halves, quarters, then pairs) ---- */
RQ_SC float rq_sc_mm512_reduce_add_ps(simde__m512 a) {
    simde__m512_private a_ = simde__m512_to_private(a);
    __m256 t3 = _mm256_add_ps(a_.m256[1], a_.m256[0]);
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return t8[0] + t8[1];
}
#define _mm512_reduce_add_ps(a) rq_sc_mm512_reduce_add_ps(a)

#define RQ_SC_REDUCE_PS(name, op)                                                        \
    RQ_SC float rq_sc_##name(simde__m512 a) {                                            \
        simde__m512_private a_ = simde__m512_to_private(a);                              \
        __m256 t3 = _mm256_##op(a_.m256[1], a_.m256[0]);                                 \
        __m128 t6 = _mm_##op(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));  \
        __m128 t8 = _mm_##op(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));       \
        __m128 t10 = _mm_##op(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1)));      \
        return _mm_cvtss_f32(t10);                                                       \
    }
RQ_SC_REDUCE_PS(mm512_reduce_max_ps, max_ps)
RQ_SC_REDUCE_PS(mm512_reduce_min_ps, min_ps)
#define _mm512_reduce_max_ps(a) rq_sc_mm512_reduce_max_ps(a)
#define _mm512_reduce_min_ps(a) rq_sc_mm512_reduce_min_ps(a)

RQ_SC int rq_sc_mm512_reduce_add_epi32(simde__m512i a) {
    simde__m512i_private a_ = simde__m512i_to_private(a);
    uint32_t s = 0;   /* wraps like the instruction */
    for (int i = 0; i < 16; i++) s += (uint32_t)a_.i32[i];
    return (int)s;
}
#define _mm512_reduce_add_epi32(a) rq_sc_mm512_reduce_add_epi32(a)

RQ_SC int rq_sc_mm512_reduce_max_epi32(simde__m512i a) {
    simde__m512i_private a_ = simde__m512i_to_private(a);
    int32_t m = a_.i32[0];
    for (int i = 1; i < 16; i++) m = a_.i32[i] > m ? a_.i32[i] : m;
    return m;
}
#define _mm512_reduce_max_epi32(a) rq_sc_mm512_reduce_max_epi32(a)

#endif
