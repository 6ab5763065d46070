/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). Q4_K: 256-element super-blocks of 8 blocks of 32, 4-bit values with a 6-bit
 * (scale, min) pair per block (the 12-byte format in common.c, shared with Q5_K). Block struct,
 * dequantization, scalar reference dot product, R16 unit and repacking, AVX2 slot and 4-row
 * decode kernels, prefill unpacking and kernel, R16 block loading and kernels.
 *
 * The Q4_K float sequence. Every SIMD kernel computes each (row, token) result in this order,
 * so results do not depend on the kernel, the path, the tile or the thread count. The token's
 * activations have one scale D_k per super-block (rq_act span 256, as ggml's Q8_K):
 *     for each super-block i (row scale d_i, min scale dmin_i):
 *         I    = sum of P_b * sc_b over its 8 blocks b        int32, exact: P_b the exact integer sum
 *                                                           of block b's 32 products with token k,
 *                                                           sc_b its 6-bit scale (|I| <= 8 x 32 x
 *                                                           15 x 127 x 63 < 2^31)
 *         acc  = fma(float(I), d_i * D_k, acc)
 *         for each block b (6-bit min m_b), in order:
 *             accM = fma(float(m_b) * -dmin_i, D_k * S_k(b), accM)    S_k(b): the block's q sum
 *     result = acc + accM
 * One conversion and one FMA per super-block instead of one per block: the block sums add up in
 * integers (Zen 3, AVX2, prefill tiles of 8 tokens: 1.10-1.11x the kernel that applied D_k block by
 * block, with activation scales per 32). */

typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } blk_q4_K;
_Static_assert(sizeof(blk_q4_K) == 144, "q4_K");

/* ------------------------------------------------------------------------------------------ */
/* Dequantization (ground truth)                                                               */

/* Q4_K and Q5_K differ only in Q5_K's fifth bits (qh): their scalar references are one body, with
 * qh NULL for Q4_K. Value l of block j of a super-block: */
static inline int k45_value(const uint8_t *qs, const uint8_t *qh, int j, int l) {
    const uint8_t q = qs[32 * (j / 2) + l];
    return ((j & 1) ? q >> 4 : q & 0xF) | (qh ? ((qh[l] >> j) & 1) << 4 : 0);
}

/* A super-block's fields, wherever its type keeps them. */
typedef struct { uint16_t d, dmin; const uint8_t *scales, *qs, *qh; } k45_block;

static void dequant_k45(const k45_block *b, float *y) {
    const float d = F16(b->d), dmin = F16(b->dmin);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, b->scales, &sc, &m);
        const float dj = d * (float)sc, mj = dmin * (float)m;
        for (int l = 0; l < 32; l++) *y++ = dj * (float)k45_value(b->qs, b->qh, j, l) - mj;
    }
}

/* Add super-block i to *s. */
static void dot_k45_add(const k45_block *b, const rq_act *x, int i, float *s) {
    const float d = F16(b->d), dmin = F16(b->dmin);
    uint8_t u[32];
    for (int j = 0; j < 8; j++) {
        for (int l = 0; l < 32; l++) u[l] = (uint8_t)k45_value(b->qs, b->qh, j, l);
        int sc, m;
        scale_min_k4(j, b->scales, &sc, &m);
        int blk = i * 8 + j;
        int S = x->sum16[2 * blk] + x->sum16[2 * blk + 1];
        int isum = dot32_u(u, x->qs + 32 * blk);
        *s += x->d[blk] * (d * (float)(sc * isum) - dmin * (float)(m * S));
    }
}

static inline k45_block q4k_fields(const blk_q4_K *b) { return (k45_block){b->d, b->dmin, b->scales, b->qs, NULL}; }

