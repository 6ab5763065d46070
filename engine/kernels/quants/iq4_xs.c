/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). IQ4_XS: 256-element super-blocks of 8 blocks of 32, 4-bit indices into IQ4_NL's table
 * (kvalues_iq4nl, iq4_nl.c), an f16 d per super-block and a 6-bit scale ls per block (4 low bits
 * in scales_l, 2 high ones in scales_h): block b's values are d * (ls_b - 32) * K[index]. Each
 * block's 16 bytes of nibbles are laid out as IQ4_NL's. Block struct, dequantization, scalar
 * reference dot product, R16 unit and repacking, AVX2 slot and 4-row decode kernels, v16 prefill
 * unpacking, R16 block loading.
 *
 * The IQ4_XS float sequence, Q4_K's without the mins (q4_K.c). Every SIMD kernel computes each (row,
 * token) result in this order, so results do not depend on the kernel, the path, the tile or the
 * thread count. The token's activations have one scale D_k per super-block (rq_act span 256):
 *     for each super-block i (scale d_i):
 *         I   = sum of P_b * (ls_b - 32) over its 8 blocks b    int32, exact: P_b the exact integer
 *                                                              sum of block b's 32 products of
 *                                                              table values and activations
 *                                                              (|I| <= 8 x 32 x 127 x 127 x 32 < 2^31)
 *         acc = fma(float(I), d_i * D_k, acc)
 *     result = acc
 * The AVX2 kernels take the signed values through the sign trick (type_s8) and widen each pair sum
 * with vpmaddwd against the block scale (in both int16 halves of a dword) instead of ones, so the
 * block scale costs nothing and the float step runs once per super-block (it ran per half-block;
 * Zen 3, AVX2, 1 thread, R16, 768 x 2048 and 2048 x 768: 1.14-1.18x at 16-256 tokens, 1.05-1.15x at
 * 1-8). The AVX-512 kernels take
 * values + 128 (vpdpbusd) with the offset correction (the tile's nq) and one vpmulld a block.
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
        int I = 0;   /* sum of (ls_b - 32) * P_b */
        for (int j = 0; j < 8; j++) {
            iq4_values(b[i].qs + 16 * j, v);
            I += iq4xs_scale(&b[i], j) * dot32_s(v, x->qs + 32 * (8 * i + j));
        }
        s += x->d[8 * i] * (F16(b[i].d) * (float)I);   /* d[8i .. 8i+7]: one scale */
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

/* Super-block x: its 8 block scales ls - 32 (-32..31), one per int32 lane. */
A256 AINL __m256i iq4xs_ls_256(const blk_iq4_xs *x) {
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)load_u32(x->scales_l)),
                                                          _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                        _mm256_set1_epi32(15));
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(x->scales_h),
                                                          _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                        _mm256_set1_epi32(3));
    return _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
}

/* Signed block scales (one per int32 lane) in both int16 halves of each lane: the vpmaddwd operand
 * that turns a lane's two int16 pair sums into their sum times the scale (as k4_scale_pairs_256,
 * masked: a negative scale's upper half is ones). */
A256 AINL __m256i iq4xs_scale_pairs_256(__m256i ls) {
    return _mm256_or_si256(_mm256_and_si256(ls, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(ls, 16));
}

/* One row against T <= 4 tokens (lane k: token k's first half of each block, lane 4 + k its second,
 * joined once a super-block). */
A256 AINL void iq4xs_slots_256(const uint8_t *row, int n, const tile *tv, float *res, const int T) {
    const int nsb = n / QK_K;
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nsb; i++) {
        const blk_iq4_xs *x = (const blk_iq4_xs *)row + i;
        const __m256i ls = iq4xs_ls_256(x);
        __m256i I = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i P = slot_pack_tok(iq4_block_256(x->qs + 16 * j, 0), tv, 8 * (size_t)i + j, T, 1);
            I = _mm256_add_epi32(I, _mm256_mullo_epi32(P, _mm256_permutevar8x32_epi32(ls, _mm256_set1_epi32(j))));
        }
        const __m256 w = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(x->d)), _mm256_loadu_ps(tv->td4 + 8 * (8 * (size_t)i)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(join_halves_256(I)), w, acc);
    }
    float r[8];
    _mm256_storeu_ps(r, acc);
    for (int k = 0; k < T; k++) res[k] = r[k];
}

KERN256(k256_iq4_xs, iq4xs_slots_256, row, n, tv, res)

