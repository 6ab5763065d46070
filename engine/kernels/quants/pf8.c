/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). x86: the AVX2 8-token prefill driver, generic over the types (each type's
 * pf8_unpack_* is in its file): unpacking a row chunk, the parity passes, the PF8_256 kernels
 * of the OPS table. */

#ifdef RQ_HAVE_X86

#define PF8_RMAX 3   /* rows per pass (pf8_rows_256) */

/* --- Prefill: 8 tokens x 1 row per vector, on weights unpacked once per row chunk ----------
 * Tiles of T >= 3 tokens. A row chunk's weights are first unpacked (pf8_unpack_*) to, per row
 * and block b: 32 unsigned bytes in element order (offsets not removed), the float weight scale
 * of each 16-element half (WD) and the float min (M, types with mins). Then every tile passes
 * over the chunk, one row at a time: each 32-bit lane is one token k of the tile. Per half h of
 * block b, dword j (4 elements) of the weights is broadcast and multiplied with dword j of the
 * 8 tokens (tile.qs8) by vpmaddubsw; the int16 sums of a half add up exactly (U <= 31: 4 x 7874;
 * Q6_K U <= 63: pairs only), and one vpmaddwd gives the exact half sum P per token: no
 * horizontal adds (vphaddd costs ~2.5 cycles on Zen 3). The float sequence per (row, token) lane
 * is that of legacy_slots_256 / q6k_slots_256 exactly (so results do not depend on the tile);
 * Q4_K has one of its own (q4_K.c, pf8_q4k_256):
 *     acc_(b&1),h = fma(float(P_b,h + NQ), WD_b,h * d_b, acc_(b&1),h)
 *     accM_(b&1)  = fma(M_b, d_b * S_b, accM_(b&1))      (mins; a padded fma(0, 0, .) if nb is odd)
 *     result = ((acc_0,0 + acc_1,0) + (acc_0,1 + acc_1,1)) + (accM_0 + accM_1) */

/* One parity pass over blocks b = par, par + 2, ... of R rows (unpacked at ur[r]) for the
 * tile's 8 token lanes: acc[r][h] (half h) and accM[r] (mins). Even and odd blocks feed
 * separate accumulators, so doing all even blocks first keeps every lane's sequence while half
 * as many accumulators are live. A half's 16 weight bytes are loaded into both 128-bit lanes
 * and each dword broadcast with vpshufd (not a load port, not the multiply pipes); the
 * tokens' dwords are loaded once for the R rows. */
A256 AINL void pf8_pass(const int t, const int R, const uint8_t *const *ur, int nb, const tile *tv, const int par,
                        __m256 (*acc)[2], __m256 *accM) {
    const int offs = type_offset(t) != 0, mins = type_has_min(t), q6 = (t == RQ_Q6_K);
    const __m256i ones = _mm256_set1_epi16(1);
    const float *WD[PF8_RMAX];
    for (int r = 0; r < R; r++) WD[r] = (const float *)(ur[r] + 32 * (size_t)nb);
    for (int b = par; b < nb; b += 2) {
        const int8_t *q = tv->qs8 + 256 * (size_t)b;
        const __m256 td = _mm256_loadu_ps(tv->td8 + 8 * (size_t)b);
        __m256 s[PF8_RMAX];
        if (!q6)
            for (int r = 0; r < R; r++) s[r] = _mm256_mul_ps(_mm256_broadcast_ss(WD[r] + 2 * b), td);
        for (int h = 0; h < 2; h++) {
            const __m256i *qh = (const __m256i *)(q + 128 * h);
            for (int r = 0; r < R; r++) {
                const __m256i W = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(ur[r] + 32 * (size_t)b + 16 * h)));
                __m256i p0 = _mm256_maddubs_epi16(_mm256_shuffle_epi32(W, 0x00), _mm256_loadu_si256(qh));
                __m256i p1 = _mm256_maddubs_epi16(_mm256_shuffle_epi32(W, 0x55), _mm256_loadu_si256(qh + 1));
                __m256i p2 = _mm256_maddubs_epi16(_mm256_shuffle_epi32(W, 0xAA), _mm256_loadu_si256(qh + 2));
                __m256i p3 = _mm256_maddubs_epi16(_mm256_shuffle_epi32(W, 0xFF), _mm256_loadu_si256(qh + 3));
                __m256i P;
                if (q6)   /* U <= 63: only pairs of vpmaddubsw sums fit in int16 */
                    P = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones),
                                         _mm256_madd_epi16(_mm256_add_epi16(p2, p3), ones));
                else
                    P = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p0, p1), _mm256_add_epi16(p2, p3)), ones);
                if (offs) P = _mm256_add_epi32(P, _mm256_loadu_si256((const __m256i *)(tv->nq8 + 16 * (size_t)b + 8 * h)));
                const __m256 sc = q6 ? _mm256_mul_ps(_mm256_broadcast_ss(WD[r] + 2 * b + h), td) : s[r];
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), sc, acc[r][h]);
            }
        }
        if (mins) {
            const __m256 ds = _mm256_loadu_ps(tv->ds8 + 8 * (size_t)b);
            for (int r = 0; r < R; r++) accM[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(WD[r] + 2 * (size_t)nb + b), ds, accM[r]);
        }
    }
}

