/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). The R16 drivers, generic over the types (layout: r16_layout.c; each type's
 * unit, repacking and block loaders: its file): group addressing and repacking, and on x86 the
 * AVX-512 and AVX2 kernels on repacked groups, the R16_GROUPS kernels of the OPS table. */

/* How far ahead (bytes) decode asks for a group's units, and into L1 (T0) or L2 (T1), per type:
 * rq_r16_set_prefetch, chosen by timing at load (engine/decode_tuning.py). */
static size_t r16_pf_ahead[RQ_BF16 + 1] = {[0 ... RQ_BF16] = 6144};
static int r16_pf_to_l2[RQ_BF16 + 1];

/* Where things are in a group of type t: the type's unit (r16_layout_*), and its decode prefetch. */
static r16_ptrs r16_group_ptrs(int t, const uint8_t *g, int nb) {
    r16_ptrs p;
    memset(&p, 0, sizeof(p));
    (void)nb;
    p.g = g;
    p.bpu = 1;
    p.pf_ahead = r16_pf_ahead[t];
    p.pf_to_l2 = r16_pf_to_l2[t];
    switch (t) {
    case RQ_Q4_K: r16_layout_q4k(&p); break;
    case RQ_Q5_K: r16_layout_q5k(&p); break;
    case RQ_Q6_K: r16_layout_q6k(&p); break;
    case RQ_IQ4_XS: r16_layout_iq4xs(&p); break;
    default: r16_layout_legacy(t, &p); break;
    }
    return p;
}

static size_t r16_group_bytes_t(int t, int nb) {
    const r16_ptrs p = r16_group_ptrs(t, NULL, nb);
    return p.ub * (size_t)(nb / p.bpu);
}

/* --- repacking (scalar: runs once per model file, bound by reading the file) --- */

/* Row r (0..15) of a group: its blocks' bits and scales into the group's units. */
static void r16_repack_row(int t, const uint8_t *row, int nb, const r16_ptrs *p, int r) {
    if (t == RQ_Q4_0 || t == RQ_Q4_1 || t == RQ_Q5_0 || t == RQ_Q5_1 || t == RQ_IQ4_NL) r16_repack_row_legacy(t, row, nb, p, r);
    else if (t == RQ_Q8_0) r16_repack_row_q8_0(row, nb, p, r);
    else if (t == RQ_Q4_K) r16_repack_row_q4k(row, nb, p, r);
    else if (t == RQ_Q5_K) r16_repack_row_q5k(row, nb, p, r);
    else if (t == RQ_Q6_K) r16_repack_row_q6k(row, nb, p, r);
    else if (t == RQ_IQ4_XS) r16_repack_row_iq4xs(row, nb, p, r);
}
static size_t r16_bytes(int t, int rows, int cols) {
    return r16_group_bytes_t(t, cols / QK) * (size_t)((rows + 15) / 16);
}

/* Groups [g0, g1) of W into R (the whole repacked matrix); rows past the end are zero. */
static void r16_repack_groups(int t, const uint8_t *W, int rows, int cols, uint8_t *R, int g0, int g1) {
    const int nb = cols / QK;
    const size_t rb = rq_row_bytes(t, cols), gbytes = r16_group_bytes_t(t, nb);
    for (int g = g0; g < g1; g++) {
        uint8_t *dst = R + gbytes * (size_t)g;
        memset(dst, 0, gbytes);
        const r16_ptrs p = r16_group_ptrs(t, dst, nb);
        for (int r = 0; r < 16 && 16 * g + r < rows; r++) r16_repack_row(t, W + rb * (size_t)(16 * g + r), nb, &p, r);
    }
}

#ifdef RQ_HAVE_X86

/* Slice k of n of the unit at u, pf_ahead bytes further on. The AVX2 decode kernels ask for a unit
 * a slice at a time as they go through its blocks, not all at once: on a Zen 3 (one-token matmuls,
 * 32768 x 2048, from DRAM, 2 threads) a K-type unit's 37-53 prefetches in one burst held Q6_K to
 * 10-12 GB/s and Q5_K to 8-12; spread out, 18-20 and 17-18, Q4_K 13-17 -> 17-21, IQ4_XS 15-16 ->
 * 18-19 (the machine's plain streaming read: 16-21 GB/s). One thread: 1.15x-2x. (The AVX-512
 * kernels still ask for whole units: not measured on a machine with AVX-512 yet.) */
AINL void r16_prefetch_slice(const r16_ptrs *p, const uint8_t *u, size_t k, size_t n) {
    if (p->pf_ahead == 0) return;   /* off: no instructions spent on it */
    const char *ahead = (const char *)u + p->pf_ahead;
    const size_t lines = (p->ub + 63) / 64, l0 = lines * k / n, l1 = lines * (k + 1) / n;
    if (p->pf_to_l2)
        for (size_t l = l0; l < l1; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
    else
        for (size_t l = l0; l < l1; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
}
/* Ask for the unit at u, pf_ahead bytes further on, as the group's type is set to (r16_group_ptrs). */
AINL void r16_prefetch_unit(const r16_ptrs *p, const uint8_t *u) { r16_prefetch_slice(p, u, 0, 1); }
/* Streaming a group from DRAM: at the first block of each unit, ask for the unit pf_ahead further on. */
AINL void r16_prefetch_ahead(const r16_ptrs *p, size_t b) {
    if (r16_j(p, b) != 0) return;
    r16_prefetch_unit(p, r16_unit(p, b));
}
/* Block b's slice of its unit (a unit of one block: all of it), pf_ahead bytes further on. Units hold
 * 1 or 8 blocks (r16_layout_*): a constant divides the unit's lines. */
AINL void r16_prefetch_block(const r16_ptrs *p, size_t b) {
    if (p->bpu == 1) r16_prefetch_unit(p, r16_unit(p, b));
    else r16_prefetch_slice(p, r16_unit(p, b), r16_j(p, b), 8);
}
/* A pass over blocks two at a time (b, b + 1): ask for both blocks' units (with one block per unit,
 * as the legacy types have, asking at even blocks only leaves every other unit to the hardware). */
AINL void r16_prefetch_pair(const r16_ptrs *p, size_t b, int nb) {
    r16_prefetch_ahead(p, b);
    if (b + 1 < (size_t)nb) r16_prefetch_ahead(p, b + 1);
}
/* ---- R16 kernels (AVX-512) ---- */

/* Block b of a group in registers: W[4h + g] (the v16 U vectors), the half scales and the mins. */
A512 AINL void r16_block(const int t, const r16_ptrs *p, size_t b, __m512i *W, __m512 *wd0, __m512 *wd1, __m512 *mn) {
    const uint8_t *u = r16_unit(p, b);
    const size_t j = r16_j(p, b);
    if (t == RQ_Q4_K) r16_block_q4k(p, u, j, W, wd0, wd1, mn);
    else if (t == RQ_Q5_K) r16_block_q5k(p, u, j, W, wd0, wd1, mn);
    else if (t == RQ_Q6_K) r16_block_q6k(p, u, j, W, wd0, wd1, mn);
    else if (t == RQ_IQ4_XS) r16_block_iq4xs(p, u, j, W, wd0, wd1, mn);
    else r16_block_legacy(t, p, u, j, W, wd0, wd1, mn);
}

/* A group expanded into the v16 layout (for calls with many tokens: expanded once, then every
 * token tile runs v16_tile on it). */
A512 static void r16_expand(const int t, const uint8_t *g, int nb, uint8_t *grp) {
    const r16_ptrs p = r16_group_ptrs(t, g, nb);
    __m512i *U = (__m512i *)grp;
    float *WD = (float *)(grp + 512 * (size_t)nb), *M = WD + 32 * (size_t)nb;
    for (int b = 0; b < nb; b++) {
        r16_prefetch_ahead(&p, (size_t)b);
        __m512i W[8];
        __m512 wd0, wd1, mn;
        r16_block(t, &p, (size_t)b, W, &wd0, &wd1, &mn);
        for (int j = 0; j < 8; j++) _mm512_storeu_si512(U + 8 * (size_t)b + j, W[j]);
        _mm512_storeu_ps(WD + 32 * (size_t)b, wd0);
        _mm512_storeu_ps(WD + 32 * (size_t)b + 16, wd1);
        _mm512_storeu_ps(M + 16 * (size_t)b, mn);
    }
}

/* Block b of a repacked group against T tokens (from token k0 of the tile), straight from the
 * packed data, into acc[k][h] and accM[k]: v16_pass's steps for one block. */
A512 AINL void r16_block_acc(const int t, const r16_ptrs *p, size_t b, const int T, const uint8_t *tile, int k0,
                             __m512 (*acc)[2], __m512 *accM) {
    const int offs = type_offset(t) != 0, mins = type_has_min(t);
    const uint8_t *tb = tile + b * V16_TILE_BLOCK_BYTES;
    const int32_t *nq = (const int32_t *)(tb + 256);
    const float *d = (const float *)(tb + 320), *ds = (const float *)(tb + 352);
    __m512i W[8];
    __m512 wd0, wd1, mn;
    r16_block(t, p, b, W, &wd0, &wd1, &mn);
    if (type_s8_block(t)) {   /* both halves' sums joined in int32, one float step (v16_pass) */
        for (int k = 0; k < T; k++) {
            const uint8_t *qd = tb + 32 * (k0 + k);
            __m512i P = _mm512_set1_epi32(nq[k0 + k] + nq[8 + k0 + k]);
            for (int j = 0; j < 8; j++) P = _mm512_dpbusd_epi32(P, W[j], _mm512_set1_epi32((int)load_u32(qd + 4 * j)));
            acc[k][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), _mm512_mul_ps(wd0, _mm512_set1_ps(d[k0 + k])), acc[k][0]);
        }
        return;
    }
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < T; k++) {
            const uint8_t *qd = tb + 32 * (k0 + k) + 16 * h;
            __m512i P = offs ? _mm512_set1_epi32(nq[8 * h + k0 + k]) : _mm512_setzero_si512();
            P = _mm512_dpbusd_epi32(P, W[4 * h], _mm512_set1_epi32((int)load_u32(qd)));
            P = _mm512_dpbusd_epi32(P, W[4 * h + 1], _mm512_set1_epi32((int)load_u32(qd + 4)));
            P = _mm512_dpbusd_epi32(P, W[4 * h + 2], _mm512_set1_epi32((int)load_u32(qd + 8)));
            P = _mm512_dpbusd_epi32(P, W[4 * h + 3], _mm512_set1_epi32((int)load_u32(qd + 12)));
            const __m512 s = _mm512_mul_ps(h ? wd1 : wd0, _mm512_set1_ps(d[k0 + k]));
            acc[k][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), s, acc[k][h]);
        }
    if (mins)
        for (int k = 0; k < T; k++) accM[k] = _mm512_fmadd_ps(mn, _mm512_set1_ps(ds[k0 + k]), accM[k]);
}