/* Decode, 4 rows x 1 token per vector (see rows4_transpose): bit-identical to iq4xs_slots_256 with T = 1. */
A256 static void iq4xs_rows4_256(const uint8_t *const *rows, int n, const tile *tv, float *res, size_t pf) {
    const int nsb = n / QK_K;
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nsb; i++) {
        const blk_iq4_xs *x[4];
        __m256 sc[4], SC[4];
        for (int r = 0; r < 4; r++) {
            x[r] = (const blk_iq4_xs *)rows[r] + i;
            if (pf)
                for (int o = 0; o < (int)sizeof(blk_iq4_xs); o += 64) _mm_prefetch((const char *)x[r] + pf + o, _MM_HINT_T0);
            sc[r] = _mm256_cvtepi32_ps(iq4xs_ls_256(x[r]));   /* exact: transposed as floats */
        }
        rows4_transpose(sc, SC);
        __m256i I = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const size_t b = 8 * (size_t)i + j;
            __m256i W[4];
            for (int r = 0; r < 4; r++) W[r] = iq4_block_256(x[r]->qs + 16 * j, 0);
            const __m256i P = rows4_pack(W, _mm256_loadu_si256((const __m256i *)(tv->qs + 32 * b)), 1);
            I = _mm256_add_epi32(I, _mm256_mullo_epi32(P, _mm256_cvttps_epi32(rows4_pair(SC, j, j))));
        }
        const float d0 = _cvtsh_ss(x[0]->d), d1 = _cvtsh_ss(x[1]->d), d2 = _cvtsh_ss(x[2]->d), d3 = _cvtsh_ss(x[3]->d);
        const __m256 w = _mm256_mul_ps(_mm256_setr_ps(d0, d1, d2, d3, d0, d1, d2, d3), _mm256_set1_ps(tv->td4[8 * (8 * (size_t)i)]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(join_halves_256(I)), w, acc);
    }
    _mm_storeu_ps(res, _mm256_castps256_ps128(acc));
}

A256 static void r256_iq4_xs(const uint8_t *W, size_t rb, int r0, int r1, int n, const tile *tv, float *out, int ldo, int k0) {
    krows_256(k256_iq4_xs, iq4xs_rows4_256, W, rb, r0, r1, n, tv, out, ldo, k0);
}

/* --- Prefill (see v16.c) ---------------------------------------------------------------------- */

/* IQ4_XS rows in the prefill kernels' unpacked form (pf8.c): values + 128, the block scale ls - 32 (as
 * a float) in WD[2b] and the super-block's d in WD[2b + 1] (Q4_K's form, after v16_unpack). */
A256 AINL void v16_unpack_iq4xs(const uint8_t *row, int nb, uint8_t *ur) {
    for (int i = 0; i < nb / 8; i++) {
        const blk_iq4_xs *x = (const blk_iq4_xs *)row + i;
        int32_t ls[8];
        _mm256_storeu_si256((__m256i *)ls, iq4xs_ls_256(x));
        const float d = _cvtsh_ss(x->d);
        for (int j = 0; j < 8; j++) {
            const int b = 8 * i + j;
            _mm256_storeu_si256((__m256i *)(ur + 32 * (size_t)b), iq4_block_256(x->qs + 16 * j, 1));
            pf8_store_scales(ur, nb, b, (float)ls[j], d, 0.0f);
        }
    }
}

/* --- R16 (see r16.c) -------------------------------------------------------------------------- */

/* Block b (j within its unit u) of an IQ4_XS group: the v16 U vectors W[4h + g] (values + 128),
 * the block scales ls - 32 (as floats) in *wd0 and the super-block scales d in *wd1 (Q4_K's form,
 * r16_block_q4k), no mins. */
A512 AINL void r16_block_iq4xs(const r16_ptrs *p, const uint8_t *u, size_t j, __m512i *W, __m512 *wd0, __m512 *wd1,
                               __m512 *mn) {
    r16_nib_512(p, u, j, W);
    iq4_lookup8_512(W);
    *wd1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + p->qd)));
    *wd0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(u + p->qsc + 16 * j))));
    *mn = _mm512_setzero_ps();
}

/* The same for rows 8q..8q+7, AVX2 (see r16_block_256): the signed values, for the sign trick. */
A256 AINL void r16_block_iq4xs_256(const r16_ptrs *p, const uint8_t *u, size_t j, const int q, __m256i *W,
                                   __m256 *wd0, __m256 *wd1, __m256 *mn) {
    r16_nib_256(p, u, j, 32 * (size_t)q, W);
    iq4_lookup8_256(W, 0);
    *wd1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->qd + 16 * (size_t)q)));
    *wd0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(u + p->qsc + 16 * j + 8 * (size_t)q))));
    *mn = _mm256_setzero_ps();
}

#endif /* x86 */