static void dequant_q4_K(const void *row, float *y, int n) {
    const blk_q4_K *b = row;
    for (int i = 0; i < n / QK_K; i++, y += QK_K) {
        const k45_block f = q4k_fields(&b[i]);
        dequant_k45(&f, y);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Scalar reference dot product                                                                */

static float dot_q4_K_ref(int n, const void *row, const rq_act *x) {
    const blk_q4_K *b = row;
    float s = 0.0f;
    uint8_t u[32];
    for (int i = 0; i < n / QK_K; i++) {
        const k45_block f = q4k_fields(&b[i]);
        int I = 0, M = 0;   /* sum of sc_b * P_b, of m_b * S_b */
        for (int j = 0; j < 8; j++) {
            for (int l = 0; l < 32; l++) u[l] = (uint8_t)k45_value(f.qs, NULL, j, l);
            int sc, m;
            scale_min_k4(j, f.scales, &sc, &m);
            const int blk = 8 * i + j;
            I += sc * dot32_u(u, x->qs + 32 * blk);
            M += m * (x->sum16[2 * blk] + x->sum16[2 * blk + 1]);
        }
        s += x->d[8 * i] * (F16(f.d) * (float)I - F16(f.dmin) * (float)M);   /* d[8i .. 8i+7]: one scale */
    }
    return s;
}

/* ------------------------------------------------------------------------------------------ */
/* R16 (see r16_layout.c): a unit is one super-block of 8 blocks                               */

/*   Q4_K: NIB [8 j][4 g][16] | KD [16] f16 | KDM [16] f16 | KSC [8 j][16] u8 | KMN [8 j][16] u8 */
static inline void r16_layout_q4k(r16_ptrs *p) {
    p->bpu = 8; p->nib = 0; p->kd = 2048; p->kdm = 2080; p->ksc = 2112; p->kmn = 2240; p->ub = 2368;
}

/* One super-block of Q4_K or Q5_K (whose d, dmin, scales and qs are alike; qh: Q5_K's fifth bits,
 * NULL for Q4_K) of row r (0..15) into the group's unit u. */
static void r16_repack_unit_k45(const uint8_t *u, const r16_ptrs *p, int r, uint16_t d, uint16_t dmin,
                                const uint8_t *scales, const uint8_t *qs4, const uint8_t *qh) {
    uint8_t q[32];
    r16_w16(u + p->kd, r, d);
    r16_w16(u + p->kdm, r, dmin);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        scale_min_k4(j, scales, &sc, &mn);
        ((uint8_t *)u)[p->ksc + 16 * j + r] = (uint8_t)sc;
        ((uint8_t *)u)[p->kmn + 16 * j + r] = (uint8_t)mn;
        const uint8_t *qs = qs4 + 32 * (j / 2);
        for (int l = 0; l < 32; l++) q[l] = (j & 1) ? (qs[l] >> 4) : (qs[l] & 0xF);
        uint32_t hb = 0;
        for (int g = 0; g < 4; g++) {
            uint32_t v = 0;
            for (int i = 0; i < 4; i++) v |= (uint32_t)(q[4 * g + i] | (q[16 + 4 * g + i] << 4)) << (8 * i);
            r16_w32(u + p->nib + 64 * (4 * j + g), r, v);
            if (qh)   /* HB bit 8i + 4h + g: the fifth bit of element 16h + 4g + i */
                for (int h = 0; h < 2; h++)
                    for (int i = 0; i < 4; i++) hb |= (uint32_t)((qh[16 * h + 4 * g + i] >> j) & 1) << (8 * i + 4 * h + g);
        }
        if (qh) r16_w32(u + p->hb + 64 * j, r, hb);
    }
}

/* Row r (0..15) of a group: its super-blocks' bits, scales and mins into the group's units. */
static void r16_repack_row_q4k(const uint8_t *row, int nb, const r16_ptrs *p, int r) {
    for (int s = 0; s < nb / 8; s++) {
        const blk_q4_K *x = (const blk_q4_K *)row + s;
        r16_repack_unit_k45(p->g + (size_t)s * p->ub, p, r, x->d, x->dmin, x->scales, x->qs, NULL);
    }
}

#ifdef RQ_HAVE_X86

/* Q4_K super-block x: its 8 block scales (integers, as floats) and its 8 block mins times -dmin. */
A256 AINL void q4k_scales_256(const blk_q4_K *x, __m256 *sc, __m256 *dmn) {
    uint32_t u0, u1, u2, u3;
    k4_unpack(x->scales, &u0, &u1, &u2, &u3);
    __m128i v = _mm_set_epi32((int)u3, (int)u2, (int)u1, (int)u0);
    *sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    *dmn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))),
                         _mm256_set1_ps(-_cvtsh_ss(x->dmin)));
}