/* Blocks par, par + 2, ... (par = -1: every block, even ones into aE/mE, odd ones into aO/mO,
 * so the data is read once: decode-sized T keeps all accumulators in registers). */
A512 AINL void r16_pass(const int t, const r16_ptrs *p, int nb, const int T, const uint8_t *tile, int k0,
                        const int par, __m512 (*aE)[2], __m512 *mE, __m512 (*aO)[2], __m512 *mO) {
    if (par < 0) {
        int b = 0;
        for (; b + 1 < nb; b += 2) {
            r16_prefetch_pair(p, (size_t)b, nb);
            r16_block_acc(t, p, (size_t)b, T, tile, k0, aE, mE);
            r16_block_acc(t, p, (size_t)b + 1, T, tile, k0, aO, mO);
        }
        if (b < nb) r16_block_acc(t, p, (size_t)b, T, tile, k0, aE, mE);
        return;
    }
    for (int b = par; b < nb; b += 2) {
        if (par == 0) r16_prefetch_pair(p, (size_t)b, nb);   /* the odd pass then finds the group in cache */
        r16_block_acc(t, p, (size_t)b, T, tile, k0, par ? aO : aE, par ? mO : mE);
    }
}

#define R16_TMAX 4

/* Q4_K and IQ4_XS (type_sb_int; their float sequences: q4_K.c, iq4_xs.c): a packed group against
 * T <= R16_TMAX tokens, one pass. IQ4_XS's values + 128 take the tile's offset correction nq. */
A512 AINL void r16_tile_sb(const int t, const r16_ptrs *p, int nb, const int T, const uint8_t *tile, int k0, float *out,
                           int ldo, int nr) {
    const int mins = type_has_min(t);
    __m512 acc[R16_TMAX], accM[R16_TMAX];
    for (int k = 0; k < T; k++) acc[k] = accM[k] = _mm512_setzero_ps();
    for (int i = 0; i < nb / 8; i++) {
        __m512i I[R16_TMAX];
        __m512 dv = _mm512_setzero_ps();
        for (int k = 0; k < T; k++) I[k] = _mm512_setzero_si512();
        for (int b = 8 * i; b < 8 * i + 8; b++) {
            r16_prefetch_ahead(p, (size_t)b);
            const uint8_t *tb = tile + (size_t)b * V16_TILE_BLOCK_BYTES;
            const int32_t *nq = (const int32_t *)(tb + 256);
            const float *ds = (const float *)(tb + 352);
            __m512i W[8];
            __m512 sc, mn;
            r16_block(t, p, (size_t)b, W, &sc, &dv, &mn);
            const __m512i isc = _mm512_cvttps_epi32(sc);
            for (int k = 0; k < T; k++) {
                __m512i P = v16_dot_block(W, tb + 32 * (k0 + k));
                if (!mins) P = _mm512_add_epi32(P, _mm512_set1_epi32(nq[k0 + k] + nq[8 + k0 + k]));   /* IQ4_XS */
                I[k] = _mm512_add_epi32(I[k], _mm512_mullo_epi32(P, isc));
                if (mins) accM[k] = _mm512_fmadd_ps(mn, _mm512_set1_ps(ds[k0 + k]), accM[k]);
            }
        }
        const float *D = v16_tile_d(tile, 8 * (size_t)i);   /* the tokens' D_k */
        for (int k = 0; k < T; k++) acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[k]), _mm512_mul_ps(dv, _mm512_set1_ps(D[k0 + k])), acc[k]);
    }
    const __mmask16 keep = nr >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nr) - 1);
    for (int k = 0; k < T; k++) _mm512_mask_storeu_ps(out + (size_t)k * ldo, keep, _mm512_add_ps(acc[k], accM[k]));
}

A512 AINL void r16_tile(const int t, const r16_ptrs *p, int nb, const int T, const uint8_t *tile, int k0, float *out,
                        int ldo, int nr) {
    if (type_sb_int(t)) {
        r16_tile_sb(t, p, nb, T, tile, k0, out, ldo, nr);
        return;
    }
    __m512 aE[R16_TMAX][2], aO[R16_TMAX][2], mE[R16_TMAX], mO[R16_TMAX];
    for (int k = 0; k < T; k++) aE[k][0] = aE[k][1] = aO[k][0] = aO[k][1] = mE[k] = mO[k] = _mm512_setzero_ps();
    if (T <= 3 || (T == 4 && !type_has_min(t))) {   /* every accumulator fits in the 32 registers */
        r16_pass(t, p, nb, T, tile, k0, -1, aE, mE, aO, mO);
    } else {   /* one parity at a time: half the accumulators live */
        r16_pass(t, p, nb, T, tile, k0, 0, aE, mE, aO, mO);
        r16_pass(t, p, nb, T, tile, k0, 1, aE, mE, aO, mO);
    }
    const __mmask16 keep = nr >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nr) - 1);
    for (int k = 0; k < T; k++) {
        __m512 r = type_s8_block(t) ? _mm512_add_ps(aE[k][0], aO[k][0])
                                    : _mm512_add_ps(_mm512_add_ps(aE[k][0], aO[k][0]), _mm512_add_ps(aE[k][1], aO[k][1]));
        if (type_has_min(t)) {
            __m512 mo = mO[k];
            if (nb & 1) mo = _mm512_add_ps(mo, _mm512_setzero_ps());   /* the slot kernels' padded fma(0, 0, .) */
            r = _mm512_add_ps(r, _mm512_add_ps(mE[k], mo));
        }
        _mm512_mask_storeu_ps(out + (size_t)k * ldo, keep, r);
    }
}

#define R16_TILE_T(t, p, nb, tile, k0, out, ldo, nr, T) r16_tile(t, p, nb, T, tile, k0, out, ldo, nr)

/* Calls of this many tokens or more take the expand-then-v16 route (the plan's `expand`; the loops
 * below expand when given group buffers). AVX-512: 12, timed on Zen 4. AVX2: 8. Zen 3, one thread,
 * 768 x 2048, GMAC/s at 8 tokens, packed vs expanded: Q4_K 36 vs 51, Q6_K 35 vs 51, Q4_0 35 vs 41,
 * Q5_K 32 vs 37, IQ4_XS 33 vs 37; Q8_0 (with its whole-tile kernel, r16_tile16_halves_256) 34-35 vs
 * 36-38 at 8-11 tokens; below 8 they were within the noise of each other. */
#define R16_EXPAND_MIN_TOK 12
#define R16_EXPAND_MIN_TOK_256 8

/* Groups [g0, g1) of a repacked matrix (rows rows) against all token tiles: the loops of r16_groups
 * (AVX-512) and r16_groups_256 (AVX2), written once over the variables of their common signature.
 * Given grp (gmax v16 group buffers: the plan's expand), up to gmax groups at a time are expanded (EXPAND) into it
 * and every tile runs over them: EXPANDED_HEAD declares tile i's `tile` and T (its tokens, <= 8),
 * EXPANDED_TILE runs it against expanded group g, rows r0.. (nr of them). Else (grp NULL) straight from
 * the packed data: PACKED_TILE runs tile i against the group at p. The hooks are statements, not
 * functions: called as functions, the same code compiled to other instructions in the kernels they
 * inline, and these loops must stay exactly the code they were. */
#define R16_GROUPS_LOOPS(EXPAND, EXPANDED_HEAD, EXPANDED_TILE, PACKED_TILE)                                \
    const size_t gbytes = r16_group_bytes_t(t, nb), vb = (v16_group_bytes(nb) + 63) & ~(size_t)63;            \
    if (grp) {                                                                                                 \
        for (int c0 = g0; c0 < g1; c0 += gmax) {                                                               \
            const int c1 = c0 + gmax < g1 ? c0 + gmax : g1;                                                    \
            for (int g = c0; g < c1; g++) EXPAND(t, R + gbytes * (size_t)g, nb, grp + vb * (size_t)(g - c0)); \
            for (int i = 0; i < tk->ntiles; i++) {                                                             \
                EXPANDED_HEAD                                                                                  \
                for (int g = c0; g < c1; g++) {                                                                \
                    const int r0 = 16 * g, nr = rows - r0 < 16 ? rows - r0 : 16;                               \
                    EXPANDED_TILE                                                                              \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        return;                                                                                                \
    }                                                                                                          \
    for (int g = g0; g < g1; g++) {                                                                            \
        const r16_ptrs p = r16_group_ptrs(t, R + gbytes * (size_t)g, nb);                                      \
        const int r0 = 16 * g, nr = rows - r0 < 16 ? rows - r0 : 16;                                           \
        for (int i = 0; i < tk->ntiles; i++) {                                                                 \
            const uint8_t *tile = tk->mem + (size_t)i * nb * V16_TILE_BLOCK_BYTES;                             \
            PACKED_TILE                                                                                        \
        }                                                                                                      \
    }

/* AVX-512: an expanded group through the v16 kernel; a packed one R16_TMAX tokens at a time. */
#define R16_EXPANDED_HEAD_512                                                                                   \
    const int k0 = 8 * i, T = ntok - k0 < 8 ? ntok - k0 : 8;                                                   \
    const uint8_t *tile = tk->mem + (size_t)i * nb * V16_TILE_BLOCK_BYTES;
#define R16_EXPANDED_TILE_512                                                                                   \
    DISPATCH_T8(V16_TILE_T, t, grp + vb * (size_t)(g - c0), nb, tile, out + (size_t)k0 * ldo + r0, ldo, nr);
#define R16_PACKED_TILE_512                                                                                     \
    for (int k0 = 0; k0 < 8 && 8 * i + k0 < ntok; k0 += R16_TMAX) {                                            \
        const int left = ntok - 8 * i - k0, T = left < R16_TMAX ? left : R16_TMAX;                             \
        DISPATCH_T4(R16_TILE_T, t, &p, nb, tile, k0, out + (size_t)(8 * i + k0) * ldo + r0, ldo, nr);          \
    }

A512 AINL void r16_groups(const int t, const uint8_t *R, int rows, int g0, int g1, int nb, int ntok,
                          const v16_toks *tk, float *out, int ldo, uint8_t *grp, int gmax) {
    R16_GROUPS_LOOPS(r16_expand, R16_EXPANDED_HEAD_512, R16_EXPANDED_TILE_512, R16_PACKED_TILE_512)
}

typedef void (*r16_groups_fn)(const uint8_t *R, int rows, int g0, int g1, int nb, int ntok, const v16_toks *tk,
                              float *out, int ldo, uint8_t *grp, int gmax);

/* ---- R16 on AVX2: the same layout and float sequence, 8 rows per vector (the low or high 32
 * bytes of each 64-byte entry: rows 0-7 or 8-15 of the group), vpmaddubsw + vpmaddwd for the
 * exact integer sums (as the AVX2 prefill kernels: 4-bit and 5-bit values add up in int16, Q6_K
 * in pairs, the signed types (type_s8: Q8_0, IQ4_NL, IQ4_XS) through the sign trick). ----
 *
 * Deliberate twins: every R16 helper and kernel has an AVX-512 form (16 rows per vector) and an
 * AVX2 form (8 rows, the `_256` names, here and in the types' files). The AVX2 path needs them on
 * CPUs without AVX-512, and on cores that split 512-bit operations they decode faster (timed at
 * load: engine/decode_tuning.py). They cannot share a body: the vector widths differ, and so do the
 * integer sums (VNNI vpdpbusd against vpmaddubsw + vpmaddwd); they share the float sequence, so
 * their results are equal bit for bit (tests/test_r16.py). */

/* Block b of a group, rows 8q..8q+7: the v16 U vectors (the signed types: their signed values),
 * half scales and mins. */
A256 AINL void r16_block_256(const int t, const r16_ptrs *p, size_t b, const int q, __m256i *W, __m256 *wd0,
                             __m256 *wd1, __m256 *mn) {
    const uint8_t *u = r16_unit(p, b);
    const size_t j = r16_j(p, b);
    if (t == RQ_Q4_K) r16_block_q4k_256(p, u, j, q, W, wd0, wd1, mn);
    else if (t == RQ_Q5_K) r16_block_q5k_256(p, u, j, q, W, wd0, wd1, mn);
    else if (t == RQ_Q6_K) r16_block_q6k_256(p, u, j, q, W, wd0, wd1, mn);
    else if (t == RQ_IQ4_XS) r16_block_iq4xs_256(p, u, j, q, W, wd0, wd1, mn);
    else r16_block_legacy_256(t, p, u, j, q, W, wd0, wd1, mn);
}

/* Exact sum over the 16 elements of a half: 8 rows' U (Wh[0..3]: groups g) times one token's
 * activations qd (16 bytes). The signed types return the offset-free sum directly. */
A256 AINL __m256i r16_dot_256(const int t, const __m256i *Wh, const uint8_t *qd) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (type_s8(t)) return r16_dot_s8_256(Wh, qd);
    const __m256i p0 = _mm256_maddubs_epi16(Wh[0], _mm256_set1_epi32((int)load_u32(qd)));
    const __m256i p1 = _mm256_maddubs_epi16(Wh[1], _mm256_set1_epi32((int)load_u32(qd + 4)));
    const __m256i p2 = _mm256_maddubs_epi16(Wh[2], _mm256_set1_epi32((int)load_u32(qd + 8)));
    const __m256i p3 = _mm256_maddubs_epi16(Wh[3], _mm256_set1_epi32((int)load_u32(qd + 12)));
    if (t == RQ_Q6_K)   /* U <= 63: only pairs of vpmaddubsw sums fit in int16 */
        return _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones), _mm256_madd_epi16(_mm256_add_epi16(p2, p3), ones));
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p0, p1), _mm256_add_epi16(p2, p3)), ones);
}