/* Q4_K (its float sequence: q4_K.c): R unpacked rows against the tile's 8 token lanes, one pass.
 * The 4-bit values make the int16 sums of a whole block exact (16 x 15 x 128 per lane), so one
 * vpmaddwd by the block's integer scale gives P_b * sc_b per token, added up in int32 over the
 * super-block: a block costs one integer add per (row, token) where the half-block sequence of the
 * other types costs two conversions, two FMAs and a scale product. */
A256 AINL void pf8_q4k_256(const int R, const uint8_t *const *ur, int nb, const tile *tv, float *res) {
    const float *WD[PF8_RMAX];
    __m256 acc[PF8_RMAX], accM[PF8_RMAX];
    for (int r = 0; r < R; r++) {
        WD[r] = (const float *)(ur[r] + 32 * (size_t)nb);
        acc[r] = accM[r] = _mm256_setzero_ps();
    }
    for (int i = 0; i < nb / 8; i++) {
        __m256i I[PF8_RMAX];
        for (int r = 0; r < R; r++) I[r] = _mm256_setzero_si256();
        for (int b = 8 * i; b < 8 * i + 8; b++) {
            const __m256i *q0 = (const __m256i *)(tv->qs8 + 256 * (size_t)b);
            const __m256 ds = _mm256_loadu_ps(tv->ds8 + 8 * (size_t)b);
            for (int r = 0; r < R; r++) {
                /* The tokens' vectors are read again for each row (vpmaddubsw memory operands):
                 * held in registers across the rows they made GCC spill the accumulators, 8%
                 * slower. The empty asm hides that q is the same pointer for every row. */
                const __m256i *q = q0;
                __asm__ volatile("" : "+r"(q));
                /* each half's 16 bytes in both 128-bit lanes, dword j broadcast by vpshufd */
                const __m256i W0 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(ur[r] + 32 * (size_t)b)));
                const __m256i W1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(ur[r] + 32 * (size_t)b + 16)));
                const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_shuffle_epi32(W0, 0x00), _mm256_loadu_si256(q)),
                                                    _mm256_maddubs_epi16(_mm256_shuffle_epi32(W0, 0x55), _mm256_loadu_si256(q + 1)));
                const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_shuffle_epi32(W0, 0xAA), _mm256_loadu_si256(q + 2)),
                                                    _mm256_maddubs_epi16(_mm256_shuffle_epi32(W0, 0xFF), _mm256_loadu_si256(q + 3)));
                const __m256i s2 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_shuffle_epi32(W1, 0x00), _mm256_loadu_si256(q + 4)),
                                                    _mm256_maddubs_epi16(_mm256_shuffle_epi32(W1, 0x55), _mm256_loadu_si256(q + 5)));
                const __m256i s3 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_shuffle_epi32(W1, 0xAA), _mm256_loadu_si256(q + 6)),
                                                    _mm256_maddubs_epi16(_mm256_shuffle_epi32(W1, 0xFF), _mm256_loadu_si256(q + 7)));
                const __m256i S = _mm256_add_epi16(_mm256_add_epi16(s0, s1), _mm256_add_epi16(s2, s3));
                const __m256i P = _mm256_madd_epi16(S, _mm256_set1_epi32((int)load_u32((const uint8_t *)(WD[r] + 2 * b))));
                I[r] = _mm256_add_epi32(I[r], P);
                accM[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(WD[r] + 2 * (size_t)nb + b), ds, accM[r]);
            }
        }
        const __m256 td = _mm256_loadu_ps(tv->td8 + 8 * (8 * (size_t)i));   /* the tokens' scales D_k */
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[r]), _mm256_mul_ps(_mm256_broadcast_ss(WD[r] + 16 * (size_t)i + 1), td), acc[r]);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(res + 8 * r, _mm256_add_ps(acc[r], accM[r]));
}

