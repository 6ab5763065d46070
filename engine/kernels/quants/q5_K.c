/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). Q5_K: Q4_K's super-blocks with a fifth bit per value (qh). Block struct,
 * dequantization, scalar reference dot product, the AVX2 row kernel. */

typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } blk_q5_K;
_Static_assert(sizeof(blk_q5_K) == 176, "q5_K");

/* ------------------------------------------------------------------------------------------ */
/* Dequantization (ground truth)                                                               */

static void dequant_q5_K(const void *row, float *y, int n) {
    const blk_q5_K *b = row;
    for (int i = 0; i < n / QK_K; i++) {
        float d = F16(b[i].d), dmin = F16(b[i].dmin);
        const uint8_t *q = b[i].qs;
        for (int c = 0; c < 4; c++, q += 32) {
            int sc, m;
            scale_min_k4(2 * c, b[i].scales, &sc, &m);
            float d1 = d * (float)sc, m1 = dmin * (float)m;
            scale_min_k4(2 * c + 1, b[i].scales, &sc, &m);
            float d2 = d * (float)sc, m2 = dmin * (float)m;
            for (int l = 0; l < 32; l++)
                *y++ = d1 * (float)((q[l] & 0xF) | (((b[i].qh[l] >> (2 * c)) & 1) << 4)) - m1;
            for (int l = 0; l < 32; l++)
                *y++ = d2 * (float)((q[l] >> 4) | (((b[i].qh[l] >> (2 * c + 1)) & 1) << 4)) - m2;
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Scalar reference dot product                                                                */

static float dot_q5_K_ref(int n, const void *row, const rq_act *x) {
    const blk_q5_K *b = row;
    float s = 0.0f;
    uint8_t u[32];
    for (int i = 0; i < n / QK_K; i++) {
        float d = F16(b[i].d), dmin = F16(b[i].dmin);
        for (int j = 0; j < 8; j++) {
            const uint8_t *q = b[i].qs + 32 * (j / 2);
            for (int l = 0; l < 32; l++)
                u[l] = (uint8_t)(((j & 1) ? (q[l] >> 4) : (q[l] & 0xF)) | (((b[i].qh[l] >> j) & 1) << 4));
            int sc, m;
            scale_min_k4(j, b[i].scales, &sc, &m);
            int blk = i * 8 + j;
            int S = x->sum16[2 * blk] + x->sum16[2 * blk + 1];
            int isum = dot32_u(u, x->qs + 32 * blk);
            s += x->d[blk] * (d * (float)(sc * isum) - dmin * (float)(m * S));
        }
    }
    return s;
}

#ifdef RQ_HAVE_X86

/* One row against a tile of T <= 4 tokens, one 32-element block per vector (blk_256). */
A256 AINL void q5k_row_256(const uint8_t *row, int n, const tile *tv, float *res, const int T) {
    const int nsb = n / QK_K;
    const int P = NPAR256(T);
    ACC_DECL_256(T);
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < nsb; i++) {
        const blk_q5_K *sb = (const blk_q5_K *)row + i;
        const uint8_t *qs = sb->qs, *qh = sb->qh, *scales = sb->scales;
        const uint16_t dh = sb->d, dminh = sb->dmin;
        uint32_t u0, u1, u2, u3;
        k4_unpack(scales, &u0, &u1, &u2, &u3);
        __m128i v = _mm_set_epi32((int)u3, (int)u2, (int)u1, (int)u0);
        __m256 dsc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_set1_ps(_cvtsh_ss(dh)));
        __m256 dmn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))),
                                   _mm256_set1_ps(-_cvtsh_ss(dminh)));
        kmin_256(_mm256_permutevar8x32_ps(dmn, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)),
                 _mm256_permutevar8x32_ps(dmn, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)), tv, i, T, acc[0], acc[P - 1]);
        __m256i H = _mm256_loadu_si256((const __m256i *)qh);
        for (int c = 0; c < 4; c++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            for (int e = 0; e < 2; e++) {
                const int j = 2 * c + e;
                __m256i U = _mm256_and_si256(e ? _mm256_srli_epi16(x, 4) : x, m0f);
                const __m256i bit = _mm256_set1_epi8((char)(1 << j));
                __m256i hb = _mm256_cmpeq_epi8(_mm256_and_si256(H, bit), bit);
                U = _mm256_or_si256(U, _mm256_and_si256(hb, _mm256_set1_epi8(16)));
                __m256 WD = _mm256_permutevar8x32_ps(dsc, _mm256_set1_epi32(j));
                blk_256(U, WD, tv, 8 * i + j, T, 0, acc[e & (P - 1)]);
            }
        }
    }
    finish_256(acc, res, T);
}

KERN256(k256_q5_K, q5k_row_256, row, n, tv, res)

#endif /* x86 */
