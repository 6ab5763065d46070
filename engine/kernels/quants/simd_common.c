/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). x86: the AVX2 building blocks the types' kernels share (row x
 * token-tile accumulation, slot packing, 4-row decode, the prefill kernels' unpacked-row format)
 * and KERN256, which makes a type's kernel_fn. */

#ifdef RQ_HAVE_X86

#define TMAX2 4

/* One activation block b for the T tokens of the tile (vpmaddubsw + vpmaddwd; U <= 63: no saturation). */
A256 AINL void blk_256(__m256i U, __m256 WD, const tile *tv, size_t b, const int T, const int offs, __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    const size_t u = b * (size_t)T;
    const int8_t *qb = tv->qs + 32 * u;
    const float *tb = tv->td + 8 * u;
    const int32_t *nb = offs ? tv->nq + 8 * u : NULL;
    for (int t = 0; t < T; t++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(qb + 32 * t));
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(U, q), ones);
        if (offs) p = _mm256_add_epi32(p, _mm256_loadu_si256((const __m256i *)(nb + 8 * t)));
        __m256 s = _mm256_mul_ps(WD, _mm256_loadu_ps(tb + 8 * t));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[t]);
    }
}

A256 AINL float hsum_256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define NPAR256(T) 2  /* accumulators per token: even and odd blocks (two FMA chains) */
#define ACC_DECL_256(T)                                                        \
    __m256 acc[2][TMAX2];                                                      \
    for (int t_ = 0; t_ < (T); t_++) acc[0][t_] = acc[1][t_] = _mm256_setzero_ps();

A256 AINL void finish_256(__m256 (*acc)[TMAX2], float *res, const int T) {
    for (int t = 0; t < T; t++)
        res[t] = hsum_256(NPAR256(T) == 2 ? _mm256_add_ps(acc[0][t], acc[1][t]) : acc[0][t]);
}

/* 16 per-group mins (two vectors of 8) x DS of one superblock */
A256 AINL void kmin_256(__m256 m_lo, __m256 m_hi, const tile *tv, int i, const int T, __m256 *acc0, __m256 *acc1) {
    const float *db = tv->ds + (size_t)i * T * 16;
    for (int k = 0; k < T; k++) {
        acc0[k] = _mm256_fmadd_ps(m_lo, _mm256_loadu_ps(db + 16 * k), acc0[k]);
        acc1[k] = _mm256_fmadd_ps(m_hi, _mm256_loadu_ps(db + 16 * k + 8), acc1[k]);
    }
}

/* lanes 0-3 = v[g], lanes 4-7 = v[g+1] of a 16-float scale set held in two vectors */
A256 AINL __m256 pair4_256(__m256 lo, __m256 hi, int g) {
    __m256 src = g < 8 ? lo : hi;
    const int gg = g & 7;
    return _mm256_permutevar8x32_ps(src, _mm256_setr_epi32(gg, gg, gg, gg, gg + 1, gg + 1, gg + 1, gg + 1));
}

/* --- K types in the slot scheme: 32-element blocks, 4 token slots of one row; slots past the
 * tile's T are dead (zero) and skipped, so T = 1 costs one slot (same lanes, same results). */

/* Lanes holding exact half-block sums (lane l and l + 4: the two halves) -> the block sums, in both. */
A256 AINL __m256i join_halves_256(__m256i P) { return _mm256_add_epi32(P, _mm256_permute2x128_si256(P, P, 0x01)); }

/* The exact sums of each dword's 4 products of 32 weights with 32 activations q: U unsigned
 * (vpmaddubsw: U <= 127, so the pairs fit in int16), or signed (s8: type_s8's sign trick). */
A256 AINL __m256i dot_dwords_256(__m256i U, __m256i q, const int s8) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (s8) return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(U, U), _mm256_sign_epi8(q, U)), ones);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(U, q), ones);
}

/* U against the live tokens' block b, packed (s8: U holds signed values, see dot_dwords_256) */
A256 AINL __m256i slot_pack_tok(__m256i U, const tile *tv, size_t b, const int T, const int s8) {
    const int8_t *qb = tv->qs + 32 * (size_t)T * b;
    __m256i p[4];
    for (int k = 0; k < 4; k++)
        p[k] = k < T ? dot_dwords_256(U, _mm256_loadu_si256((const __m256i *)(qb + 32 * k)), s8) : _mm256_setzero_si256();
    __m256i h01 = _mm256_hadd_epi32(p[0], p[1]);
    __m256i h23 = T > 2 ? _mm256_hadd_epi32(p[2], p[3]) : _mm256_setzero_si256();
    return _mm256_hadd_epi32(h01, h23);
}

A256 AINL void slot_finish(__m256 acc0, __m256 acc1, __m256 accM, const int mins, float *res, const int T) {
    const __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    if (mins) a = _mm_add_ps(a, _mm_add_ps(_mm256_castps256_ps128(accM), _mm256_extractf128_ps(accM, 1)));
    float r[4];
    _mm_storeu_ps(r, a);
    for (int k = 0; k < T; k++) res[k] = r[k];
}

#define KERN256(name, IMPL, ...)                                                        \
    A256 static void name(const uint8_t *row, int n, const tile *tv, float *res) {      \
        const int T = tv->T;                                                            \
        DISPATCH_T4(IMPL, __VA_ARGS__);                                                 \
    }