/* One block's contribution for T tokens (from k0): v16_pass's steps, 8 rows. */
A256 AINL void r16_acc_256(const int t, const __m256i *W, __m256 wd0, __m256 wd1, __m256 mn, const uint8_t *tb,
                           const int T, int k0, __m256 (*acc)[2], __m256 *accM) {
    const int offs = type_offset(t) != 0 && !type_s8(t), mins = type_has_min(t);
    const int32_t *nq = (const int32_t *)(tb + 256);
    const float *d = (const float *)(tb + 320), *ds = (const float *)(tb + 352);
    if (type_s8_block(t)) {   /* both halves' offset-free sums joined in int32, one float step */
        for (int k = 0; k < T; k++) {
            const uint8_t *qd = tb + 32 * (k0 + k);
            const __m256i P = _mm256_add_epi32(r16_dot_256(t, W, qd), r16_dot_256(t, W + 4, qd + 16));
            acc[k][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_mul_ps(wd0, _mm256_set1_ps(d[k0 + k])), acc[k][0]);
        }
        return;
    }
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < T; k++) {
            __m256i P = r16_dot_256(t, W + 4 * h, tb + 32 * (k0 + k) + 16 * h);
            if (offs) P = _mm256_add_epi32(P, _mm256_set1_epi32(nq[8 * h + k0 + k]));
            const __m256 s = _mm256_mul_ps(h ? wd1 : wd0, _mm256_set1_ps(d[k0 + k]));
            acc[k][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), s, acc[k][h]);
        }
    if (mins)
        for (int k = 0; k < T; k++) accM[k] = _mm256_fmadd_ps(mn, _mm256_set1_ps(ds[k0 + k]), accM[k]);
}

A256 AINL void r16_store_256(const int t, int nb, const int T, __m256 (*aE)[2], __m256 (*aO)[2], __m256 *mE,
                             __m256 *mO, float *out, int ldo, int nr) {
    _Alignas(32) float tmp[8];
    for (int k = 0; k < T; k++) {
        __m256 r = type_s8_block(t) ? _mm256_add_ps(aE[k][0], aO[k][0])
                                    : _mm256_add_ps(_mm256_add_ps(aE[k][0], aO[k][0]), _mm256_add_ps(aE[k][1], aO[k][1]));
        if (type_has_min(t)) {
            __m256 mo = mO[k];
            if (nb & 1) mo = _mm256_add_ps(mo, _mm256_setzero_ps());   /* the slot kernels' padded fma(0, 0, .) */
            r = _mm256_add_ps(r, _mm256_add_ps(mE[k], mo));
        }
        if (nr >= 8) {
            _mm256_storeu_ps(out + (size_t)k * ldo, r);
        } else {
            _mm256_store_ps(tmp, r);
            for (int i = 0; i < nr; i++) out[(size_t)k * ldo + i] = tmp[i];
        }
    }
}

/* A group's 16 results (lo: rows 0-7, hi: rows 8-15) to out[0, nr). A full group stores its vectors:
 * copied through memory, the loop became a memcpy call per group and token (7% of 1.5B-shape prefill). */
A256 AINL void r16_store16_256(__m256 lo, __m256 hi, float *out, int nr) {
    if (nr >= 16) {
        _mm256_storeu_ps(out, lo);
        _mm256_storeu_ps(out + 8, hi);
        return;
    }
    _Alignas(32) float tmp[16];
    _mm256_store_ps(tmp, lo);
    _mm256_store_ps(tmp + 8, hi);
    for (int r = 0; r < nr; r++) out[r] = tmp[r];
}

/* Q4_K and IQ4_XS (type_sb_int; their float sequences: q4_K.c, iq4_xs.c), rows 8q.. of a packed
 * group against T <= 2 tokens (from k0), one pass. */
A256 AINL void r16_sb_256(const int t, const r16_ptrs *p, int nb, const int T, const uint8_t *tile, int k0, const int q,
                          float *out, int ldo, int nr) {
    const int mins = type_has_min(t);
    __m256 acc[4], accM[4];
    for (int k = 0; k < T; k++) acc[k] = accM[k] = _mm256_setzero_ps();
    for (int i = 0; i < nb / 8; i++) {
        __m256i I[4];
        __m256 dv = _mm256_setzero_ps();
        for (int k = 0; k < T; k++) I[k] = _mm256_setzero_si256();
        for (int b = 8 * i; b < 8 * i + 8; b++) {
            const uint8_t *tb = tile + (size_t)b * V16_TILE_BLOCK_BYTES;
            const float *ds = (const float *)(tb + 352);
            __m256i W[8];
            __m256 sc, mn;
            if (q == 0) r16_prefetch_block(p, (size_t)b);
            r16_block_256(t, p, (size_t)b, q, W, &sc, &dv, &mn);
            const __m256i isc = _mm256_cvttps_epi32(sc);
            for (int k = 0; k < T; k++) {
                const uint8_t *qd = tb + 32 * (k0 + k);   /* IQ4_XS: offset-free sums (r16_dot_256) */
                const __m256i P = _mm256_add_epi32(r16_dot_256(t, W, qd), r16_dot_256(t, W + 4, qd + 16));
                I[k] = _mm256_add_epi32(I[k], _mm256_mullo_epi32(P, isc));
                if (mins) accM[k] = _mm256_fmadd_ps(mn, _mm256_set1_ps(ds[k0 + k]), accM[k]);
            }
        }
        const float *D = v16_tile_d(tile, 8 * (size_t)i);   /* the tokens' D_k */
        for (int k = 0; k < T; k++) acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[k]), _mm256_mul_ps(dv, _mm256_set1_ps(D[k0 + k])), acc[k]);
    }
    _Alignas(32) float tmp[8];
    for (int k = 0; k < T; k++) {
        const __m256 r = _mm256_add_ps(acc[k], accM[k]);
        if (nr >= 8) {
            _mm256_storeu_ps(out + (size_t)k * ldo, r);
        } else {
            _mm256_store_ps(tmp, r);
            for (int i = 0; i < nr; i++) out[(size_t)k * ldo + i] = tmp[i];
        }
    }
}

/* Q4_K, one token (decode): rows 8q.. of the super-block unit u against token k0 (tile: the
 * token's blocks), into the sums acc and accM: r16_sb_256's float sequence, with what a unit holds
 * once (d, dmin) read once, a block's int16 sums kept whole (8 x 2 x 15 x 128 fits, as in
 * pf8_q4k_256: one vpmaddwd a block) and the sums in registers. */
A256 AINL void r16_q4k_unit1_256(const r16_ptrs *p, const uint8_t *u, const uint8_t *tile, int k0, const int q,
                                 __m256 *acc, __m256 *accM) {
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->kd + 16 * q)));
    const __m256 ndm = _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->kdm + 16 * q))),
                                     _mm256_set1_ps(-0.0f));
    __m256i I = _mm256_setzero_si256();
    __m256 M = *accM;
    for (int j = 0; j < 8; j++) {
        /* the unit (for both halves) in four slices, two per half: a slice every block cost 4-8 %
         * on cache-resident matrices, where this kernel is compute-bound */
        if ((j & 3) == 0) r16_prefetch_slice(p, u, (size_t)(2 * q + j / 4), 4);
        const uint8_t *tb = tile + (size_t)j * V16_TILE_BLOCK_BYTES, *qd = tb + 32 * k0;
        __m256i W[8], S = _mm256_setzero_si256();
        r16_nib_256(p, u, (size_t)j, 32 * (size_t)q, W);
        for (int g = 0; g < 8; g++)   /* W[4 h + g] against the token's dword g of half h */
            S = _mm256_add_epi16(S, _mm256_maddubs_epi16(W[g], _mm256_set1_epi32((int)load_u32(qd + 16 * (g / 4) + 4 * (g % 4)))));
        const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + p->ksc + 16 * j + 8 * q)));
        I = _mm256_add_epi32(I, _mm256_madd_epi16(S, k4_scale_pairs_256(sc)));
        const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + p->kmn + 16 * j + 8 * q))));
        M = _mm256_fmadd_ps(_mm256_mul_ps(m, ndm), _mm256_set1_ps(((const float *)(tb + 352))[k0]), M);
    }
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(dv, _mm256_set1_ps(v16_tile_d(tile, 0)[k0])), *acc);
    *accM = M;
}

