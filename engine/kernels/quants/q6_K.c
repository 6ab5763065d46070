/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). Q6_K: 256-element super-blocks, 6-bit values (4 low bits in ql, 2 high
 * bits in qh, offset 32) with a signed 8-bit scale per 16 elements. Block struct,
 * dequantization, scalar reference dot product, R16 unit and repacking, AVX2 slot and 4-row
 * decode kernels, prefill unpacking, R16 block loading. */

typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } blk_q6_K;
_Static_assert(sizeof(blk_q6_K) == 210, "q6_K");

/* ------------------------------------------------------------------------------------------ */
/* Dequantization (ground truth)                                                               */

static void dequant_q6_K(const void *row, float *y, int n) {
    const blk_q6_K *b = row;
    for (int i = 0; i < n / QK_K; i++) {
        float d = F16(b[i].d);
        const uint8_t *ql = b[i].ql, *qh = b[i].qh;
        const int8_t *sc = b[i].scales;
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, y += 128) {
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * (float)sc[is + 0] * (float)q1;
                y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Scalar reference dot product                                                                */

/* K types with 16-element scale groups: unpack 256 signed values (offset removed) + 16 int scales. */
static float dot_q6_K_ref(int n, const void *row, const rq_act *x) {
    const blk_q6_K *b = row;
    float s = 0.0f;
    uint8_t u[256];
    for (int i = 0; i < n / QK_K; i++) {
        const uint8_t *ql = b[i].ql, *qh = b[i].qh;
        for (int h = 0; h < 2; h++, ql += 64, qh += 32) {
            uint8_t *up = u + 128 * h;
            for (int l = 0; l < 32; l++) {
                up[l] = (uint8_t)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4));
                up[l + 32] = (uint8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
                up[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                up[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        }
        dot16_signed_add(u, b[i].scales, 32, F16(b[i].d), x, i, &s);   /* value = u - 32 */
    }
    return s;
}

/* ------------------------------------------------------------------------------------------ */
/* R16 (see r16_layout.c): a unit is one super-block of 8 blocks                               */

/*   Q6_K: SIX [8 j][2 h][3 c][16] u32 | QD [16] f16 | QSC [16 sub][16] i8
 * SIX: the 6-bit values of the four 4-element groups g of half h in three entries: byte i of entry
 * c (0..2) = value of elem 16h+4c+i | two bits of elem 16h+12+i (c = 0: its bits 4-5, 1: 2-3,
 * 2: 0-1) << 6. Groups 0-2 come out with one mask each and group 3 with three masks, three
 * shifts and two ors: 11 vector operations for four groups, where nibbles plus a separate plane of
 * high bits took 17 (the AVX2 one-token kernel is bound by its operation count on cores that split
 * 512-bit operations; the same bytes, so memory-bound decode is unchanged). */
static inline void r16_layout_q6k(r16_ptrs *p) {
    p->bpu = 8; p->nib = 0; p->qd = 3072; p->qsc = 3104; p->ub = 3360;
}

/* Row r (0..15) of a group: its super-blocks' bits and scales into the group's units. */
static void r16_repack_row_q6k(const uint8_t *row, int nb, const r16_ptrs *p, int r) {
    uint8_t q[32];
    for (int s = 0; s < nb / 8; s++) {
        const blk_q6_K *x = (const blk_q6_K *)row + s;
        const uint8_t *u = p->g + (size_t)s * p->ub;
        r16_w16(u + p->qd, r, x->d);
        for (int k = 0; k < 16; k++) ((int8_t *)u)[p->qsc + 16 * k + r] = x->scales[k];
        for (int hh = 0; hh < 2; hh++) {           /* 128-element halves of the super-block */
            const uint8_t *ql = x->ql + 64 * hh, *qh = x->qh + 32 * hh;
            for (int k = 0; k < 4; k++) {          /* 32-element groups: block j = 4hh + k of the unit */
                for (int l = 0; l < 32; l++) {
                    int lo = k < 2 ? (ql[l + 32 * (k & 1)] & 0xF) : (ql[l + 32 * (k & 1)] >> 4);
                    q[l] = (uint8_t)(lo | (((qh[l] >> (2 * k)) & 3) << 4));
                }
                const int j = 4 * hh + k;
                for (int h = 0; h < 2; h++)
                    for (int c = 0; c < 3; c++) {
                        uint32_t v = 0;
                        for (int i = 0; i < 4; i++) {
                            const uint32_t top = (q[16 * h + 12 + i] >> (4 - 2 * c)) & 3;
                            v |= (uint32_t)(q[16 * h + 4 * c + i] | top << 6) << (8 * i);
                        }
                        r16_w32(u + p->nib + 64 * (6 * j + 3 * h + c), r, v);
                    }
            }
        }
    }
}

#ifdef RQ_HAVE_X86

/* Q6_K super-block x: its 16 scales times d, as floats [0, 8) in lo and [8, 16) in hi. */
A256 AINL void q6k_scales_256(const blk_q6_K *x, __m256 *lo, __m256 *hi) {
    __m128i s8 = _mm_loadu_si128((const __m128i *)x->scales);
    __m256 d = _mm256_set1_ps(_cvtsh_ss(x->d));
    *lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)), d);
    *hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))), d);
}