/* R unpacked rows against the 8 token lanes of the tile: res[8 r + k]. */
A256 AINL void pf8_rowsR_256(const int t, const int R, const uint8_t *const *ur, int nb, const tile *tv, float *res) {
    if (t == RQ_Q4_K) {
        pf8_q4k_256(R, ur, nb, tv, res);
        return;
    }
    __m256 aE[PF8_RMAX][2], aO[PF8_RMAX][2], mE[PF8_RMAX], mO[PF8_RMAX];
    for (int r = 0; r < R; r++) aE[r][0] = aE[r][1] = aO[r][0] = aO[r][1] = mE[r] = mO[r] = _mm256_setzero_ps();
    pf8_pass(t, R, ur, nb, tv, 0, aE, mE);
    pf8_pass(t, R, ur, nb, tv, 1, aO, mO);
    for (int r = 0; r < R; r++) {
        if (nb & 1) mO[r] = _mm256_add_ps(mO[r], _mm256_setzero_ps());   /* the slot kernels' padded fma(0, 0, accM) */
        __m256 a = _mm256_add_ps(_mm256_add_ps(aE[r][0], aO[r][0]), _mm256_add_ps(aE[r][1], aO[r][1]));
        if (type_has_min(t)) a = _mm256_add_ps(a, _mm256_add_ps(mE[r], mO[r]));
        _mm256_storeu_ps(res + 8 * r, a);
    }
}

A256 AINL void pf8_unpack_256(const int t, const uint8_t *W, size_t rb, int r0, int r1, int nb, uint8_t *buf) {
    const size_t us = pf8_urow_bytes(nb);
    for (int r = r0; r < r1; r++) {
        const uint8_t *row = W + (size_t)r * rb;
        uint8_t *ur = buf + (size_t)(r - r0) * us;
        if (t == RQ_Q4_K) pf8_unpack_q4k(row, nb, ur);
        else if (t == RQ_Q5_K) pf8_unpack_q5k(row, nb, ur);
        else if (t == RQ_Q6_K) pf8_unpack_q6k(row, nb, ur);
        else pf8_unpack_legacy(t, row, nb, ur);
    }
}

/* R rows [r, r + R) of the chunk at buf against the tile: out[(k0 + k) * ldo + r + i]. */
A256 AINL void pf8_rows_store_256(const int t, const int R, const uint8_t *buf, int r0, int r, int nb, const tile *tv,
                                  float *out, int ldo, int k0) {
    const size_t us = pf8_urow_bytes(nb);
    const uint8_t *ur[PF8_RMAX];
    _Alignas(32) float res[8 * PF8_RMAX];
    for (int i = 0; i < R; i++) ur[i] = buf + (size_t)(r + i - r0) * us;
    pf8_rowsR_256(t, R, ur, nb, tv, res);
    for (int k = 0; k < tv->T; k++)
        for (int i = 0; i < R; i++) out[(size_t)(k0 + k) * ldo + r + i] = res[8 * i + k];
}

/* Rows [r0, r1), unpacked at buf, against a tile of T >= 3 tokens: out[(k0 + k) * ldo + r], three
 * rows per pass sharing the tokens' loads (each row keeps its own accumulators, so the results are
 * those of one row per pass). On Zen 5 running this AVX2 code, three rows per pass made prefill
 * 1.12x faster than one (1.5B and 8B shapes), two rows 1.09x, four 1.10x; on Zen 3 two rows had
 * measured no faster than one (an earlier session), not slower. */
A256 AINL void pf8_rows_256(const int t, const uint8_t *buf, int r0, int r1, int nb, const tile *tv, float *out,
                            int ldo, int k0) {
    int r = r0;
    for (; r + 3 <= r1; r += 3) pf8_rows_store_256(t, 3, buf, r0, r, nb, tv, out, ldo, k0);
    if (r1 - r == 2) pf8_rows_store_256(t, 2, buf, r0, r, nb, tv, out, ldo, k0);
    else if (r1 - r == 1) pf8_rows_store_256(t, 1, buf, r0, r, nb, tv, out, ldo, k0);
}

#define PF8_256(suffix, t)                                                                                  \
    A256 static void pf8u_##suffix(const uint8_t *W, size_t rb, int r0, int r1, int nb, uint8_t *buf) {     \
        pf8_unpack_256(t, W, rb, r0, r1, nb, buf);                                                          \
    }                                                                                                       \
    A256 static void pf8r_##suffix(const uint8_t *buf, int r0, int r1, int nb, const tile *tv, float *out,  \
                                   int ldo, int k0) {                                                       \
        pf8_rows_256(t, buf, r0, r1, nb, tv, out, ldo, k0);                                                 \
    }
PF8_256(q4_0, RQ_Q4_0)
PF8_256(q4_1, RQ_Q4_1)
PF8_256(q5_0, RQ_Q5_0)
PF8_256(q5_1, RQ_Q5_1)
PF8_256(q4_K, RQ_Q4_K)
PF8_256(q5_K, RQ_Q5_K)
PF8_256(q6_K, RQ_Q6_K)

#endif /* x86 */