/* Q4_K, one token (decode): all 16 rows of a packed group, both 8-row halves super-block by
 * super-block, so the group streams from memory once, each unit read by the second half while it
 * is still in L1 (half by half over the whole group, the second pass found it in L2 and asked
 * memory for nothing meanwhile). Per lane the sequence of r16_sb_256. */
A256 AINL void r16_q4k16_256(const r16_ptrs *p, int nb, const uint8_t *tile, int k0, float *out, int nr) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), accM0 = _mm256_setzero_ps(), accM1 = _mm256_setzero_ps();
    for (int i = 0; i < nb / 8; i++) {
        const uint8_t *u = p->g + (size_t)i * p->ub, *t8 = tile + (size_t)(8 * i) * V16_TILE_BLOCK_BYTES;
        r16_q4k_unit1_256(p, u, t8, k0, 0, &acc0, &accM0);
        r16_q4k_unit1_256(p, u, t8, k0, 1, &acc1, &accM1);
    }
    r16_store16_256(_mm256_add_ps(acc0, accM0), _mm256_add_ps(acc1, accM1), out, nr);
}

/* Q6_K, one token (decode): both 8-row halves (q) of the super-block unit u against token k0, into
 * the sums a[q][2 par + h] of r16_half_256's sequence (block parity, half h): the unit's d read once,
 * each of the token's dwords broadcast once for all 16 rows (a kernel per 8-row half broadcast them
 * twice: 16 % slower on Zen 4 running AVX2, where this kernel is bound by its vector operations). */
A256 AINL void r16_q6k_unit2_256(const r16_ptrs *p, const uint8_t *u, const uint8_t *tile, int k0, __m256 (*a)[4]) {
    const __m256i ones = _mm256_set1_epi16(1), m = _mm256_set1_epi8((char)0xC0);
    __m256 dr[2];
    for (int q = 0; q < 2; q++) dr[q] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->qd + 16 * q)));
    for (int j = 0; j < 8; j++) {
        r16_prefetch_slice(p, u, (size_t)j, 8);
        const uint8_t *tb = tile + (size_t)j * V16_TILE_BLOCK_BYTES, *qd = tb + 32 * k0;
        const int32_t *nq = (const int32_t *)(tb + 256);
        const __m256 dt = _mm256_set1_ps(((const float *)(tb + 320))[k0]);
        for (int h = 0; h < 2; h++) {
            __m256i x[4], P[2];
            for (int g = 0; g < 4; g++) x[g] = _mm256_set1_epi32((int)load_u32(qd + 16 * h + 4 * g));
            for (int q = 0; q < 2; q++) {   /* r16_bits_q6k_256's half h, then r16_dot_256 */
                const uint8_t *c = u + p->nib + 64 * (6 * (size_t)j + 3 * (size_t)h) + 32 * (size_t)q;
                const __m256i C0 = _mm256_loadu_si256((const __m256i *)c), C1 = _mm256_loadu_si256((const __m256i *)(c + 64)),
                              C2 = _mm256_loadu_si256((const __m256i *)(c + 128));
                __m256i y = _mm256_srli_epi16(_mm256_and_si256(C2, m), 2);
                y = _mm256_srli_epi16(_mm256_or_si256(y, _mm256_and_si256(C1, m)), 2);
                const __m256i W3 = _mm256_srli_epi16(_mm256_or_si256(y, _mm256_and_si256(C0, m)), 2);
                const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_andnot_si256(m, C0), x[0]),
                                                     _mm256_maddubs_epi16(_mm256_andnot_si256(m, C1), x[1]));
                const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_andnot_si256(m, C2), x[2]),
                                                     _mm256_maddubs_epi16(W3, x[3]));
                P[q] = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(s01, ones), _mm256_madd_epi16(s23, ones)),
                                        _mm256_set1_epi32(nq[8 * h + k0]));
            }
            for (int q = 0; q < 2; q++) {
                const int8_t *qs = (const int8_t *)(u + p->qsc + 32 * j + 8 * q + 16 * h);
                const __m256 wd = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qs))), dr[q]);
                __m256 *acc = &a[q][2 * (j & 1) + h];
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P[q]), _mm256_mul_ps(wd, dt), *acc);
            }
        }
    }
}

/* Q6_K, one token (decode): all 16 rows of a packed group, both 8-row halves unit by unit (the group
 * streamed once, as r16_q4k16_256). Per lane the sequence of r16_half_256 and r16_store_256. */
A256 AINL void r16_q6k16_256(const r16_ptrs *p, int nb, const uint8_t *tile, int k0, float *out, int nr) {
    __m256 a[2][4];
    for (int q = 0; q < 2; q++)
        for (int i = 0; i < 4; i++) a[q][i] = _mm256_setzero_ps();
    for (int i = 0; i < nb / 8; i++) {
        const uint8_t *u = p->g + (size_t)i * p->ub, *t8 = tile + (size_t)(8 * i) * V16_TILE_BLOCK_BYTES;
        r16_q6k_unit2_256(p, u, t8, k0, a);
    }
    __m256 r[2];
    for (int q = 0; q < 2; q++) r[q] = _mm256_add_ps(_mm256_add_ps(a[q][0], a[q][2]), _mm256_add_ps(a[q][1], a[q][3]));
    r16_store16_256(r[0], r[1], out, nr);
}

/* Block b of a packed group, rows 8q.., into the sums of T tokens (from k0): unpacked, then
 * r16_acc_256. */
A256 AINL void r16_step_256(const int t, const r16_ptrs *p, size_t b, const int q, const uint8_t *tile, const int T,
                            int k0, __m256 (*acc)[2], __m256 *accM) {
    __m256i W[8];
    __m256 wd0, wd1, mn;
    r16_block_256(t, p, b, q, W, &wd0, &wd1, &mn);
    r16_acc_256(t, W, wd0, wd1, mn, tile + b * V16_TILE_BLOCK_BYTES, T, k0, acc, accM);
}

/* The other types, one token (decode): all 16 rows of a packed group, both 8-row halves block by
 * block, so the group streams once, as r16_q4k16_256 (half by half, the first pass used half of each
 * line it brought in and the second found it in cache). Per lane the sequence of r16_half_256 and
 * r16_store_256. */
A256 AINL void r16_gen16_256(const int t, const r16_ptrs *p, int nb, const uint8_t *tile, int k0, float *out, int nr) {
    __m256 aE[2][1][2], aO[2][1][2], mE[2][1], mO[2][1];   /* [rows 8q..][token][half] */
    for (int q = 0; q < 2; q++) aE[q][0][0] = aE[q][0][1] = aO[q][0][0] = aO[q][0][1] = mE[q][0] = mO[q][0] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b += 2)   /* in pairs: the sums of each parity known at compile time */
        for (int par = 0; par < 2 && b + par < nb; par++) {
            const size_t bb = (size_t)(b + par);
            r16_prefetch_block(p, bb);
            for (int q = 0; q < 2; q++)
                r16_step_256(t, p, bb, q, tile, 1, k0, par ? aO[q] : aE[q], par ? mO[q] : mE[q]);
        }
    for (int q = 0; q < 2 && 8 * q < nr; q++) r16_store_256(t, nb, 1, aE[q], aO[q], mE[q], mO[q], out + 8 * q, 0, nr - 8 * q);
}

/* IQ4_NL and IQ4_XS, one token (decode): the products of 16 rows' dword g of half h (v: packed nibbles,
 * both 8-row halves q) with the token (x: its dwords, a: their |q|), widened by vpmaddwd against m[q]
 * (IQ4_NL: ones; IQ4_XS: the block scales) and added to the int32 chains S[q][h]. The sign goes on the
 * weights' side: |q| is the same for all 16 rows, so a vector of products costs sign(w, q) and
 * vpmaddubsw(|q|, +-w), where the sign trick costs sign(w, w), sign(q, w) and the vpmaddubsw; and each
 * of the token's dwords (and its |q|) is broadcast once for both 8-row halves. Exact: |q| <= 127 and
 * the table's |w| <= 127, so the pair sums fit in int16 (Q8_0 keeps the sign trick: its w = -128 would
 * not survive sign(w, q)). */
A256 AINL void r16_iq4_dword16_256(const r16_ptrs *p, const uint8_t *u, size_t j, int g, const uint8_t *qd,
                                   const uint8_t *aq, const __m256i *m, const int first, __m256i (*S)[2]) {
    const __m256i m0f = _mm256_set1_epi8(0x0F), tab = iq4_table_256(0);
    const __m256i x0 = _mm256_set1_epi32((int)load_u32(qd + 4 * g)), x1 = _mm256_set1_epi32((int)load_u32(qd + 16 + 4 * g));
    const __m256i a0 = _mm256_set1_epi32((int)load_u32(aq + 4 * g)), a1 = _mm256_set1_epi32((int)load_u32(aq + 16 + 4 * g));
    for (int q = 0; q < 2; q++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(u + p->nib + 64 * (4 * j + (size_t)g) + 32 * q));
        const __m256i w0 = _mm256_shuffle_epi8(tab, _mm256_and_si256(v, m0f));
        const __m256i w1 = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f));
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(w0, x0)), m[q]);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(w1, x1)), m[q]);
        S[q][0] = first ? p0 : _mm256_add_epi32(S[q][0], p0);
        S[q][1] = first ? p1 : _mm256_add_epi32(S[q][1], p1);
        __asm__("" : "+x"(S[q][0]), "+x"(S[q][1]));   /* chains in registers, not trees of spilled products */
    }
}

/* A token's |q| of one block (qd: its 32 bytes) into aq, read back by r16_iq4_dword16_256 as broadcasts. */
A256 AINL void r16_iq4_abs_256(const uint8_t *qd, uint8_t *aq) {
    _mm256_store_si256((__m256i *)aq, _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)qd)));
    /* read |q| back from memory as broadcasts: GCC would otherwise extract its dwords from the register */
    __asm__ volatile("" ::: "memory");
}

/* IQ4_NL, one token (decode): all 16 rows of a packed group, r16_gen16_256's float sequence (one float
 * step a block: type_s8_block) with fewer integer steps (r16_iq4_dword16_256). On Zen 4 running AVX2,
 * 1.25x r16_gen16_256's speed. */
