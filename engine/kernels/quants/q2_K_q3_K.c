/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). Q2_K and Q3_K: 256-element super-blocks of 2-bit values (Q3_K: plus a
 * high bit in hmask) with a scale per 16 elements. One file, because their SIMD code is one
 * kernel (q23k_row_256, branching on the type for the scales and the high bit). Block structs,
 * the Q3_K scale format, dequantization, scalar reference dot products, the AVX2 row kernel. */

typedef struct { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; } blk_q2_K;
typedef struct { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; } blk_q3_K;

_Static_assert(sizeof(blk_q2_K) == 84, "q2_K");
_Static_assert(sizeof(blk_q3_K) == 110, "q3_K");

/* Q3_K: 16 six-bit scales packed in 12 bytes -> signed values (already minus 32). */
static inline void q3k_scales(const uint8_t *s, int8_t out[16]) {
    for (int j = 0; j < 16; j++) {
        int lo = (j < 8) ? (s[j] & 0xF) : (s[j - 8] >> 4);
        int hi = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
        out[j] = (int8_t)((lo | (hi << 4)) - 32);
    }
}

/* Q3_K 12-byte scales -> 16 six-bit scales as bytes (not yet minus 32). */
static inline void q3k_unpack(const uint8_t *s, uint32_t *o0, uint32_t *o1, uint32_t *o2, uint32_t *o3) {
    uint32_t a0 = load_u32(s), a1 = load_u32(s + 4), tmp = load_u32(s + 8);
    *o0 = (a0 & 0x0f0f0f0fu) | (((tmp >> 0) & 0x03030303u) << 4);
    *o1 = (a1 & 0x0f0f0f0fu) | (((tmp >> 2) & 0x03030303u) << 4);
    *o2 = ((a0 >> 4) & 0x0f0f0f0fu) | (((tmp >> 4) & 0x03030303u) << 4);
    *o3 = ((a1 >> 4) & 0x0f0f0f0fu) | (((tmp >> 6) & 0x03030303u) << 4);
}

/* ------------------------------------------------------------------------------------------ */
/* Dequantization (ground truth)                                                               */