/* --- K types, decode: 4 rows x 1 token per vector ------------------------------------------
 * The slot kernels (q4k_slots_256, q6k_slots_256) put the tile's tokens in the lanes; with one
 * token (decode) 3 of the 4
 * slots are dead. Here slot s is row s instead: lane s / s + 4 hold row s's sums over the first /
 * second 16 elements of each 32-element block, exactly what lane 0 / 4 holds in the one-row
 * kernel, and every lane goes through the same float operations in the same order, so results
 * are bit-identical to q4k_slots_256 / q6k_slots_256 with T = 1. */

/* 4 rows' 8 per-group floats -> X[g] = [row0..row3 of group g | row0..row3 of group g + 4], g < 4 */
A256 AINL void rows4_transpose(const __m256 *v, __m256 *X) {
    const __m256 a = _mm256_unpacklo_ps(v[0], v[1]), b = _mm256_unpacklo_ps(v[2], v[3]);
    const __m256 c = _mm256_unpackhi_ps(v[0], v[1]), d = _mm256_unpackhi_ps(v[2], v[3]);
    X[0] = _mm256_shuffle_ps(a, b, 0x44);
    X[1] = _mm256_shuffle_ps(a, b, 0xEE);
    X[2] = _mm256_shuffle_ps(c, d, 0x44);
    X[3] = _mm256_shuffle_ps(c, d, 0xEE);
}

/* [rows of group g | rows of group h] from transposed X (g, h < 8) */
A256 AINL __m256 rows4_pair(const __m256 *X, int g, int h) {
    const __m256 A = X[g & 3], B = X[h & 3];
    const int sa = g < 4 ? 0 : 1, sb = h < 4 ? 0 : 1;
    if (sa == 0 && sb == 0) return _mm256_permute2f128_ps(A, B, 0x20);
    if (sa == 0 && sb == 1) return _mm256_permute2f128_ps(A, B, 0x30);
    if (sa == 1 && sb == 0) return _mm256_permute2f128_ps(A, B, 0x21);
    return _mm256_permute2f128_ps(A, B, 0x31);
}

/* exact sums of U_r . q over each 16-element half, packed [r0lo r1lo r2lo r3lo r0hi .. r3hi]
 * (s8: U holds signed values, see dot_dwords_256) */
A256 AINL __m256i rows4_pack(const __m256i *U, __m256i q, const int s8) {
    __m256i p[4];
    for (int r = 0; r < 4; r++) p[r] = dot_dwords_256(U[r], q, s8);
    return _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
}

A256 AINL void rows4_finish(__m256 acc0, __m256 acc1, __m256 accM, const int mins, float *res) {
    const __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    if (mins) a = _mm_add_ps(a, _mm_add_ps(_mm256_castps256_ps128(accM), _mm256_extractf128_ps(accM, 1)));
    _mm_storeu_ps(res, a);
}

/* Rows [r0, r1) against the tile: 4 rows at a time for one token, else one row at a time. */
A256 AINL void krows_256(kern_fn one, void (*four)(const uint8_t *const *, int, const tile *, float *, size_t),
                         const uint8_t *W, size_t rb, int r0, int r1, int n, const tile *tv, float *out, int ldo, int k0) {
    float res[TMAX];
    if (tv->T == 1) {
        for (int r = r0; r < r1; r += 4) {
            const uint8_t *rows[4];
            for (int i = 0; i < 4; i++) rows[i] = W + (size_t)(r + i < r1 ? r + i : r) * rb;
            four(rows, n, tv, res, r + 8 <= r1 ? 4 * rb : 0);
            for (int i = 0; i < 4 && r + i < r1; i++) out[(size_t)k0 * ldo + r + i] = res[i];
        }
        return;
    }
    for (int r = r0; r < r1; r++) {
        one(W + (size_t)r * rb, n, tv, res);
        for (int k = 0; k < tv->T; k++) out[(size_t)(k0 + k) * ldo + r] = res[k];
    }
}

/* The prefill kernels' unpacked rows (see pf8.c): per block b, 32 bytes U, then the half scales
 * WD[2b], WD[2b + 1] and the min M[b] as floats (Q4_K: see pf8_store_q4k). */
static size_t pf8_urow_bytes(int nb) { return ((size_t)nb * (32 + 8 + 4) + 63) & ~(size_t)63; }

A256 AINL void pf8_store_scales(uint8_t *ur, int nb, int b, float w0, float w1, float m) {
    float *WD = (float *)(ur + 32 * (size_t)nb);
    WD[2 * b] = w0;
    WD[2 * b + 1] = w1;
    WD[2 * (size_t)nb + b] = m;
}

/* Q4_K's unpacked rows: WD[2b] holds the block's integer scale sc twice as int16 (the vpmaddwd
 * operand of pf8_q4k_256), WD[2b + 1] the super-block's d, M[b] the min. */
A256 AINL void pf8_store_q4k(uint8_t *ur, int nb, int b, int sc, float d, float m) {
    const uint32_t sc2 = (uint32_t)sc * 0x10001u;
    float w0;
    memcpy(&w0, &sc2, 4);
    pf8_store_scales(ur, nb, b, w0, d, m);
}

#endif /* x86 */