A256 AINL void r16_iq4nl16_256(const r16_ptrs *p, int nb, const uint8_t *tile, int k0, float *out, int nr) {
    const __m256i ones[2] = {_mm256_set1_epi16(1), _mm256_set1_epi16(1)};
    __m256 aE[2], aO[2];   /* [rows 8q..], by block parity */
    for (int q = 0; q < 2; q++) aE[q] = aO[q] = _mm256_setzero_ps();
    _Alignas(32) uint8_t aq[32];
    for (int b = 0; b < nb; b += 2)   /* in pairs: the sums of each parity known at compile time */
        for (int par = 0; par < 2 && b + par < nb; par++) {
            const size_t bb = (size_t)(b + par);
            const uint8_t *u = r16_unit(p, bb), *tb = tile + bb * V16_TILE_BLOCK_BYTES, *qd = tb + 32 * k0;
            r16_prefetch_block(p, bb);
            r16_iq4_abs_256(qd, aq);
            __m256i S[2][2];   /* [q][h] */
            for (int g = 0; g < 4; g++) r16_iq4_dword16_256(p, u, r16_j(p, bb), g, qd, aq, ones, g == 0, S);
            const __m256 d = _mm256_set1_ps(((const float *)(tb + 320))[k0]);
            for (int q = 0; q < 2; q++) {   /* the halves joined: the block's one float step */
                const __m256 s = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->d + 16 * q))), d);
                __m256 *a = par ? &aO[q] : &aE[q];
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(S[q][0], S[q][1])), s, *a);
            }
        }
    r16_store16_256(_mm256_add_ps(aE[0], aO[0]), _mm256_add_ps(aE[1], aO[1]), out, nr);
}

/* IQ4_XS, one token (decode): all 16 rows of a packed group, unit by unit: r16_iq4_dword16_256's
 * products widened against the block scales, so a unit's 8 blocks add up in int32 (the chains run
 * over the whole unit), then its float sequence (iq4_xs.c) once per super-block. */
A256 AINL void r16_iq4xs16_256(const r16_ptrs *p, int nb, const uint8_t *tile, int k0, float *out, int nr) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    _Alignas(32) uint8_t aq[32];
    for (int i = 0; i < nb / 8; i++) {
        const uint8_t *u = p->g + (size_t)i * p->ub;
        __m256i S[2][2] = {{_mm256_setzero_si256(), _mm256_setzero_si256()}, {_mm256_setzero_si256(), _mm256_setzero_si256()}};
        for (int j = 0; j < 8; j++) {
            const size_t bb = 8 * (size_t)i + j;
            const uint8_t *qd = tile + bb * V16_TILE_BLOCK_BYTES + 32 * k0;
            r16_prefetch_block(p, bb);
            r16_iq4_abs_256(qd, aq);
            __m256i sc[2];
            for (int q = 0; q < 2; q++)
                sc[q] = iq4xs_scale_pairs_256(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(u + p->qsc + 16 * j + 8 * q))));
            for (int g = 0; g < 4; g++) r16_iq4_dword16_256(p, u, (size_t)j, g, qd, aq, sc, 0, S);
        }
        const __m256 D = _mm256_set1_ps(v16_tile_d(tile, 8 * (size_t)i)[k0]);   /* the token's D_k */
        for (int q = 0; q < 2; q++) {
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->qd + 16 * q)));
            acc[q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(S[q][0], S[q][1])), _mm256_mul_ps(dv, D), acc[q]);
        }
    }
    r16_store16_256(acc[0], acc[1], out, nr);
}

/* Q5_K, one token (decode): all 16 rows of a packed group, r16_gen16_256's float sequence, with
 * each of the token's dwords broadcast once for both 8-row halves (as r16_q6k_unit2_256), the
 * fifth bits of a block loaded once per half, and the int16 sums kept as chains (16 % faster than
 * r16_gen16_256 on Zen 4 running AVX2). */
A256 AINL void r16_q5k16_256(const r16_ptrs *p, int nb, const uint8_t *tile, int k0, float *out, int nr) {
    const __m256i ones = _mm256_set1_epi16(1), m0f = _mm256_set1_epi8(0x0F), b5 = _mm256_set1_epi8(0x10);
    __m256 aE[2][2], aO[2][2], mE[2], mO[2];   /* [rows 8q..][half h], by block parity */
    for (int q = 0; q < 2; q++) aE[q][0] = aE[q][1] = aO[q][0] = aO[q][1] = mE[q] = mO[q] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b += 2)   /* in pairs: the sums of each parity known at compile time */
        for (int par = 0; par < 2 && b + par < nb; par++) {
            const size_t bb = (size_t)(b + par), j = r16_j(p, bb);
            const uint8_t *u = r16_unit(p, bb), *tb = tile + bb * V16_TILE_BLOCK_BYTES, *qd = tb + 32 * k0;
            r16_prefetch_block(p, bb);
            __m256i S[2][2], hb[2];   /* [q][h] */
            for (int q = 0; q < 2; q++) hb[q] = _mm256_loadu_si256((const __m256i *)(u + p->hb + 64 * j + 32 * q));
            for (int g = 0; g < 4; g++) {   /* r16_nib_256 and r16_hb5_256's vectors g (half 0) and 4 + g (half 1) */
                const __m256i x0 = _mm256_set1_epi32((int)load_u32(qd + 4 * g)), x1 = _mm256_set1_epi32((int)load_u32(qd + 16 + 4 * g));
                for (int q = 0; q < 2; q++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(u + p->nib + 64 * (4 * j + g) + 32 * q));
                    const __m256i w0 = _mm256_or_si256(_mm256_and_si256(v, m0f), _mm256_and_si256(_mm256_slli_epi32(hb[q], 4 - g), b5));
                    const __m256i w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m0f),
                                                       _mm256_and_si256(_mm256_srli_epi32(hb[q], g), b5));
                    const __m256i p0 = _mm256_maddubs_epi16(w0, x0), p1 = _mm256_maddubs_epi16(w1, x1);
                    S[q][0] = g ? _mm256_add_epi16(S[q][0], p0) : p0;   /* 4 x 2 x 31 x 127 fits in int16 */
                    S[q][1] = g ? _mm256_add_epi16(S[q][1], p1) : p1;
                    __asm__("" : "+x"(S[q][0]), "+x"(S[q][1]));   /* chains in registers, as in r16_iq4_16_256 */
                }
            }
            const __m256 dt = _mm256_set1_ps(((const float *)(tb + 320))[k0]), ds = _mm256_set1_ps(((const float *)(tb + 352))[k0]);
            for (int q = 0; q < 2; q++) {
                __m256 d, sc, mn;
                r16_k45_scales_256(p, u, j, q, &d, &sc, &mn);
                const __m256 s = _mm256_mul_ps(_mm256_mul_ps(sc, d), dt);
                for (int h = 0; h < 2; h++) {
                    __m256 *a = par ? &aO[q][h] : &aE[q][h];
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(S[q][h], ones)), s, *a);
                }
                __m256 *m = par ? &mO[q] : &mE[q];
                *m = _mm256_fmadd_ps(mn, ds, *m);
            }
        }
    __m256 r[2];
    for (int q = 0; q < 2; q++) {
        r[q] = _mm256_add_ps(_mm256_add_ps(aE[q][0], aO[q][0]), _mm256_add_ps(aE[q][1], aO[q][1]));
        r[q] = _mm256_add_ps(r[q], _mm256_add_ps(mE[q], mO[q]));   /* nb is a multiple of 8: no padded fma (r16_store_256) */
    }
    r16_store16_256(r[0], r[1], out, nr);
}

/* Decode (one token): all 16 rows of a packed group, streamed once (Q4_K, Q5_K, Q6_K and the IQ4
 * types with kernels of their own, the legacy types through r16_gen16_256). */
A256 AINL void r16_one16_256(const int t, const r16_ptrs *p, int nb, const uint8_t *tile, int k0, float *out, int nr) {
    if (t == RQ_Q4_K) r16_q4k16_256(p, nb, tile, k0, out, nr);
    else if (t == RQ_Q6_K) r16_q6k16_256(p, nb, tile, k0, out, nr);
    else if (t == RQ_IQ4_NL) r16_iq4nl16_256(p, nb, tile, k0, out, nr);
    else if (t == RQ_IQ4_XS) r16_iq4xs16_256(p, nb, tile, k0, out, nr);
    else if (t == RQ_Q5_K) r16_q5k16_256(p, nb, tile, k0, out, nr);
    else r16_gen16_256(t, p, nb, tile, k0, out, nr);
}

/* Rows 8q.. of a packed group against T <= 2 tokens, every block read once (decode). */
A256 AINL void r16_half_256(const int t, const r16_ptrs *p, int nb, const int T, const uint8_t *tile, int k0,
                            const int q, float *out, int ldo, int nr) {
    if (type_sb_int(t)) {
        r16_sb_256(t, p, nb, T, tile, k0, q, out, ldo, nr);
        return;
    }
    __m256 aE[2][2], aO[2][2], mE[2], mO[2];
    for (int k = 0; k < T; k++) aE[k][0] = aE[k][1] = aO[k][0] = aO[k][1] = mE[k] = mO[k] = _mm256_setzero_ps();
    /* blocks in pairs, so that each block's sums (even or odd) are known at compile time and stay in
     * registers (chosen by b & 1 at run time, they lived on the stack: a store and a reload per FMA) */
    for (int b = 0; b < nb; b += 2)
        for (int par = 0; par < 2 && b + par < nb; par++) {
            const size_t bb = (size_t)(b + par);
            if (q == 0) r16_prefetch_block(p, bb);
            r16_step_256(t, p, bb, q, tile, T, k0, par ? aO : aE, par ? mO : mE);
        }
    r16_store_256(t, nb, T, aE, aO, mE, mO, out, ldo, nr);
}

/* A packed group expanded into the v16 layout (prefill), with AVX2. */
A256 static void r16_expand_256(const int t, const uint8_t *g, int nb, uint8_t *grp) {
    const r16_ptrs p = r16_group_ptrs(t, g, nb);
    uint8_t *U = grp;
    float *WD = (float *)(grp + 512 * (size_t)nb), *M = WD + 32 * (size_t)nb;
    for (int b = 0; b < nb; b++) {
        /* the first read of these weights, from DRAM in a pass (Zen 3, 2 threads, 32768 x 2048 from DRAM:
         * Q4_K 1.26x at 8 tokens, 1.06x at 64; Q6_K 1.39x, 1.09x; from cache, 0.91-0.95x at 8 tokens) */
        r16_prefetch_block(&p, (size_t)b);
        for (int q = 0; q < 2; q++) {
            __m256i W[8];
            __m256 wd0, wd1, mn;
            r16_block_256(t, &p, (size_t)b, q, W, &wd0, &wd1, &mn);
            for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(U + 512 * (size_t)b + 64 * j + 32 * q), W[j]);
            _mm256_storeu_ps(WD + 32 * (size_t)b + 8 * q, wd0);
            _mm256_storeu_ps(WD + 32 * (size_t)b + 16 + 8 * q, wd1);
            _mm256_storeu_ps(M + 16 * (size_t)b + 8 * q, mn);
        }
    }
}

