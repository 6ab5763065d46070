/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). Q5_K: Q4_K's super-blocks with a fifth bit per value (qh: bit j of qh[l] is element l
 * of block j). Block struct, dequantization, scalar reference dot product, R16 unit and
 * repacking, AVX2 slot and 4-row decode kernels, prefill unpacking, R16 block loading.
 *
 * The Q5_K float sequence is the legacy types' with mins (legacy_slots_256, v16.c), with block b's
 * scale dl_b = d * sc_b and min mn_b = -dmin * m_b (both exact in float: 11 x 6 bits):
 *     acc_(b&1),h = fma(float(P_b,h), dl_b * d_k(b), acc_(b&1),h)    P_b,h: the exact integer sum
 *                                                                    of half h's 16 products
 *     accM_(b&1)  = fma(mn_b, d_k(b) * S_k(b), accM_(b&1))
 *     result = ((acc_0,0 + acc_1,0) + (acc_0,1 + acc_1,1)) + (accM_0 + accM_1)
 * so the generic v16, pf8 and R16 kernels run it. Q4_K's sequence (one vpmaddwd by the integer
 * block scale over a whole block's int16 sums) does not carry over: 5-bit values overflow those
 * int16 sums (16 x 31 x 128 > 32767). */

typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } blk_q5_K;
_Static_assert(sizeof(blk_q5_K) == 176, "q5_K");

/* ------------------------------------------------------------------------------------------ */
/* Dequantization (ground truth)                                                               */

/* (the body is Q4_K's: q4_K.c) */
static inline k45_block q5k_fields(const blk_q5_K *b) { return (k45_block){b->d, b->dmin, b->scales, b->qs, b->qh}; }

static void dequant_q5_K(const void *row, float *y, int n) {
    const blk_q5_K *b = row;
    for (int i = 0; i < n / QK_K; i++, y += QK_K) {
        const k45_block f = q5k_fields(&b[i]);
        dequant_k45(&f, y);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Scalar reference dot product                                                                */

static float dot_q5_K_ref(int n, const void *row, const rq_act *x) {
    const blk_q5_K *b = row;
    float s = 0.0f;
    for (int i = 0; i < n / QK_K; i++) {
        const k45_block f = q5k_fields(&b[i]);
        dot_k45_add(&f, x, i, &s);
    }
    return s;
}

/* ------------------------------------------------------------------------------------------ */
/* R16 (see r16_layout.c): a unit is one super-block of 8 blocks                               */

/*   Q5_K: NIB [8 j][4 g][16] | HB [8 j][16] u32 (the legacy Q5 types' HB, per block) | KD [16] f16 |
 *         KDM [16] f16 | KSC [8 j][16] u8 | KMN [8 j][16] u8 */
static inline void r16_layout_q5k(r16_ptrs *p) {
    p->bpu = 8; p->nib = 0; p->hb = 2048; p->kd = 2560; p->kdm = 2592; p->ksc = 2624; p->kmn = 2752; p->ub = 2880;
}

/* Row r (0..15) of a group: its super-blocks' bits, scales and mins into the group's units (q4_K.c). */
static void r16_repack_row_q5k(const uint8_t *row, int nb, const r16_ptrs *p, int r) {
    for (int s = 0; s < nb / 8; s++) {
        const blk_q5_K *x = (const blk_q5_K *)row + s;
        r16_repack_unit_k45(p->g + (size_t)s * p->ub, p, r, x->d, x->dmin, x->scales, x->qs, x->qh);
    }
}

#ifdef RQ_HAVE_X86

/* Super-block x: its 8 block scales d * sc and its 8 block mins -dmin * m, as floats. */
A256 AINL void q5k_scales_256(const blk_q5_K *x, __m256 *dl, __m256 *mn) {
    uint32_t u0, u1, u2, u3;
    k4_unpack(x->scales, &u0, &u1, &u2, &u3);
    const __m128i v = _mm_set_epi32((int)u3, (int)u2, (int)u1, (int)u0);
    *dl = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_set1_ps(_cvtsh_ss(x->d)));
    *mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))), _mm256_set1_ps(-_cvtsh_ss(x->dmin)));
}

/* Block j's 32 values (0..31, element order) of a super-block: qs nibbles, bit j of qh (H) as 0x10. */
A256 AINL __m256i q5k_block_256(const uint8_t *qs, __m256i H, const int j) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
    const __m256i lo = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
    const __m256i hi = j <= 4 ? _mm256_slli_epi16(H, 4 - j) : _mm256_srli_epi16(H, j - 4);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x10)));
}

/* One row against T <= 4 tokens (lane k: token k's first half of each block, lane 4 + k its second;
 * accM: lanes k the even blocks' mins, 4 + k the odd ones'). */
A256 AINL void q5k_slots_256(const uint8_t *row, int n, const tile *tv, float *res, const int T) {
    const int nsb = n / QK_K;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, accM = _mm256_setzero_ps();
    for (int i = 0; i < nsb; i++) {
        const blk_q5_K *x = (const blk_q5_K *)row + i;
        const __m256i H = _mm256_loadu_si256((const __m256i *)x->qh);
        __m256 dl, mn;
        q5k_scales_256(x, &dl, &mn);
        for (int j = 0; j < 8; j++) {
            const size_t b = 8 * (size_t)i + j;
            const __m256i P = slot_pack_tok(q5k_block_256(x->qs, H, j), tv, b, T, 0);
            const __m256 wd = _mm256_permutevar8x32_ps(dl, _mm256_set1_epi32(j));
            acc[j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_mul_ps(wd, _mm256_loadu_ps(tv->td4 + 8 * b)), acc[j & 1]);
            if (j & 1) {
                const __m256 m = _mm256_permutevar8x32_ps(mn, _mm256_setr_epi32(j - 1, j - 1, j - 1, j - 1, j, j, j, j));
                accM = _mm256_fmadd_ps(m, _mm256_loadu_ps(tv->ds4 + 4 * (b - 1)), accM);
            }
        }
    }
    slot_finish(acc[0], acc[1], accM, 1, res, T);
}