/* Q6_K super-block x, half h: the 32 unsigned 6-bit values (offset 32 not removed) of its
 * 32-element group k (0..3), from 4 low bits in ql and 2 high bits in qh. */
A256 AINL __m256i q6k_group_256(const blk_q6_K *x, int h, int k) {
    const __m256i m0f = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i L = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h + 32 * (k & 1)));
    const __m256i H = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
    const __m256i Lk = k < 2 ? _mm256_and_si256(L, m0f) : _mm256_and_si256(_mm256_srli_epi16(L, 4), m0f);
    const __m256i Hk = k == 0 ? _mm256_slli_epi16(H, 4) : k == 1 ? _mm256_slli_epi16(H, 2)
                     : k == 2 ? H : _mm256_srli_epi16(H, 2);
    return _mm256_or_si256(Lk, _mm256_and_si256(Hk, m30));
}

A256 AINL void q6k_slots_256(const uint8_t *row, int n, const tile *tv, float *res, const int T) {
    const int nsb = n / QK_K;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < nsb; i++) {
        const blk_q6_K *x = (const blk_q6_K *)row + i;
        __m256 sc_lo, sc_hi;
        q6k_scales_256(x, &sc_lo, &sc_hi);
        for (int h = 0; h < 2; h++) {
            for (int k = 0; k < 4; k++) {
                const size_t b = 8 * (size_t)i + 4 * h + k;
                __m256i P = _mm256_add_epi32(slot_pack_tok(q6k_group_256(x, h, k), tv, b, T, 0),
                                             _mm256_loadu_si256((const __m256i *)(tv->nq4 + 8 * b)));
                __m256 wd = pair4_256(sc_lo, sc_hi, 8 * h + 2 * k);   /* 16-element scales: one per half */
                acc[k & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_mul_ps(wd, _mm256_loadu_ps(tv->td4 + 8 * b)), acc[k & 1]);
            }
        }
    }
    slot_finish(acc[0], acc[1], acc[0], 0, res, T);
}

KERN256(k256_q6_K, q6k_slots_256, row, n, tv, res)

/* Decode, 4 rows x 1 token per vector (see rows4_transpose): bit-identical to q6k_slots_256 with T = 1. */
A256 static void q6k_rows4_256(const uint8_t *const *rows, int n, const tile *tv, float *res, size_t pf) {
    const int nsb = n / QK_K;
    const __m256i tok0 = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < nsb; i++) {
        const blk_q6_K *x[4];
        __m256 lo[4], hi[4], SL[4], SH[4];
        for (int r = 0; r < 4; r++) {
            x[r] = (const blk_q6_K *)rows[r] + i;
            if (pf)
                for (int o = 0; o < (int)sizeof(blk_q6_K); o += 64) _mm_prefetch((const char *)x[r] + pf + o, _MM_HINT_T0);
            q6k_scales_256(x[r], &lo[r], &hi[r]);
        }
        rows4_transpose(lo, SL);
        rows4_transpose(hi, SH);
        for (int h = 0; h < 2; h++) {
            for (int k = 0; k < 4; k++) {
                const size_t b = 8 * (size_t)i + 4 * h + k;
                __m256i U[4];
                for (int r = 0; r < 4; r++) U[r] = q6k_group_256(x[r], h, k);
                __m256i P = rows4_pack(U, _mm256_loadu_si256((const __m256i *)(tv->qs + 32 * b)), 0);
                P = _mm256_add_epi32(P, _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(tv->nq4 + 8 * b)), tok0));
                const int g = 8 * h + 2 * k;   /* 16-element scales: one per half */
                const __m256 wd = g < 8 ? rows4_pair(SL, g, g + 1) : rows4_pair(SH, g - 8, g - 7);
                acc[k & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_mul_ps(wd, _mm256_set1_ps(tv->td4[8 * b])), acc[k & 1]);
            }
        }
    }
    rows4_finish(acc[0], acc[1], acc[0], 0, res);
}

A256 static void r256_q6_K(const uint8_t *W, size_t rb, int r0, int r1, int n, const tile *tv, float *out, int ldo, int k0) {
    krows_256(k256_q6_K, q6k_rows4_256, W, rb, r0, r1, n, tv, out, ldo, k0);
}

/* --- Prefill (see pf8.c) ---------------------------------------------------------------------- */