/* ---- AVX2 prefill, all 16 rows of an expanded (v16) group against a whole token tile ----
 * The vector runs over 8 rows (v16's U vectors, one 8-row half each), so a token's dword is
 * broadcast once for both halves, and a block's weights stay in registers (or L1) while the
 * tile's tokens pass two at a time. Per 256 multiply-adds this costs 4 broadcasts where the pf8
 * route's one row per vector costs 8 vpshufd; on Zen 5 running AVX2, a broadcast and a vpshufd
 * each take a vector-pipe slot, and those slots bound both routes. Faster than on pf8 rows (the
 * route this replaces; 1 thread, 256 tokens, 576-14336 columns): Q4_K 1.03-1.10x, Q6_K 1.08-1.13x,
 * Q4_0 and Q5_0 1.07-1.10x, Q4_1 1.01-1.04x; the signed types (Q8_0, IQ4_NL, IQ4_XS), against 4 tokens x 8
 * rows at a time, 1.1-1.4x (1536 x 1536, 16 and 128 tokens). Missing tokens of a tile are
 * zero; they are computed in the steps (pairs, or fours for the signed types) and not stored. */
/* Dword j of an expanded block's weights (U: both 8-row halves) against a pair of tokens (x: the
 * first one's 32 bytes, the second's follow), into the running int16 sums S[token][half] (first:
 * they start here). The empty asm keeps the sums as chains in registers: GCC otherwise turns them
 * into trees of all the products and spills those. */
A256 AINL void r16_pair_dword_256(const uint8_t *U, const uint8_t *x, const int j, const int first, __m256i (*S)[2]) {
    const __m256i W0 = _mm256_loadu_si256((const __m256i *)(U + 64 * j));
    const __m256i W1 = _mm256_loadu_si256((const __m256i *)(U + 64 * j + 32));
    const __m256i x0 = _mm256_set1_epi32((int)load_u32(x + 4 * j));
    const __m256i x1 = _mm256_set1_epi32((int)load_u32(x + 32 + 4 * j));
    const __m256i p[2][2] = {{_mm256_maddubs_epi16(W0, x0), _mm256_maddubs_epi16(W1, x0)},
                             {_mm256_maddubs_epi16(W0, x1), _mm256_maddubs_epi16(W1, x1)}};
    for (int kk = 0; kk < 2; kk++)
        for (int q = 0; q < 2; q++) S[kk][q] = first ? p[kk][q] : _mm256_add_epi16(S[kk][q], p[kk][q]);
    __asm__("" : "+x"(S[0][0]), "+x"(S[0][1]), "+x"(S[1][0]), "+x"(S[1][1]));
}

/* r16_pair_dword_256 for the signed types (type_s8: U holds signed values), four tokens at a time (so
 * a dword's weights are loaded and made absolute once for four): the sign trick's products, |U| times
 * the token's bytes with U's signs, whose pair sums reach 2 x 127 x 127 and so are widened to int32 at
 * once (vpmaddwd against m[half]: ones, or IQ4_XS's block scales) and summed there, into
 * S[token][half] (first: they start here). */
A256 AINL void r16_quad_dword_s8_256(const uint8_t *U, const uint8_t *x, const int j, const int first, const __m256i *m,
                                     __m256i (*S)[2]) {
    const __m256i W[2] = {_mm256_loadu_si256((const __m256i *)(U + 64 * j)),
                          _mm256_loadu_si256((const __m256i *)(U + 64 * j + 32))};
    const __m256i A[2] = {_mm256_sign_epi8(W[0], W[0]), _mm256_sign_epi8(W[1], W[1])};
    for (int kk = 0; kk < 4; kk++) {
        const __m256i xs = _mm256_set1_epi32((int)load_u32(x + 32 * kk + 4 * j));
        for (int q = 0; q < 2; q++) {
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(A[q], _mm256_sign_epi8(xs, W[q])), m[q]);
            S[kk][q] = first ? p : _mm256_add_epi32(S[kk][q], p);
        }
    }
    __asm__("" : "+x"(S[0][0]), "+x"(S[0][1]), "+x"(S[1][0]), "+x"(S[1][1]));
    __asm__("" : "+x"(S[2][0]), "+x"(S[2][1]), "+x"(S[3][0]), "+x"(S[3][1]));
}

/* Q4_K: pf8_q4k_256's float sequence (q4_K.c): a block's int16 sums whole, one vpmaddwd by the
 * block's integer scale, added up in int32 over the super-block, then acc = fma(float(I), d * D_k,
 * acc); the mins in their own pass, each lane's accM in block order as there. */
A256 AINL void r16_tile16_q4k_256(const uint8_t *grp, int nb, const int T, const uint8_t *tile, float *out, int ldo,
                                  int nr) {
    const float *WD = (const float *)(grp + 512 * (size_t)nb), *M = WD + 32 * (size_t)nb;
    __m256 acc[8][2], accM[8][2];   /* [token][8-row half]; indexed by a run-time token: in memory */
    __m256i I[8][2];
    const int T2 = (T + 1) & ~1;
    for (int k = 0; k < T2; k++) acc[k][0] = acc[k][1] = accM[k][0] = accM[k][1] = _mm256_setzero_ps();
    for (int i = 0; i < nb / 8; i++) {
        for (int k = 0; k < T2; k++) I[k][0] = I[k][1] = _mm256_setzero_si256();
        for (int b = 8 * i; b < 8 * i + 8; b++) {
            const uint8_t *tb = tile + (size_t)b * V16_TILE_BLOCK_BYTES, *U = grp + 512 * (size_t)b;
            __m256i sc[2];   /* the block's integer scale in both int16 halves of each row's dword */
            for (int q = 0; q < 2; q++) {
                const __m256i s = _mm256_cvttps_epi32(_mm256_loadu_ps(WD + 32 * (size_t)b + 8 * q));
                sc[q] = k4_scale_pairs_256(s);
            }
            for (int k = 0; k < T2; k += 2) {
                const uint8_t *x = tb + 32 * k;
                __asm__("" : "+r"(x));   /* one token pair at a time: GCC would otherwise unroll the pairs */
                __m256i S[2][2];         /* [token of the pair][half] */
                for (int j = 0; j < 8; j++) r16_pair_dword_256(U, x, j, j == 0, S);
                for (int kk = 0; kk < 2; kk++)
                    for (int q = 0; q < 2; q++)
                        I[k + kk][q] = _mm256_add_epi32(I[k + kk][q], _mm256_madd_epi16(S[kk][q], sc[q]));
            }
        }
        const float *D = v16_tile_d(tile, 8 * (size_t)i);   /* the tokens' D_k */
        for (int q = 0; q < 2; q++) {
            const __m256 dv = _mm256_loadu_ps(WD + 32 * (size_t)(8 * i) + 16 + 8 * q);
            for (int k = 0; k < T2; k++)
                acc[k][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[k][q]), _mm256_mul_ps(dv, _mm256_set1_ps(D[k])), acc[k][q]);
        }
    }
    for (int b = 0; b < nb; b++) {
        const float *ds = (const float *)(tile + (size_t)b * V16_TILE_BLOCK_BYTES + 352);
        for (int q = 0; q < 2; q++) {
            const __m256 mn = _mm256_loadu_ps(M + 16 * (size_t)b + 8 * q);
            for (int k = 0; k < T2; k++) accM[k][q] = _mm256_fmadd_ps(mn, _mm256_set1_ps(ds[k]), accM[k][q]);
        }
    }
    for (int k = 0; k < T; k++) {
        const __m256 lo = _mm256_add_ps(acc[k][0], accM[k][0]), hi = _mm256_add_ps(acc[k][1], accM[k][1]);
        r16_store16_256(lo, hi, out + (size_t)k * ldo, nr);
    }
}

/* IQ4_XS (its float sequence: iq4_xs.c): the signed types' four-token steps (r16_quad_dword_s8_256),
 * each pair sum widened against the block's scale, so the chains I run over a super-block's 8 blocks
 * and the float step comes once per super-block (tokens in fours: a super-block's weights, 4 KB
 * expanded, stay in L1 while the tile's fours pass). */
A256 AINL void r16_tile16_iq4xs_256(const uint8_t *grp, int nb, const int T, const uint8_t *tile, float *out, int ldo,
                                    int nr) {
    const float *WD = (const float *)(grp + 512 * (size_t)nb);
    __m256 acc[8][2];   /* [token][8-row half]; indexed by a run-time token: in memory */
    const int T4 = (T + 3) & ~3;
    for (int k = 0; k < T4; k++) acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int i = 0; i < nb / 8; i++) {
        const float *D = v16_tile_d(tile, 8 * (size_t)i);   /* the tokens' D_k */
        for (int k = 0; k < T4; k += 4) {
            __m256i I[4][2];   /* [token of the step][half] */
            /* zero-started: a run-time "first product" flag here made GCC version the loop and spill (1.08-1.23x) */
            for (int kk = 0; kk < 4; kk++) I[kk][0] = I[kk][1] = _mm256_setzero_si256();
            for (int b = 8 * i; b < 8 * i + 8; b++) {
                const uint8_t *x = tile + (size_t)b * V16_TILE_BLOCK_BYTES + 32 * k, *U = grp + 512 * (size_t)b;
                __asm__("" : "+r"(x));   /* one step of tokens at a time: GCC would otherwise unroll the steps */
                __m256i sc[2];
                for (int q = 0; q < 2; q++) sc[q] = iq4xs_scale_pairs_256(_mm256_cvttps_epi32(_mm256_loadu_ps(WD + 32 * (size_t)b + 8 * q)));
                for (int j = 0; j < 8; j++) r16_quad_dword_s8_256(U, x, j, 0, sc, I);
            }
            for (int q = 0; q < 2; q++) {
                const __m256 dv = _mm256_loadu_ps(WD + 32 * (size_t)(8 * i) + 16 + 8 * q);
                for (int kk = 0; kk < 4; kk++)
                    acc[k + kk][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[kk][q]), _mm256_mul_ps(dv, _mm256_set1_ps(D[k + kk])),
                                                     acc[k + kk][q]);
            }
        }
    }
    for (int k = 0; k < T; k++) r16_store16_256(acc[k][0], acc[k][1], out + (size_t)k * ldo, nr);
}

/* The halves kernels' results: per token the parities' and halves' sums, then the mins'. */
A256 AINL void r16_store_halves_256(const int T, const int s8, const int mins, int nb, __m256 (*acc)[2][2][2],
                                    __m256 (*accM)[2][2], float *out, int ldo, int nr) {
    for (int k = 0; k < T; k++) {
        __m256 r[2];
        for (int q = 0; q < 2; q++) {
            r[q] = s8 ? _mm256_add_ps(acc[k][0][0][q], acc[k][1][0][q])
                      : _mm256_add_ps(_mm256_add_ps(acc[k][0][0][q], acc[k][1][0][q]), _mm256_add_ps(acc[k][0][1][q], acc[k][1][1][q]));
            if (mins) {
                __m256 mo = accM[k][1][q];
                if (nb & 1) mo = _mm256_add_ps(mo, _mm256_setzero_ps());   /* the slot kernels' padded fma(0, 0, .) */
                r[q] = _mm256_add_ps(r[q], _mm256_add_ps(accM[k][0][q], mo));
            }
        }
        r16_store16_256(r[0], r[1], out + (size_t)k * ldo, nr);
    }
}