static void dequant_q2_K(const void *row, float *y, int n) {
    const blk_q2_K *b = row;
    for (int i = 0; i < n / QK_K; i++) {
        float d = F16(b[i].d), dmin = F16(b[i].dmin);
        const uint8_t *q = b[i].qs;
        int is = 0;
        for (int h = 0; h < 2; h++, q += 32) {
            for (int sh = 0; sh < 8; sh += 2) {
                for (int half = 0; half < 2; half++) {
                    int sc = b[i].scales[is++];
                    float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
                    for (int l = 0; l < 16; l++) *y++ = dl * (float)((q[l + 16 * half] >> sh) & 3) - ml;
                }
            }
        }
    }
}
static void dequant_q3_K(const void *row, float *y, int n) {
    const blk_q3_K *b = row;
    for (int i = 0; i < n / QK_K; i++) {
        float d = F16(b[i].d);
        int8_t sc[16];
        q3k_scales(b[i].scales, sc);
        const uint8_t *q = b[i].qs;
        int is = 0, m = 1;
        for (int h = 0; h < 2; h++, q += 32) {
            for (int sh = 0; sh < 8; sh += 2, m <<= 1) {
                for (int half = 0; half < 2; half++) {
                    float dl = d * (float)sc[is++];
                    for (int l = 0; l < 16; l++) {
                        int k = l + 16 * half;
                        int v = ((q[k] >> sh) & 3) - ((b[i].hmask[k] & m) ? 0 : 4);
                        *y++ = dl * (float)v;
                    }
                }
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Scalar reference dot products                                                               */

/* K types with 16-element scale groups: unpack 256 signed values (offset removed) + 16 int scales. */
static float dot_q2_K_ref(int n, const void *row, const rq_act *x) {
    const blk_q2_K *b = row;
    float s = 0.0f;
    uint8_t u[256];
    for (int i = 0; i < n / QK_K; i++) {
        const uint8_t *q = b[i].qs;
        uint8_t *up = u;
        for (int h = 0; h < 2; h++, q += 32)
            for (int sh = 0; sh < 8; sh += 2)
                for (int l = 0; l < 32; l++) *up++ = (q[l] >> sh) & 3;
        float d = F16(b[i].d), dmin = F16(b[i].dmin);
        int half[16];
        dot16_halves(u, x, i, half);
        for (int j = 0; j < 8; j++) {
            int blk = i * 8 + j;
            int sc0 = b[i].scales[2 * j], sc1 = b[i].scales[2 * j + 1];
            int isc = (sc0 & 0xF) * half[2 * j] + (sc1 & 0xF) * half[2 * j + 1];
            int imn = (sc0 >> 4) * x->sum16[2 * blk] + (sc1 >> 4) * x->sum16[2 * blk + 1];
            s += x->d[blk] * (d * (float)isc - dmin * (float)imn);
        }
    }
    return s;
}
static float dot_q3_K_ref(int n, const void *row, const rq_act *x) {
    const blk_q3_K *b = row;
    float s = 0.0f;
    uint8_t u[256];
    for (int i = 0; i < n / QK_K; i++) {
        const uint8_t *q = b[i].qs;
        uint8_t *up = u;
        int m = 1;
        for (int h = 0; h < 2; h++, q += 32)
            for (int sh = 0; sh < 8; sh += 2, m <<= 1)
                for (int l = 0; l < 32; l++) *up++ = (uint8_t)(((q[l] >> sh) & 3) | ((b[i].hmask[l] & m) ? 4 : 0));
        int8_t sc[16];
        q3k_scales(b[i].scales, sc);
        dot16_signed_add(u, sc, 4, F16(b[i].d), x, i, &s);   /* value = u - 4 */
    }
    return s;
}

#ifdef RQ_HAVE_X86

A256 AINL void q23k_row_256(const int t, const uint8_t *row, int n, const tile *tv, float *res, const int T) {
    const int nsb = n / QK_K;
    const int P = NPAR256(T);
    const int offs = (t == RQ_Q3_K);
    ACC_DECL_256(T);
    const __m256i m03 = _mm256_set1_epi8(3);
    for (int i = 0; i < nsb; i++) {
        const uint8_t *qs, *hm = NULL;
        __m256 wd_lo, wd_hi;
        if (t == RQ_Q3_K) {
            const blk_q3_K *x = (const blk_q3_K *)row + i;
            uint32_t a0, a1, a2, a3;
            q3k_unpack(x->scales, &a0, &a1, &a2, &a3);
            __m128i s8 = _mm_sub_epi8(_mm_set_epi32((int)a3, (int)a2, (int)a1, (int)a0), _mm_set1_epi8(32));
            __m256 d = _mm256_set1_ps(_cvtsh_ss(x->d));
            wd_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)), d);
            wd_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))), d);
            qs = x->qs;
            hm = x->hmask;
        } else {
            const blk_q2_K *x = (const blk_q2_K *)row + i;
            __m128i s8 = _mm_loadu_si128((const __m128i *)x->scales);
            __m128i lo4 = _mm_and_si128(s8, _mm_set1_epi8(15));
            __m128i hi4 = _mm_and_si128(_mm_srli_epi16(s8, 4), _mm_set1_epi8(15));
            __m256 d = _mm256_set1_ps(_cvtsh_ss(x->d)), dm = _mm256_set1_ps(-_cvtsh_ss(x->dmin));
            wd_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo4)), d);
            wd_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo4, 8))), d);
            kmin_256(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi4)), dm),
                     _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi4, 8))), dm), tv, i, T, acc[0], acc[P - 1]);
            qs = x->qs;
        }
        __m256i HM = _mm256_setzero_si256();
        if (t == RQ_Q3_K) HM = _mm256_loadu_si256((const __m256i *)hm);
        for (int h = 0; h < 2; h++) {
            __m256i Q = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
            for (int k = 0; k < 4; k++) {
                __m256i U = _mm256_and_si256(_mm256_srli_epi16(Q, 2 * k), m03);
                if (t == RQ_Q3_K) {
                    const __m256i bit = _mm256_set1_epi8((char)(1 << (4 * h + k)));
                    __m256i hb = _mm256_cmpeq_epi8(_mm256_and_si256(HM, bit), bit);
                    U = _mm256_or_si256(U, _mm256_and_si256(hb, _mm256_set1_epi8(4)));
                }
                blk_256(U, pair4_256(wd_lo, wd_hi, 8 * h + 2 * k), tv, 8 * i + 4 * h + k, T, offs, acc[k & (P - 1)]);
            }
        }
    }
    finish_256(acc, res, T);
}

KERN256(k256_q2_K, q23k_row_256, RQ_Q2_K, row, n, tv, res)
KERN256(k256_q3_K, q23k_row_256, RQ_Q3_K, row, n, tv, res)

#endif /* x86 */