A256 AINL void pf8_unpack_q6k(const uint8_t *row, int nb, uint8_t *ur) {
    for (int i = 0; i < nb / 8; i++) {
        const blk_q6_K *x = (const blk_q6_K *)row + i;
        __m256 sc_lo, sc_hi;
        q6k_scales_256(x, &sc_lo, &sc_hi);
        float sc[16];
        _mm256_storeu_ps(sc, sc_lo);
        _mm256_storeu_ps(sc + 8, sc_hi);
        for (int h = 0; h < 2; h++) {
            for (int k = 0; k < 4; k++) {
                const int b = 8 * i + 4 * h + k;
                _mm256_storeu_si256((__m256i *)(ur + 32 * (size_t)b), q6k_group_256(x, h, k));
                pf8_store_scales(ur, nb, b, sc[8 * h + 2 * k], sc[8 * h + 2 * k + 1], 0.0f);
            }
        }
    }
}

/* --- R16 (see r16.c) -------------------------------------------------------------------------- */

/* Block b (j within its unit u) of a Q6_K group: the v16 U vectors W[4h + g] (nibbles plus the
 * two high bits), the two half scales (see r16_block). */
A512 AINL void r16_block_q6k(const r16_ptrs *p, const uint8_t *u, size_t j, __m512i *W, __m512 *wd0, __m512 *wd1,
                             __m512 *mn) {
    const __m512i m = _mm512_set1_epi8((char)0xC0);
    for (int h = 0; h < 2; h++) {   /* the SIX entries (r16_layout_q6k) */
        const uint8_t *c = u + p->nib + 64 * (6 * j + 3 * (size_t)h);
        const __m512i C0 = _mm512_loadu_si512(c), C1 = _mm512_loadu_si512(c + 64), C2 = _mm512_loadu_si512(c + 128);
        W[4 * h] = _mm512_andnot_si512(m, C0);
        W[4 * h + 1] = _mm512_andnot_si512(m, C1);
        W[4 * h + 2] = _mm512_andnot_si512(m, C2);
        __m512i x = _mm512_srli_epi16(_mm512_and_si512(C2, m), 2);
        x = _mm512_srli_epi16(_mm512_ternarylogic_epi32(x, C1, m, 0xF8), 2);   /* 0xF8: x | (C1 & m) */
        W[4 * h + 3] = _mm512_srli_epi16(_mm512_ternarylogic_epi32(x, C0, m, 0xF8), 2);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + p->qd)));
    const int8_t *qs = (const int8_t *)(u + p->qsc + 16 * 2 * j);
    *wd0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs))), d);
    *wd1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)))), d);
    *mn = _mm512_setzero_ps();
}

/* The v16 U vectors W[4h + g] of block j of unit u, rows 8q..8q+7 (nibbles plus the two high bits), AVX2. */
A256 AINL void r16_bits_q6k_256(const r16_ptrs *p, const uint8_t *u, size_t j, const int q, __m256i *W) {
    const __m256i m = _mm256_set1_epi8((char)0xC0);
    for (int h = 0; h < 2; h++) {   /* the SIX entries (r16_layout_q6k) */
        const uint8_t *c = u + p->nib + 64 * (6 * j + 3 * (size_t)h) + 32 * (size_t)q;
        const __m256i C0 = _mm256_loadu_si256((const __m256i *)c), C1 = _mm256_loadu_si256((const __m256i *)(c + 64)),
                      C2 = _mm256_loadu_si256((const __m256i *)(c + 128));
        W[4 * h] = _mm256_andnot_si256(m, C0);
        W[4 * h + 1] = _mm256_andnot_si256(m, C1);
        W[4 * h + 2] = _mm256_andnot_si256(m, C2);
        __m256i x = _mm256_srli_epi16(_mm256_and_si256(C2, m), 2);
        x = _mm256_srli_epi16(_mm256_or_si256(x, _mm256_and_si256(C1, m)), 2);
        W[4 * h + 3] = _mm256_srli_epi16(_mm256_or_si256(x, _mm256_and_si256(C0, m)), 2);
    }
}

/* The same for rows 8q..8q+7, AVX2 (see r16_block_256). */
A256 AINL void r16_block_q6k_256(const r16_ptrs *p, const uint8_t *u, size_t j, const int q, __m256i *W, __m256 *wd0,
                                 __m256 *wd1, __m256 *mn) {
    r16_bits_q6k_256(p, u, j, q, W);
    const size_t o16 = 16 * (size_t)q, o8 = 8 * (size_t)q;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->qd + o16)));
    const uint8_t *qs = u + p->qsc + 32 * j + o8;
    *wd0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qs))), d);
    *wd1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 16)))), d);
    *mn = _mm256_setzero_ps();
}

#endif /* x86 */