/* Q6_K, the legacy types of 4- and 5-bit values (Q4_0, Q4_1, Q5_0, Q5_1) and the signed types (Q8_0,
 * IQ4_NL): the legacy types' float sequence (per block parity and half: fma(float(P + NQ), WD * d_k,
 * acc); the mins by parity). A half's four vpmaddubsw sums add up whole in int16 for 4- and 5-bit
 * values (4 x 2 x 31 x 127 fits), in pairs for Q6_K (U <= 63), as r16_dot_256; the signed types' sums
 * are int32 from the start, four tokens a step (r16_quad_dword_s8_256), the block's 8 dwords in one
 * chain and one float step a block (type_s8_block: 1.13-1.26x the step per half; Zen 3, 1 thread,
 * 768 x 2048, 16-256 tokens). */
A256 AINL void r16_tile16_halves_256(const int t, const uint8_t *grp, int nb, const int T, const uint8_t *tile,
                                     float *out, int ldo, int nr) {
    const int q6 = t == RQ_Q6_K, s8 = type_s8_block(t), offs = type_offset(t) != 0 && !s8, mins = type_has_min(t);
    const __m256i ones = _mm256_set1_epi16(1), ones2[2] = {ones, ones};
    const float *WD = (const float *)(grp + 512 * (size_t)nb), *M = WD + 32 * (size_t)nb;
    __m256 acc[8][2][2][2], accM[8][2][2];   /* [token][block parity][half h][8-row half q], [token][parity][q] */
    const int TS = s8 ? 4 : 2, T2 = (T + TS - 1) / TS * TS;   /* tokens a step (the tile has 8, zero past T) */
    for (int k = 0; k < T2; k++)
        for (int par = 0; par < 2; par++)
            for (int q = 0; q < 2; q++) acc[k][par][0][q] = acc[k][par][1][q] = accM[k][par][q] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *tb = tile + (size_t)b * V16_TILE_BLOCK_BYTES, *U = grp + 512 * (size_t)b;
        const int32_t *nq = (const int32_t *)(tb + 256);
        const float *d = (const float *)(tb + 320), *ds = (const float *)(tb + 352);
        const int par = b & 1;
        for (int k = 0; k < T2; k += TS) {
            const uint8_t *x = tb + 32 * k;
            __asm__("" : "+r"(x));   /* one step of tokens at a time: GCC would otherwise unroll the steps */
            if (s8) {   /* the block's 8 dwords in one int32 chain per token, one float step */
                __m256i S[4][2];
                for (int j = 0; j < 8; j++) r16_quad_dword_s8_256(U, x, j, j == 0, ones2, S);
                for (int kk = 0; kk < 4; kk++) {
                    const __m256 dk = _mm256_set1_ps(d[k + kk]);
                    for (int q = 0; q < 2; q++) {
                        const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(WD + 32 * (size_t)b + 8 * q), dk);
                        acc[k + kk][par][0][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[kk][q]), s, acc[k + kk][par][0][q]);
                    }
                }
                continue;
            }
            for (int h = 0; h < 2; h++) {
                __m256i S[2][4][2];   /* [dword pair (Q6_K) or 0][token of the step][8-row half] */
                for (int g = 0; g < 4; g++) r16_pair_dword_256(U, x, 4 * h + g, q6 ? !(g & 1) : g == 0, S[q6 ? g / 2 : 0]);
                if (mins && h == 0)
                    for (int kk = 0; kk < TS; kk++)
                        for (int q = 0; q < 2; q++)
                            accM[k + kk][par][q] = _mm256_fmadd_ps(_mm256_loadu_ps(M + 16 * (size_t)b + 8 * q),
                                                                   _mm256_set1_ps(ds[k + kk]), accM[k + kk][par][q]);
                for (int kk = 0; kk < TS; kk++) {
                    const __m256 dk = _mm256_set1_ps(d[k + kk]);
                    for (int q = 0; q < 2; q++) {
                        __m256i P = _mm256_madd_epi16(S[0][kk][q], ones);
                        if (q6) P = _mm256_add_epi32(P, _mm256_madd_epi16(S[1][kk][q], ones));
                        if (offs) P = _mm256_add_epi32(P, _mm256_set1_epi32(nq[8 * h + k + kk]));
                        /* Q6_K has a scale per half, the legacy types one per block */
                        const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(WD + 32 * (size_t)b + (q6 ? 16 * h : 0) + 8 * q), dk);
                        acc[k + kk][par][h][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), s, acc[k + kk][par][h][q]);
                    }
                }
            }
        }
    }
    r16_store_halves_256(T, s8, mins, nb, acc, accM, out, ldo, nr);
}

/* ---- AVX2 prefill with AVX-VNNI (the VEX vpdpbusd on 256 bits) ----
 * The expanded group's kernels above with each dword's products summed by one vpdpbusd into int32
 * (unsigned weights x signed activations, four products a lane): the plain kernels need vpmaddubsw +
 * vpaddw and a vpmaddwd a block (Q4_K, Q6_K, Q5_K, the legacy types) or the sign trick's vpsignb +
 * vpmaddubsw + vpmaddwd + vpaddd (the signed types) for the same. The signed types' values go in as value + 128
 * (one vpxor per loaded vector, shared by a step's four tokens) and the tile's nq (-128 x the token's
 * sum over the block) starts each block's chain, as on the AVX-512 path. The block's integer sums
 * are the plain kernels' exactly and the float sequences are theirs (block scales through vpmulld
 * where those use vpmaddwd), so the results are equal bit for bit. Chosen on CPUs with AVX-VNNI and
 * no AVX-512 (rq_avxvnni). Deliberate twins of the plain kernels, as the AVX-512 ones are: a body
 * with vpdpbusd cannot be inlined into a function built for AVX2 alone, so they cannot share one. */

/* Block b's products against four tokens (tb: the tile's block, k: the step's first token): each
 * row's exact sum in S[token][8-row half], the signed types' (s8) from the tile's nq. */
AVNNI AINL void r16_quad_block_vnni_256(const uint8_t *U, const uint8_t *tb, const int k, const int s8, __m256i (*S)[2]) {
    const int32_t *nq = (const int32_t *)(tb + 256);
    for (int kk = 0; kk < 4; kk++)
        S[kk][0] = S[kk][1] = s8 ? _mm256_set1_epi32(nq[k + kk] + nq[8 + k + kk]) : _mm256_setzero_si256();
    const uint8_t *x = tb + 32 * k;
    for (int j = 0; j < 8; j++) {
        __m256i W[2] = {_mm256_loadu_si256((const __m256i *)(U + 64 * j)),
                        _mm256_loadu_si256((const __m256i *)(U + 64 * j + 32))};
        if (s8)
            for (int q = 0; q < 2; q++) W[q] = _mm256_xor_si256(W[q], _mm256_set1_epi8((char)0x80));
        for (int kk = 0; kk < 4; kk++) {
            const __m256i xs = _mm256_set1_epi32((int)load_u32(x + 32 * kk + 4 * j));
            for (int q = 0; q < 2; q++) S[kk][q] = _mm256_dpbusd_avx_epi32(S[kk][q], W[q], xs);
        }
    }
}

/* Q4_K and IQ4_XS (type_sb_int): r16_tile16_q4k_256's and r16_tile16_iq4xs_256's float sequences,
 * tokens in fours as the latter (a super-block's expanded weights stay in L1 while they pass). */
AVNNI AINL void r16_tile16_sb_vnni_256(const int t, const uint8_t *grp, int nb, const int T, const uint8_t *tile,
                                       float *out, int ldo, int nr) {
    const int q4k = t == RQ_Q4_K;
    const float *WD = (const float *)(grp + 512 * (size_t)nb), *M = WD + 32 * (size_t)nb;
    __m256 acc[8][2], accM[8][2];   /* [token][8-row half] */
    const int T4 = (T + 3) & ~3;
    for (int k = 0; k < T4; k++) acc[k][0] = acc[k][1] = accM[k][0] = accM[k][1] = _mm256_setzero_ps();
    for (int i = 0; i < nb / 8; i++) {
        const float *D = v16_tile_d(tile, 8 * (size_t)i);   /* the tokens' D_k */
        for (int k = 0; k < T4; k += 4) {
            __m256i I[4][2];
            for (int kk = 0; kk < 4; kk++) I[kk][0] = I[kk][1] = _mm256_setzero_si256();
            for (int b = 8 * i; b < 8 * i + 8; b++) {
                const uint8_t *tb = tile + (size_t)b * V16_TILE_BLOCK_BYTES, *U = grp + 512 * (size_t)b;
                __asm__("" : "+r"(tb));   /* one step of tokens at a time: GCC would otherwise unroll the steps */
                __m256i S[4][2];
                r16_quad_block_vnni_256(U, tb, k, !q4k, S);
                for (int q = 0; q < 2; q++) {
                    const __m256i sc = _mm256_cvttps_epi32(_mm256_loadu_ps(WD + 32 * (size_t)b + 8 * q));
                    for (int kk = 0; kk < 4; kk++) I[kk][q] = _mm256_add_epi32(I[kk][q], _mm256_mullo_epi32(S[kk][q], sc));
                }
            }
            for (int q = 0; q < 2; q++) {
                const __m256 dv = _mm256_loadu_ps(WD + 32 * (size_t)(8 * i) + 16 + 8 * q);
                for (int kk = 0; kk < 4; kk++)
                    acc[k + kk][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[kk][q]), _mm256_mul_ps(dv, _mm256_set1_ps(D[k + kk])),
                                                     acc[k + kk][q]);
            }
        }
    }
    if (q4k) {
        for (int b = 0; b < nb; b++) {
            const float *ds = (const float *)(tile + (size_t)b * V16_TILE_BLOCK_BYTES + 352);
            for (int q = 0; q < 2; q++) {
                const __m256 mn = _mm256_loadu_ps(M + 16 * (size_t)b + 8 * q);
                for (int k = 0; k < T4; k++) accM[k][q] = _mm256_fmadd_ps(mn, _mm256_set1_ps(ds[k]), accM[k][q]);
            }
        }
        for (int k = 0; k < T; k++)
            r16_store16_256(_mm256_add_ps(acc[k][0], accM[k][0]), _mm256_add_ps(acc[k][1], accM[k][1]), out + (size_t)k * ldo, nr);
        return;
    }
    for (int k = 0; k < T; k++) r16_store16_256(acc[k][0], acc[k][1], out + (size_t)k * ldo, nr);
}

/* The other R16 types (Q6_K, Q5_K, the legacy types, and the signed Q8_0 and IQ4_NL):
 * r16_tile16_halves_256's float sequence, its int32 sums P (+ NQ) by vpdpbusd from the tile's nq. */
