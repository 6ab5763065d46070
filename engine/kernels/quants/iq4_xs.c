/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). IQ4_XS: 256-element super-blocks of 8 blocks of 32, 4-bit indices into IQ4_NL's table
 * (kvalues_iq4nl, iq4_nl.c), an f16 d per super-block and a 6-bit scale ls per block (4 low bits
 * in scales_l, 2 high ones in scales_h): block b's values are d * (ls_b - 32) * K[index]. Each
 * block's 16 bytes of nibbles are laid out as IQ4_NL's. Block struct, dequantization, scalar
 * reference dot product, R16 unit and repacking, AVX2 slot and 4-row decode kernels, v16 prefill
 * unpacking, R16 block loading.
 *
 * The IQ4_XS float sequence is the legacy types' (legacy_slots_256, v16.c), with the block's scale
 * dl_b = d * (ls_b - 32) (exact in float: 11 x 6 bits) for both halves of block b:
 *     acc_(b&1),h = fma(float(P_b,h), dl_b * d_k(b), acc_(b&1),h)     P_b,h: the exact integer sum
 *                                                                     of half h's 16 products
 *     result = (acc_0,0 + acc_1,0) + (acc_0,1 + acc_1,1)
 * so the generic v16 and R16 kernels run it (v16_pass, r16_tile, r16_half_256, r16_tile16_halves_256), its
 * looked-up values handled as signed 8-bit ones (type_s8: the AVX2 sign trick, value + 128 and
 * offset 128 for vpdpbusd). Q4_K's sequence (the integer block scale applied in the integer domain,
 * one FMA a block) would save a conversion and an FMA a block, but rests on int16-exact block sums
 * for its AVX2 vpmaddwd, which signed 8-bit values do not give.
 * No AVX2 8-token prefill kernels (pf8): see iq4_nl.c. */

typedef struct { uint16_t d, scales_h; uint8_t scales_l[4]; uint8_t qs[128]; } blk_iq4_xs;
_Static_assert(sizeof(blk_iq4_xs) == 136, "iq4_xs");

/* Block j's scale ls_j - 32 (-32..31): bits 4j.. of scales_l (byte j/2, nibble j%2), bits 2j.. of scales_h. */
static inline int iq4xs_scale(const blk_iq4_xs *x, int j) {
    return (int)(((load_u32(x->scales_l) >> (4 * j)) & 15) | (((uint32_t)x->scales_h >> (2 * j)) & 3) << 4) - 32;
}

/* ------------------------------------------------------------------------------------------ */
/* Dequantization (ground truth)                                                               */

static void dequant_iq4_xs(const void *row, float *y, int n) {
    const blk_iq4_xs *b = row;
    for (int i = 0; i < n / QK_K; i++) {
        const float d = F16(b[i].d);
        for (int j = 0; j < 8; j++, y += QK) {
            const float dl = d * (float)iq4xs_scale(&b[i], j);
            const uint8_t *qs = b[i].qs + 16 * j;
            for (int l = 0; l < 16; l++) {
                y[l] = dl * (float)kvalues_iq4nl[qs[l] & 0xF];
                y[l + 16] = dl * (float)kvalues_iq4nl[qs[l] >> 4];
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Scalar reference dot product                                                                */

static float dot_iq4_xs_ref(int n, const void *row, const rq_act *x) {
    const blk_iq4_xs *b = row;
    float s = 0.0f;
    int8_t v[32];
    for (int i = 0; i < n / QK_K; i++) {
        const float d = F16(b[i].d);
        for (int j = 0; j < 8; j++) {
            const int blk = 8 * i + j;
            iq4_values(b[i].qs + 16 * j, v);
            s += x->d[blk] * (d * (float)(iq4xs_scale(&b[i], j) * dot32_s(v, x->qs + 32 * blk)));
        }
    }
    return s;
}

/* ------------------------------------------------------------------------------------------ */
/* R16 (see r16_layout.c): a unit is one super-block of 8 blocks                               */

/*   IQ4_XS: NIB [8 j][4 g][16] | QD [16] f16 | QSC [8 j][16] i8 (the block scales ls - 32) */
static inline void r16_layout_iq4xs(r16_ptrs *p) {
    p->bpu = 8; p->nib = 0; p->qd = 2048; p->qsc = 2080; p->ub = 2208;
}

/* Row r (0..15) of a group: its super-blocks' nibbles (a block's 16 bytes are NIB's bytes as they
 * are) and scales into the group's units. */
static void r16_repack_row_iq4xs(const uint8_t *row, int nb, const r16_ptrs *p, int r) {
    for (int s = 0; s < nb / 8; s++) {
        const blk_iq4_xs *x = (const blk_iq4_xs *)row + s;
        const uint8_t *u = p->g + (size_t)s * p->ub;
        r16_w16(u + p->qd, r, x->d);
        for (int j = 0; j < 8; j++) {
            ((int8_t *)u)[p->qsc + 16 * j + r] = (int8_t)iq4xs_scale(x, j);
            for (int g = 0; g < 4; g++) r16_w32(u + p->nib + 64 * (4 * j + g), r, load_u32(x->qs + 16 * j + 4 * g));
        }
    }
}

#ifdef RQ_HAVE_X86

/* Super-block x: its 8 block scales d * (ls - 32), as floats. */
A256 AINL __m256 iq4xs_scales_256(const blk_iq4_xs *x) {
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)load_u32(x->scales_l)),
                                                          _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                        _mm256_set1_epi32(15));
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(x->scales_h),
                                                          _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                        _mm256_set1_epi32(3));
    const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(ls), _mm256_set1_ps(_cvtsh_ss(x->d)));
}