KERN256(k256_q5_K, q5k_slots_256, row, n, tv, res)

/* Decode, 4 rows x 1 token per vector (see rows4_transpose): bit-identical to q5k_slots_256 with T = 1. */
A256 static void q5k_rows4_256(const uint8_t *const *rows, int n, const tile *tv, float *res, size_t pf) {
    const int nsb = n / QK_K;
    const __m256i tok0 = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, accM = _mm256_setzero_ps();
    for (int i = 0; i < nsb; i++) {
        const blk_q5_K *x[4];
        __m256i H[4];
        __m256 dl[4], mn[4], DL[4], MN[4];
        for (int r = 0; r < 4; r++) {
            x[r] = (const blk_q5_K *)rows[r] + i;
            if (pf)
                for (int o = 0; o < (int)sizeof(blk_q5_K); o += 64) _mm_prefetch((const char *)x[r] + pf + o, _MM_HINT_T0);
            H[r] = _mm256_loadu_si256((const __m256i *)x[r]->qh);
            q5k_scales_256(x[r], &dl[r], &mn[r]);
        }
        rows4_transpose(dl, DL);
        rows4_transpose(mn, MN);
        for (int j = 0; j < 8; j++) {
            const size_t b = 8 * (size_t)i + j;
            __m256i U[4];
            for (int r = 0; r < 4; r++) U[r] = q5k_block_256(x[r]->qs, H[r], j);
            const __m256i P = rows4_pack(U, _mm256_loadu_si256((const __m256i *)(tv->qs + 32 * b)), 0);
            acc[j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_mul_ps(rows4_pair(DL, j, j), _mm256_set1_ps(tv->td4[8 * b])),
                                         acc[j & 1]);
            if (j & 1)
                accM = _mm256_fmadd_ps(rows4_pair(MN, j - 1, j),
                                       _mm256_permutevar8x32_ps(_mm256_loadu_ps(tv->ds4 + 4 * (b - 1)), tok0), accM);
        }
    }
    rows4_finish(acc[0], acc[1], accM, 1, res);
}

A256 static void r256_q5_K(const uint8_t *W, size_t rb, int r0, int r1, int n, const tile *tv, float *out, int ldo, int k0) {
    krows_256(k256_q5_K, q5k_rows4_256, W, rb, r0, r1, n, tv, out, ldo, k0);
}

/* --- Prefill (see pf8.c, v16.c) --------------------------------------------------------------- */

/* Q5_K rows in the prefill kernels' unpacked form (pf8.c): the values, the block scale twice, the min. */
A256 AINL void pf8_unpack_q5k(const uint8_t *row, int nb, uint8_t *ur) {
    for (int i = 0; i < nb / 8; i++) {
        const blk_q5_K *x = (const blk_q5_K *)row + i;
        const __m256i H = _mm256_loadu_si256((const __m256i *)x->qh);
        __m256 vdl, vmn;
        q5k_scales_256(x, &vdl, &vmn);
        float dl[8], mn[8];
        _mm256_storeu_ps(dl, vdl);
        _mm256_storeu_ps(mn, vmn);
        for (int j = 0; j < 8; j++) {
            const int b = 8 * i + j;
            _mm256_storeu_si256((__m256i *)(ur + 32 * (size_t)b), q5k_block_256(x->qs, H, j));
            pf8_store_scales(ur, nb, b, dl[j], dl[j], mn[j]);
        }
    }
}

/* --- R16 (see r16.c) -------------------------------------------------------------------------- */

/* Block b (j within its unit u) of a Q5_K group: the v16 U vectors W[4h + g], the block scale for
 * both halves and the min (see r16_block). */
A512 AINL void r16_block_q5k(const r16_ptrs *p, const uint8_t *u, size_t j, __m512i *W, __m512 *wd0, __m512 *wd1,
                             __m512 *mn) {
    r16_nib_512(p, u, j, W);
    r16_hb5_512(u + p->hb + 64 * j, W);
    __m512 d, sc;
    r16_k45_scales(p, u, j, &d, &sc, mn);
    *wd0 = *wd1 = _mm512_mul_ps(sc, d);   /* as q5k_scales_256: float(sc) * d, float(m) * -dmin */
}

/* The same for rows 8q..8q+7, AVX2 (see r16_block_256). */
A256 AINL void r16_block_q5k_256(const r16_ptrs *p, const uint8_t *u, size_t j, const int q, __m256i *W, __m256 *wd0,
                                 __m256 *wd1, __m256 *mn) {
    r16_nib_256(p, u, j, 32 * (size_t)q, W);
    r16_hb5_256(u + p->hb + 64 * j + 32 * (size_t)q, W);
    __m256 d, sc;
    r16_k45_scales_256(p, u, j, q, &d, &sc, mn);
    *wd0 = *wd1 = _mm256_mul_ps(sc, d);
}

#endif /* x86 */