AVNNI AINL void r16_tile16_halves_vnni_256(const int t, const uint8_t *grp, int nb, const int T, const uint8_t *tile,
                                           float *out, int ldo, int nr) {
    const int q6 = t == RQ_Q6_K, s8 = type_s8_block(t), offs = type_offset(t) != 0 && !s8, mins = type_has_min(t);
    const float *WD = (const float *)(grp + 512 * (size_t)nb), *M = WD + 32 * (size_t)nb;
    __m256 acc[8][2][2][2], accM[8][2][2];   /* [token][block parity][half h][8-row half q], [token][parity][q] */
    const int T4 = (T + 3) & ~3;
    for (int k = 0; k < T4; k++)
        for (int par = 0; par < 2; par++)
            for (int q = 0; q < 2; q++) acc[k][par][0][q] = acc[k][par][1][q] = accM[k][par][q] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *tb = tile + (size_t)b * V16_TILE_BLOCK_BYTES, *U = grp + 512 * (size_t)b;
        const int32_t *nq = (const int32_t *)(tb + 256);
        const float *d = (const float *)(tb + 320), *ds = (const float *)(tb + 352);
        const int par = b & 1;
        for (int k = 0; k < T4; k += 4) {
            __asm__("" : "+r"(tb));   /* one step of tokens at a time: GCC would otherwise unroll the steps */
            if (s8) {   /* both halves in one chain, one float step */
                __m256i S[4][2];
                r16_quad_block_vnni_256(U, tb, k, 1, S);
                for (int kk = 0; kk < 4; kk++) {
                    const __m256 dk = _mm256_set1_ps(d[k + kk]);
                    for (int q = 0; q < 2; q++) {
                        const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(WD + 32 * (size_t)b + 8 * q), dk);
                        acc[k + kk][par][0][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[kk][q]), s, acc[k + kk][par][0][q]);
                    }
                }
                continue;
            }
            const uint8_t *x = tb + 32 * k;
            for (int h = 0; h < 2; h++) {
                __m256i P[4][2];
                for (int kk = 0; kk < 4; kk++) P[kk][0] = P[kk][1] = offs ? _mm256_set1_epi32(nq[8 * h + k + kk]) : _mm256_setzero_si256();
                for (int g = 0; g < 4; g++) {
                    const int j = 4 * h + g;
                    const __m256i W0 = _mm256_loadu_si256((const __m256i *)(U + 64 * j));
                    const __m256i W1 = _mm256_loadu_si256((const __m256i *)(U + 64 * j + 32));
                    for (int kk = 0; kk < 4; kk++) {
                        const __m256i xs = _mm256_set1_epi32((int)load_u32(x + 32 * kk + 4 * j));
                        P[kk][0] = _mm256_dpbusd_avx_epi32(P[kk][0], W0, xs);
                        P[kk][1] = _mm256_dpbusd_avx_epi32(P[kk][1], W1, xs);
                    }
                }
                if (mins && h == 0)
                    for (int kk = 0; kk < 4; kk++)
                        for (int q = 0; q < 2; q++)
                            accM[k + kk][par][q] = _mm256_fmadd_ps(_mm256_loadu_ps(M + 16 * (size_t)b + 8 * q),
                                                                   _mm256_set1_ps(ds[k + kk]), accM[k + kk][par][q]);
                for (int kk = 0; kk < 4; kk++) {
                    const __m256 dk = _mm256_set1_ps(d[k + kk]);
                    for (int q = 0; q < 2; q++) {
                        const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(WD + 32 * (size_t)b + (q6 ? 16 * h : 0) + 8 * q), dk);
                        acc[k + kk][par][h][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P[kk][q]), s, acc[k + kk][par][h][q]);
                    }
                }
            }
        }
    }
    r16_store_halves_256(T, s8, mins, nb, acc, accM, out, ldo, nr);
}

/* An expanded group's 16 rows against a whole token tile (prefill): the type's own kernel. */
A256 AINL void r16_tile16_256(const int t, const uint8_t *grp, int nb, int T, const uint8_t *tile, float *out, int ldo,
                              int nr) {
    if (t == RQ_Q4_K) r16_tile16_q4k_256(grp, nb, T, tile, out, ldo, nr);
    else if (t == RQ_IQ4_XS) r16_tile16_iq4xs_256(grp, nb, T, tile, out, ldo, nr);
    else r16_tile16_halves_256(t, grp, nb, T, tile, out, ldo, nr);
}

#define R16_HALF_T(t, p, nb, tile, k0, q, out, ldo, nr, T) r16_half_256(t, p, nb, T, tile, k0, q, out, ldo, nr)
#define DISPATCH_T2(IMPL, ...)                                  \
    do {                                                        \
        if (T == 1) IMPL(__VA_ARGS__, 1);                       \
        else IMPL(__VA_ARGS__, 2);                              \
    } while (0)

/* AVX2: an expanded group through the type's whole-tile kernel; a packed one 2 tokens at a time (one
 * token: all 16 rows at once). */
#define R16_EXPANDED_HEAD_256                                                                                   \
    const uint8_t *tile = tk->mem + (size_t)i * nb * V16_TILE_BLOCK_BYTES;                                     \
    const int T = ntok - 8 * i < 8 ? ntok - 8 * i : 8;
#define R16_EXPANDED_TILE_256                                                                                   \
    r16_tile16_256(t, grp + vb * (size_t)(g - c0), nb, T, tile, out + (size_t)(8 * i) * ldo + r0, ldo, nr);
#define R16_PACKED_TILE_256                                                                                     \
    for (int k0 = 0; k0 < 8 && 8 * i + k0 < ntok; k0 += 2) {                                                   \
        const int left = ntok - 8 * i - k0, T = left < 2 ? left : 2;                                           \
        if (T == 1) {                                                                                          \
            r16_one16_256(t, &p, nb, tile, k0, out + (size_t)(8 * i + k0) * ldo + r0, nr);                     \
            continue;                                                                                          \
        }                                                                                                      \
        for (int q = 0; q < 2 && 8 * q < nr; q++)                                                              \
            DISPATCH_T2(R16_HALF_T, t, &p, nb, tile, k0, q, out + (size_t)(8 * i + k0) * ldo + r0 + 8 * q, ldo,  \
                        nr - 8 * q);                                                                           \
    }

/* r16_groups for AVX2: the same loops and routes, 8 rows per vector. */
A256 AINL void r16_groups_256(const int t, const uint8_t *R, int rows, int g0, int g1, int nb, int ntok,
                              const v16_toks *tk, float *out, int ldo, uint8_t *grp, int gmax) {
    R16_GROUPS_LOOPS(r16_expand_256, R16_EXPANDED_HEAD_256, R16_EXPANDED_TILE_256, R16_PACKED_TILE_256)
}

/* AVX2 with AVX-VNNI: the AVX2 routes, the expanded tiles through the VNNI kernels above (1 thread,
 * 1536 x 8960, 16-256 tokens, against the plain AVX2 kernels on an AVX-512 Xeon's AVX2 path: IQ4_XS,
 * IQ4_NL and Q8_0 1.7-2.0x, Q6_K 1.3-1.4x, Q4_0 and Q5_0 1.2-1.25x, Q4_K, Q5_K, Q4_1, Q5_1 1.1-1.2x). */
#define R16_EXPANDED_TILE_VNNI                                                                                  \
    if (type_sb_int(t)) r16_tile16_sb_vnni_256(t, grp + vb * (size_t)(g - c0), nb, T, tile, out + (size_t)(8 * i) * ldo + r0, ldo, nr); \
    else r16_tile16_halves_vnni_256(t, grp + vb * (size_t)(g - c0), nb, T, tile, out + (size_t)(8 * i) * ldo + r0, ldo, nr);
AVNNI AINL void r16_groups_vnni_256(const int t, const uint8_t *R, int rows, int g0, int g1, int nb, int ntok,
                                    const v16_toks *tk, float *out, int ldo, uint8_t *grp, int gmax) {
    R16_GROUPS_LOOPS(r16_expand_256, R16_EXPANDED_HEAD_256, R16_EXPANDED_TILE_VNNI, R16_PACKED_TILE_256)
}
#define R16_GROUPS_VNNI(suffix, t)                                                                              \
    AVNNI static void r16gv_##suffix(const uint8_t *R, int rows, int g0, int g1, int nb, int ntok,              \
                                     const v16_toks *tk, float *out, int ldo, uint8_t *grp, int gmax) {         \
        r16_groups_vnni_256(t, R, rows, g0, g1, nb, ntok, tk, out, ldo, grp, gmax);                             \
    }
R16_GROUPS_VNNI(q4_0, RQ_Q4_0)
R16_GROUPS_VNNI(q4_1, RQ_Q4_1)
R16_GROUPS_VNNI(q5_0, RQ_Q5_0)
R16_GROUPS_VNNI(q5_1, RQ_Q5_1)
R16_GROUPS_VNNI(q8_0, RQ_Q8_0)
R16_GROUPS_VNNI(q4_K, RQ_Q4_K)
R16_GROUPS_VNNI(q5_K, RQ_Q5_K)
R16_GROUPS_VNNI(q6_K, RQ_Q6_K)
R16_GROUPS_VNNI(iq4_nl, RQ_IQ4_NL)
R16_GROUPS_VNNI(iq4_xs, RQ_IQ4_XS)

/* Each R16 type's kernels of the OPS table (tables.c): r16g_* (AVX-512) and r16g256_* (AVX2). */
#define R16_GROUPS(suffix, t)                                                                                   \
    A512 static void r16g_##suffix(const uint8_t *R, int rows, int g0, int g1, int nb, int ntok, const v16_toks *tk, \
                                   float *out, int ldo, uint8_t *grp, int gmax) {                               \
        r16_groups(t, R, rows, g0, g1, nb, ntok, tk, out, ldo, grp, gmax);                                      \
    }                                                                                                           \
    A256 static void r16g256_##suffix(const uint8_t *R, int rows, int g0, int g1, int nb, int ntok,               \
                                      const v16_toks *tk, float *out, int ldo, uint8_t *grp, int gmax) {        \
        r16_groups_256(t, R, rows, g0, g1, nb, ntok, tk, out, ldo, grp, gmax);                                  \
    }
R16_GROUPS(q4_0, RQ_Q4_0)
R16_GROUPS(q4_1, RQ_Q4_1)
R16_GROUPS(q5_0, RQ_Q5_0)
R16_GROUPS(q5_1, RQ_Q5_1)
R16_GROUPS(q8_0, RQ_Q8_0)
R16_GROUPS(q4_K, RQ_Q4_K)
R16_GROUPS(q5_K, RQ_Q5_K)
R16_GROUPS(q6_K, RQ_Q6_K)
R16_GROUPS(iq4_nl, RQ_IQ4_NL)
R16_GROUPS(iq4_xs, RQ_IQ4_XS)

#endif /* x86 */