/* One row against T <= 4 tokens (lane k: token k's first half of each block, lane 4 + k its second). */
A256 AINL void iq4xs_slots_256(const uint8_t *row, int n, const tile *tv, float *res, const int T) {
    const int nsb = n / QK_K;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < nsb; i++) {
        const blk_iq4_xs *x = (const blk_iq4_xs *)row + i;
        const __m256 sc = iq4xs_scales_256(x);
        for (int j = 0; j < 8; j++) {
            const size_t b = 8 * (size_t)i + j;
            const __m256i P = slot_pack_tok(iq4_block_256(x->qs + 16 * j, 0), tv, b, T, 1);
            const __m256 wd = _mm256_permutevar8x32_ps(sc, _mm256_set1_epi32(j));
            acc[j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_mul_ps(wd, _mm256_loadu_ps(tv->td4 + 8 * b)), acc[j & 1]);
        }
    }
    slot_finish(acc[0], acc[1], acc[0], 0, res, T);
}

KERN256(k256_iq4_xs, iq4xs_slots_256, row, n, tv, res)

/* Decode, 4 rows x 1 token per vector (see rows4_transpose): bit-identical to iq4xs_slots_256 with T = 1. */
A256 static void iq4xs_rows4_256(const uint8_t *const *rows, int n, const tile *tv, float *res, size_t pf) {
    const int nsb = n / QK_K;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < nsb; i++) {
        const blk_iq4_xs *x[4];
        __m256 sc[4], SC[4];
        for (int r = 0; r < 4; r++) {
            x[r] = (const blk_iq4_xs *)rows[r] + i;
            if (pf)
                for (int o = 0; o < (int)sizeof(blk_iq4_xs); o += 64) _mm_prefetch((const char *)x[r] + pf + o, _MM_HINT_T0);
            sc[r] = iq4xs_scales_256(x[r]);
        }
        rows4_transpose(sc, SC);
        for (int j = 0; j < 8; j++) {
            const size_t b = 8 * (size_t)i + j;
            __m256i W[4];
            for (int r = 0; r < 4; r++) W[r] = iq4_block_256(x[r]->qs + 16 * j, 0);
            const __m256i P = rows4_pack(W, _mm256_loadu_si256((const __m256i *)(tv->qs + 32 * b)), 1);
            const __m256 wd = rows4_pair(SC, j, j);   /* one scale for both halves */
            acc[j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_mul_ps(wd, _mm256_set1_ps(tv->td4[8 * b])), acc[j & 1]);
        }
    }
    rows4_finish(acc[0], acc[1], acc[0], 0, res);
}

A256 static void r256_iq4_xs(const uint8_t *W, size_t rb, int r0, int r1, int n, const tile *tv, float *out, int ldo, int k0) {
    krows_256(k256_iq4_xs, iq4xs_rows4_256, W, rb, r0, r1, n, tv, out, ldo, k0);
}

/* --- Prefill (see v16.c) ---------------------------------------------------------------------- */

/* IQ4_XS rows in the prefill kernels' unpacked form (pf8.c): values + 128, the block scale twice. */
A256 AINL void v16_unpack_iq4xs(const uint8_t *row, int nb, uint8_t *ur) {
    for (int i = 0; i < nb / 8; i++) {
        const blk_iq4_xs *x = (const blk_iq4_xs *)row + i;
        float sc[8];
        _mm256_storeu_ps(sc, iq4xs_scales_256(x));
        for (int j = 0; j < 8; j++) {
            const int b = 8 * i + j;
            _mm256_storeu_si256((__m256i *)(ur + 32 * (size_t)b), iq4_block_256(x->qs + 16 * j, 1));
            pf8_store_scales(ur, nb, b, sc[j], sc[j], 0.0f);
        }
    }
}

/* --- R16 (see r16.c) -------------------------------------------------------------------------- */

/* Block b (j within its unit u) of an IQ4_XS group: the v16 U vectors W[4h + g] (values + 128),
 * the block's scale for both halves (see r16_block). */
A512 AINL void r16_block_iq4xs(const r16_ptrs *p, const uint8_t *u, size_t j, __m512i *W, __m512 *wd0, __m512 *wd1,
                               __m512 *mn) {
    r16_nib_512(p, u, j, W);
    iq4_lookup8_512(W);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + p->qd)));
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(u + p->qsc + 16 * j))));
    *wd0 = *wd1 = _mm512_mul_ps(sc, d);   /* as iq4xs_scales_256: float(ls - 32) * d */
    *mn = _mm512_setzero_ps();
}

/* The same for rows 8q..8q+7, AVX2 (see r16_block_256): the signed values, for the sign trick. */
A256 AINL void r16_block_iq4xs_256(const r16_ptrs *p, const uint8_t *u, size_t j, const int q, __m256i *W,
                                   __m256 *wd0, __m256 *wd1, __m256 *mn) {
    r16_nib_256(p, u, j, 32 * (size_t)q, W);
    iq4_lookup8_256(W, 0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->qd + 16 * (size_t)q)));
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(u + p->qsc + 16 * j + 8 * (size_t)q))));
    *wd0 = *wd1 = _mm256_mul_ps(sc, d);
    *mn = _mm256_setzero_ps();
}

#endif /* x86 */