/* Block scales (0..63, one per int32 lane) in both int16 halves of each lane: the vpmaddwd operand
 * that turns a lane's two int16 sums into sc_b * P_b. */
A256 AINL __m256i k4_scale_pairs_256(__m256i sc) { return _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16)); }

/* One row against T <= 4 tokens: lane 4h + k holds token k (both h the same after joining halves). */
A256 AINL void q4k_slots_256(const uint8_t *row, int n, const tile *tv, float *res, const int T) {
    const int nsb = n / QK_K;
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps(), accM = _mm256_setzero_ps();
    for (int i = 0; i < nsb; i++) {
        const blk_q4_K *x = (const blk_q4_K *)row + i;
        __m256 sc, dmn;
        q4k_scales_256(x, &sc, &dmn);
        const __m256i isc = _mm256_cvttps_epi32(sc);
        __m256i I = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * c));
            for (int e = 0; e < 2; e++) {
                const int j = 2 * c + e;
                const size_t b = 8 * (size_t)i + j;
                const __m256i U = _mm256_and_si256(e ? _mm256_srli_epi16(xq, 4) : xq, m0f);
                const __m256i P = join_halves_256(slot_pack_tok(U, tv, b, T, 0));
                const __m256i jj = _mm256_set1_epi32(j);
                I = _mm256_add_epi32(I, _mm256_mullo_epi32(P, _mm256_permutevar8x32_epi32(isc, jj)));
                accM = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(dmn, jj), _mm256_broadcast_ps((const __m128 *)(tv->ds4 + 4 * b)), accM);
            }
        }
        const __m256 w = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(x->d)), _mm256_loadu_ps(tv->td4 + 8 * (8 * (size_t)i)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), w, acc);
    }
    float r[8];
    _mm256_storeu_ps(r, _mm256_add_ps(acc, accM));
    for (int k = 0; k < T; k++) res[k] = r[k];
}

KERN256(k256_q4_K, q4k_slots_256, row, n, tv, res)

/* Decode, 4 rows x 1 token per vector (lanes r and r + 4: row r, see rows4_transpose):
 * bit-identical to q4k_slots_256 with T = 1. */
A256 static void q4k_rows4_256(const uint8_t *const *rows, int n, const tile *tv, float *res, size_t pf) {
    const int nsb = n / QK_K;
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps(), accM = _mm256_setzero_ps();
    for (int i = 0; i < nsb; i++) {
        const blk_q4_K *x[4];
        __m256 sc[4], dmn[4], SC[4], MN[4];
        for (int r = 0; r < 4; r++) {
            x[r] = (const blk_q4_K *)rows[r] + i;
            if (pf) _mm_prefetch((const char *)x[r] + pf, _MM_HINT_T0), _mm_prefetch((const char *)x[r] + pf + 64, _MM_HINT_T0);
            q4k_scales_256(x[r], &sc[r], &dmn[r]);
        }
        rows4_transpose(sc, SC);
        rows4_transpose(dmn, MN);
        __m256i I = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i xq[4];
            for (int r = 0; r < 4; r++) xq[r] = _mm256_loadu_si256((const __m256i *)(x[r]->qs + 32 * c));
            for (int e = 0; e < 2; e++) {
                const int j = 2 * c + e;
                const size_t b = 8 * (size_t)i + j;
                __m256i U[4];
                for (int r = 0; r < 4; r++) U[r] = _mm256_and_si256(e ? _mm256_srli_epi16(xq[r], 4) : xq[r], m0f);
                const __m256i P = join_halves_256(rows4_pack(U, _mm256_loadu_si256((const __m256i *)(tv->qs + 32 * b)), 0));
                I = _mm256_add_epi32(I, _mm256_mullo_epi32(P, _mm256_cvttps_epi32(rows4_pair(SC, j, j))));
                accM = _mm256_fmadd_ps(rows4_pair(MN, j, j), _mm256_set1_ps(tv->ds4[4 * b]), accM);
            }
        }
        const float d0 = _cvtsh_ss(x[0]->d), d1 = _cvtsh_ss(x[1]->d), d2 = _cvtsh_ss(x[2]->d), d3 = _cvtsh_ss(x[3]->d);
        const __m256 w = _mm256_mul_ps(_mm256_setr_ps(d0, d1, d2, d3, d0, d1, d2, d3), _mm256_set1_ps(tv->td4[8 * (8 * (size_t)i)]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), w, acc);
    }
    _mm_storeu_ps(res, _mm256_castps256_ps128(_mm256_add_ps(acc, accM)));
}

A256 static void r256_q4_K(const uint8_t *W, size_t rb, int r0, int r1, int n, const tile *tv, float *out, int ldo, int k0) {
    krows_256(k256_q4_K, q4k_rows4_256, W, rb, r0, r1, n, tv, out, ldo, k0);
}

/* --- Prefill (see pf8.c) ---------------------------------------------------------------------- */

A256 AINL void pf8_unpack_q4k(const uint8_t *row, int nb, uint8_t *ur) {
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < nb / 8; i++) {
        const blk_q4_K *x = (const blk_q4_K *)row + i;
        __m256 vsc, dmn;
        q4k_scales_256(x, &vsc, &dmn);
        float sc[8], mn[8];
        _mm256_storeu_ps(sc, vsc);
        _mm256_storeu_ps(mn, dmn);
        const float d = _cvtsh_ss(x->d);
        for (int c = 0; c < 4; c++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * c));
            for (int e = 0; e < 2; e++) {
                const int j = 2 * c + e, b = 8 * i + j;
                _mm256_storeu_si256((__m256i *)(ur + 32 * (size_t)b), _mm256_and_si256(e ? _mm256_srli_epi16(xq, 4) : xq, m0f));
                pf8_store_q4k(ur, nb, b, (int)sc[j], d, mn[j]);
            }
        }
    }
}

/* --- R16 (see r16.c) -------------------------------------------------------------------------- */

/* The scales of block j of a Q4_K or Q5_K unit u (the two types' R16 units keep them alike): the
 * super-block scales d, the block scales as floats, and the mins times -dmin. */
A512 AINL void r16_k45_scales(const r16_ptrs *p, const uint8_t *u, size_t j, __m512 *d, __m512 *sc, __m512 *mn) {
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + p->kd)));
    const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + p->kdm)));
    *sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(u + p->ksc + 16 * j))));
    const __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(u + p->kmn + 16 * j))));
    *mn = _mm512_mul_ps(m, _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dm), _mm512_set1_epi32((int)0x80000000))));
}

/* The same for rows 8q..8q+7, AVX2. */
A256 AINL void r16_k45_scales_256(const r16_ptrs *p, const uint8_t *u, size_t j, const int q, __m256 *d, __m256 *sc,
                                  __m256 *mn) {
    const size_t o16 = 16 * (size_t)q, o8 = 8 * (size_t)q;
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->kd + o16)));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->kdm + o16)));
    *sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + p->ksc + 16 * j + o8))));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + p->kmn + 16 * j + o8))));
    *mn = _mm256_mul_ps(m, _mm256_xor_ps(dm, _mm256_set1_ps(-0.0f)));
}

/* Block b (j within its unit u) of a Q4_K group: the v16 U vectors W[4h + g], the block scales
 * (integers, as floats) in *wd0, the super-block scales d in *wd1, and the mins (see r16_block);
 * as q4k_scales_256: float(sc), float(m) * -dmin. */
A512 AINL void r16_block_q4k(const r16_ptrs *p, const uint8_t *u, size_t j, __m512i *W, __m512 *wd0, __m512 *wd1,
                             __m512 *mn) {
    r16_nib_512(p, u, j, W);
    r16_k45_scales(p, u, j, wd1, wd0, mn);
}

/* The same for rows 8q..8q+7, AVX2 (see r16_block_256). */
A256 AINL void r16_block_q4k_256(const r16_ptrs *p, const uint8_t *u, size_t j, const int q, __m256i *W, __m256 *wd0,
                                 __m256 *wd1, __m256 *mn) {
    r16_nib_256(p, u, j, 32 * (size_t)q, W);
    r16_k45_scales_256(p, u, j, q, wd1, wd0, mn);
}

#endif /* x86 */
