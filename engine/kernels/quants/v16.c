/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). x86: the AVX-512 VNNI prefill kernels on the GGUF layout (v16_*),
 * generic over the types: token tiles, 16-row groups unpacked from each type's prefill form, the
 * passes, the V16_ROWS kernels of the OPS table. */

#ifdef RQ_HAVE_X86

/* ============================== AVX-512 ================================================== */
/* The AVX-512 path runs the AVX2 kernels except for prefill matmuls (v16_*, in this
 * file), which compute the same float sequence, so both paths give the same results. The
 * earlier AVX-512 kernels (2 blocks per vector, a float sequence of their own) lost to the AVX2
 * ones in prefill on every CPU measured, and in decode on Intel; removed. */

/* ============================== AVX-512 VNNI prefill: 16 interleaved rows ================= */
/*
 * The AVX2 prefill design (a row chunk unpacked once, exact integer half-block sums, one float
 * FMA per half per (row, token)) turned around for AVX-512 VNNI: the vector runs over 16 ROWS,
 * not over tokens. A group of 16 rows is unpacked and interleaved (per block b, half h and
 * 4-element group g, one dword per row), so one vpdpbusd multiplies 16 rows' 4 weights by one
 * token's 4 activations (a broadcast dword), with no shuffles and no int16 stage. The float
 * sequence of every (row, token) lane is pf8_pass's exactly:
 *     acc_(b&1),h = fma(float(P_b,h + NQ_b,h), WD_b,h * d_b, acc_(b&1),h)
 *     accM_(b&1)  = fma(M_b, d_b * S_b, accM_(b&1))
 *     result = ((acc_0,0 + acc_1,0) + (acc_0,1 + acc_1,1)) + (accM_0 + accM_1)
 * (the signed types, type_s8_block: acc_(b&1) = fma(float(P_b,0 + NQ_b,0 + P_b,1 + NQ_b,1), WD_b * d_b,
 * acc_(b&1)), result acc_0 + acc_1; Q4_K and IQ4_XS: their own, q4_K.c and iq4_xs.c),
 * so this path gives bit for bit the AVX2 path's results (which decode keeps using), in any
 * tile, thread count or mode.
 *
 * Group layout (16 rows, nb blocks; v16_group_bytes):
 *   U  [b][h][g][16] u32   row r's elements 32b + 16h + 4g .. +3, unsigned (offset not removed)
 *   WD [b][h][16]    f32   row r's scale of half h of block b
 *   M  [b][16]       f32   row r's min of block b (types with mins)
 * Per-token data (v16_toks): nq[k][2b + h] = -offset * sum16_k[2b + h], ds[k][b] = d_k(b) * S_k(b),
 * the same values as the AVX2 tiles' nq8 / ds8.
 */
#define V16_TMAX 8
/* Fewer tokens than this stay on the AVX2 kernels (decode-sized calls). */
#define V16_MIN_TOK 24

static inline int v16_type(int t) { return traits(t)->packed; }
static size_t v16_group_bytes(int nb) { return (size_t)nb * (512 + 128 + 64); }

/* Token tiles of a v16 matmul: up to 8 tokens each, per block b (missing tokens zero):
 *   qs [b][8][32] int8    the tokens' activations of block b
 *   nq [b][2][8]  int32   -offset * sum16_k[2b + h]
 *   d  [b][8]     f32     d_k(b)
 *   ds [b][8]     f32     d_k(b) * S_k(b)
 * so a kernel reaches token k of block b at a constant displacement from one pointer. */
#define V16_TILE_BLOCK_BYTES (8 * 32 + 16 * 4 + 8 * 4 + 8 * 4)
/* The tile's token scales d of block b (of super-block b / 8 with span-256 activations: D_k). */
static inline const float *v16_tile_d(const uint8_t *tile, size_t b) {
    return (const float *)(tile + b * V16_TILE_BLOCK_BYTES + 320);
}
typedef struct {
    int nb, ntiles;
    uint8_t *mem;   /* ntiles x nb x V16_TILE_BLOCK_BYTES */
} v16_toks;

static void v16_prep_tile(int t, const rq_act *acts, int ntok, int i, v16_toks *tk) {
    const int nb = tk->nb, off = type_offset(t), k0 = 8 * i;
    const int T = ntok - k0 < 8 ? ntok - k0 : 8;
    uint8_t *m = tk->mem + (size_t)i * nb * V16_TILE_BLOCK_BYTES;
    /* missing tokens are zero for the kernels that run tokens in pairs; a one-token call runs only the
     * one-token kernels, which read token 0 alone (the zeroing was 0.5-0.9 % of a decode) */
    if (T < 8 && ntok > 1) memset(m, 0, (size_t)nb * V16_TILE_BLOCK_BYTES);
    for (int k = 0; k < T; k++) {
        const rq_act *a = &acts[k0 + k];
        for (int b = 0; b < nb; b++) {
            uint8_t *mb = m + (size_t)b * V16_TILE_BLOCK_BYTES;
            int32_t *nq = (int32_t *)(mb + 256);
            float *d = (float *)(mb + 320), *ds = (float *)(mb + 352);
            int s0 = a->sum16[2 * b], s1 = a->sum16[2 * b + 1];
            memcpy(mb + 32 * k, a->qs + 32 * (size_t)b, 32);
            nq[k] = -off * s0;
            nq[8 + k] = -off * s1;
            d[k] = a->d[b];
            ds[k] = a->d[b] * (float)(s0 + s1);
        }
    }
}

/* Rows [r0, r0 + nr) (nr <= 16) -> one interleaved group at grp; tmp holds 16 unpacked rows. */
A512 static void v16_unpack(const int t, const uint8_t *W, size_t rb, int r0, int nr, int nb, uint8_t *tmp,
                             uint8_t *grp) {
    const size_t us = pf8_urow_bytes(nb);
    for (int r = 0; r < 16; r++) {
        uint8_t *ur = tmp + (size_t)r * us;
        if (r >= nr) { memset(ur, 0, us); continue; }
        const uint8_t *row = W + (size_t)(r0 + r) * rb;
        if (t == RQ_Q4_K) pf8_unpack_q4k(row, nb, ur);
        else if (t == RQ_Q5_K) pf8_unpack_q5k(row, nb, ur);
        else if (t == RQ_Q6_K) pf8_unpack_q6k(row, nb, ur);
        else if (t == RQ_Q8_0) v16_unpack_q8_0(row, nb, ur);
        else if (t == RQ_IQ4_NL) v16_unpack_iq4nl(row, nb, ur);
        else if (t == RQ_IQ4_XS) v16_unpack_iq4xs(row, nb, ur);
        else pf8_unpack_legacy(t, row, nb, ur);
    }
    const __m512i idx = _mm512_mullo_epi32(_mm512_set1_epi32((int)us),
                                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __m512i *U = (__m512i *)grp;
    float *WD = (float *)(grp + 512 * (size_t)nb), *M = WD + 32 * (size_t)nb;
    const float *sWD = (const float *)(tmp + 32 * (size_t)nb), *sM = sWD + 2 * (size_t)nb;
    const int mins = type_has_min(t);
    for (int b = 0; b < nb; b++) {
        for (int j = 0; j < 8; j++)
            _mm512_storeu_si512(U + 8 * (size_t)b + j, _mm512_i32gather_epi32(idx, tmp + 32 * (size_t)b + 4 * j, 1));
        __m512 w0 = _mm512_i32gather_ps(idx, sWD + 2 * (size_t)b, 1);
        if (t == RQ_Q4_K)   /* pf8_store_q4k's int16 pair -> the scale as a float (r16_block_q4k's form) */
            w0 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_castps_si512(w0), _mm512_set1_epi32(0xFFFF)));
        _mm512_storeu_ps(WD + 32 * (size_t)b, w0);
        _mm512_storeu_ps(WD + 32 * (size_t)b + 16, _mm512_i32gather_ps(idx, sWD + 2 * (size_t)b + 1, 1));
        if (mins) _mm512_storeu_ps(M + 16 * (size_t)b, _mm512_i32gather_ps(idx, sM + b, 1));
    }
}

/* The sum P_b of a block's 32 products of unsigned weights with one token (qd: its 32 bytes): exact for
 * Q4_K; IQ4_XS's values + 128 still need the offset correction. */
A512 AINL __m512i v16_dot_block(const __m512i *W, const uint8_t *qd) {
    __m512i P0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), W[0], _mm512_set1_epi32((int)load_u32(qd)));
    __m512i P1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), W[4], _mm512_set1_epi32((int)load_u32(qd + 16)));
    P0 = _mm512_dpbusd_epi32(P0, W[1], _mm512_set1_epi32((int)load_u32(qd + 4)));
    P1 = _mm512_dpbusd_epi32(P1, W[5], _mm512_set1_epi32((int)load_u32(qd + 20)));
    P0 = _mm512_dpbusd_epi32(P0, W[2], _mm512_set1_epi32((int)load_u32(qd + 8)));
    P1 = _mm512_dpbusd_epi32(P1, W[6], _mm512_set1_epi32((int)load_u32(qd + 24)));
    P0 = _mm512_dpbusd_epi32(P0, W[3], _mm512_set1_epi32((int)load_u32(qd + 12)));
    P1 = _mm512_dpbusd_epi32(P1, W[7], _mm512_set1_epi32((int)load_u32(qd + 28)));
    return _mm512_add_epi32(P0, P1);
}

/* Q4_K and IQ4_XS (type_sb_int; their float sequences: q4_K.c, iq4_xs.c): a group against a tile of T
 * tokens, blocks in one pass and Q4_K's mins in a second (both in block order: each chain is the sequence's). The block is taken
 * half by half (4 weight vectors live) with one vpdpbusd chain per token, so the block and super-
 * block sums of the tile's 8 tokens and the weights fit the 32 registers: the weights are read
 * once per tile (all 8 weight vectors live spilled them: 209 against 286 GMAC/s). */
A512 AINL void v16_tile_sb(const int t, const uint8_t *grp, int nb, const int T, const uint8_t *tile, float *out, int ldo, int nr) {
    const __m512i *U = (const __m512i *)grp;
    const float *WD = (const float *)(grp + 512 * (size_t)nb), *M = WD + 32 * (size_t)nb;
    const int mins = type_has_min(t);
    __m512 acc[V16_TMAX];
    for (int k = 0; k < T; k++) acc[k] = _mm512_setzero_ps();
    for (int i = 0; i < nb / 8; i++) {
        __m512i I[V16_TMAX];
        for (int k = 0; k < T; k++) I[k] = _mm512_setzero_si512();
        for (int b = 8 * i; b < 8 * i + 8; b++) {
            const uint8_t *tb = tile + (size_t)b * V16_TILE_BLOCK_BYTES;
            const int32_t *nq = (const int32_t *)(tb + 256);
            __m512i P[V16_TMAX];   /* IQ4_XS's values + 128: starting from the offset correction */
            for (int k = 0; k < T; k++) P[k] = mins ? _mm512_setzero_si512() : _mm512_set1_epi32(nq[k] + nq[8 + k]);
            for (int h = 0; h < 2; h++) {
                __m512i W[4];
                for (int j = 0; j < 4; j++) W[j] = _mm512_loadu_si512(U + 8 * (size_t)b + 4 * h + j);
                for (int k = 0; k < T; k++) {
                    const uint8_t *qd = tb + 32 * k + 16 * h;
                    for (int j = 0; j < 4; j++) P[k] = _mm512_dpbusd_epi32(P[k], W[j], _mm512_set1_epi32((int)load_u32(qd + 4 * j)));
                }
            }
            const __m512i sc = _mm512_cvttps_epi32(_mm512_loadu_ps(WD + 32 * (size_t)b));
            for (int k = 0; k < T; k++) I[k] = _mm512_add_epi32(I[k], _mm512_mullo_epi32(P[k], sc));
        }
        const __m512 dv = _mm512_loadu_ps(WD + 32 * (size_t)(8 * i) + 16);
        const float *D = v16_tile_d(tile, 8 * (size_t)i);   /* the tokens' D_k */
        for (int k = 0; k < T; k++) acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[k]), _mm512_mul_ps(dv, _mm512_set1_ps(D[k])), acc[k]);
    }
    __m512 accM[V16_TMAX];
    for (int k = 0; k < T; k++) accM[k] = _mm512_setzero_ps();
    for (int b = 0; b < nb && mins; b++) {
        const float *ds = (const float *)(tile + (size_t)b * V16_TILE_BLOCK_BYTES + 352);
        const __m512 mv = _mm512_loadu_ps(M + 16 * (size_t)b);
        for (int k = 0; k < T; k++) accM[k] = _mm512_fmadd_ps(mv, _mm512_set1_ps(ds[k]), accM[k]);
    }
    const __mmask16 keep = nr >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nr) - 1);
    for (int k = 0; k < T; k++) _mm512_mask_storeu_ps(out + (size_t)k * ldo, keep, _mm512_add_ps(acc[k], accM[k]));
}

/* Blocks par, par + 2, ... of a group against the T tokens of a tile: acc[k][h] per half (the signed
 * types, type_s8_block: per block, in acc[k][0]). */
A512 AINL void v16_pass(const int t, const uint8_t *grp, int nb, const int T, const uint8_t *tile, const int par,
                         __m512 (*acc)[2]) {
    const int offs = type_offset(t) != 0, q6 = (t == RQ_Q6_K), s8b = type_s8_block(t);
    const __m512i *U = (const __m512i *)grp;
    const float *WD = (const float *)(grp + 512 * (size_t)nb);
    for (int b = par; b < nb; b += 2) {
        const uint8_t *tb = tile + (size_t)b * V16_TILE_BLOCK_BYTES;
        const int32_t *nq = (const int32_t *)(tb + 256);
        const float *d = (const float *)(tb + 320);
        const __m512 wd0 = _mm512_loadu_ps(WD + 32 * (size_t)b);
        const __m512 wd1 = q6 ? _mm512_loadu_ps(WD + 32 * (size_t)b + 16) : wd0;
        __m512 sc[V16_TMAX];
        if (!q6)
            for (int k = 0; k < T; k++) sc[k] = _mm512_mul_ps(wd0, _mm512_set1_ps(d[k]));
        if (s8b) {   /* both halves' sums joined in int32, one float step */
            __m512i W[8];   /* in registers for the tile's tokens (acc's stores could alias U for the compiler) */
            for (int j = 0; j < 8; j++) W[j] = _mm512_loadu_si512(U + 8 * (size_t)b + j);
            for (int k = 0; k < T; k++) {
                __m512i P = _mm512_set1_epi32(nq[k] + nq[8 + k]);
                for (int j = 0; j < 8; j++) P = _mm512_dpbusd_epi32(P, W[j], _mm512_set1_epi32((int)load_u32(tb + 32 * k + 4 * j)));
                acc[k][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), sc[k], acc[k][0]);
            }
            continue;
        }
        for (int h = 0; h < 2; h++) {
            const __m512i W0 = _mm512_loadu_si512(U + 8 * (size_t)b + 4 * h);
            const __m512i W1 = _mm512_loadu_si512(U + 8 * (size_t)b + 4 * h + 1);
            const __m512i W2 = _mm512_loadu_si512(U + 8 * (size_t)b + 4 * h + 2);
            const __m512i W3 = _mm512_loadu_si512(U + 8 * (size_t)b + 4 * h + 3);
            for (int k = 0; k < T; k++) {
                const uint8_t *qd = tb + 32 * k + 16 * h;
                __m512i P = offs ? _mm512_set1_epi32(nq[8 * h + k]) : _mm512_setzero_si512();
                P = _mm512_dpbusd_epi32(P, W0, _mm512_set1_epi32((int)load_u32(qd)));
                P = _mm512_dpbusd_epi32(P, W1, _mm512_set1_epi32((int)load_u32(qd + 4)));
                P = _mm512_dpbusd_epi32(P, W2, _mm512_set1_epi32((int)load_u32(qd + 8)));
                P = _mm512_dpbusd_epi32(P, W3, _mm512_set1_epi32((int)load_u32(qd + 12)));
                const __m512 s = q6 ? _mm512_mul_ps(h ? wd1 : wd0, _mm512_set1_ps(d[k])) : sc[k];
                acc[k][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), s, acc[k][h]);
            }
        }
    }
}

/* The mins of blocks par, par + 2, ... against the T tokens of a tile. */
A512 AINL void v16_pass_mins(const uint8_t *grp, int nb, const int T, const uint8_t *tile, const int par,
                              __m512 *acc) {
    const float *M = (const float *)(grp + 512 * (size_t)nb) + 32 * (size_t)nb;
    for (int b = par; b < nb; b += 2) {
        const float *ds = (const float *)(tile + (size_t)b * V16_TILE_BLOCK_BYTES + 352);
        const __m512 mv = _mm512_loadu_ps(M + 16 * (size_t)b);
        for (int k = 0; k < T; k++) acc[k] = _mm512_fmadd_ps(mv, _mm512_set1_ps(ds[k]), acc[k]);
    }
}

/* A group against a tile of T tokens: out[k * ldo + r] for the group's nr rows. Each pass keeps
 * T accumulators live (all 32 zmm registers would not hold a tile's 3 x 8 at once). */
A512 AINL void v16_tile(const int t, const uint8_t *grp, int nb, const int T, const uint8_t *tile, float *out,
                         int ldo, int nr) {
    if (type_sb_int(t)) {
        v16_tile_sb(t, grp, nb, T, tile, out, ldo, nr);
        return;
    }
    __m512 a[4][V16_TMAX], m[2][V16_TMAX];
    for (int p = 0; p < 2; p++) {   /* parity p: a[p] half 0, a[p + 2] half 1 */
        __m512 acc[V16_TMAX][2];
        for (int k = 0; k < T; k++) acc[k][0] = acc[k][1] = _mm512_setzero_ps();
        v16_pass(t, grp, nb, T, tile, p, acc);
        for (int k = 0; k < T; k++) { a[p][k] = acc[k][0]; a[p + 2][k] = acc[k][1]; }
    }
    if (type_has_min(t))
        for (int p = 0; p < 2; p++) {
            __m512 acc[V16_TMAX];
            for (int k = 0; k < T; k++) acc[k] = _mm512_setzero_ps();
            v16_pass_mins(grp, nb, T, tile, p, acc);
            for (int k = 0; k < T; k++) m[p][k] = acc[k];
        }
    const __mmask16 keep = nr >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nr) - 1);
    for (int k = 0; k < T; k++) {
        __m512 r = type_s8_block(t) ? _mm512_add_ps(a[0][k], a[1][k])
                                    : _mm512_add_ps(_mm512_add_ps(a[0][k], a[1][k]), _mm512_add_ps(a[2][k], a[3][k]));
        if (type_has_min(t)) {
            __m512 mo = m[1][k];
            if (nb & 1) mo = _mm512_add_ps(mo, _mm512_setzero_ps());   /* the slot kernels' padded fma(0, 0, .) */
            r = _mm512_add_ps(r, _mm512_add_ps(m[0][k], mo));
        }
        _mm512_mask_storeu_ps(out + (size_t)k * ldo, keep, r);
    }
}

#define V16_TILE_T(t, grp, nb, tile, out, ldo, nr, T) v16_tile(t, grp, nb, T, tile, out, ldo, nr)

/* Groups of this many bytes or less are unpacked several at a time (they and a token tile stay
 * in L2 while the tile passes over each of them). */
#define V16_L2_BYTES (512 * 1024)

/* Rows [r0, r1) against every token tile: groups of 16 rows unpacked (G at a time) into grp
 * (tmp: scratch for 16 unpacked rows), then each tile runs against the G groups. */
A512 AINL void v16_rows(const int t, const uint8_t *W, size_t rb, int r0, int r1, int nb, int ntok,
                         const v16_toks *tk, float *out, int ldo, uint8_t *tmp, uint8_t *grp, int gmax) {
    const size_t gb = (v16_group_bytes(nb) + 63) & ~(size_t)63;
    for (int c0 = r0; c0 < r1; c0 += 16 * gmax) {
        const int c1 = c0 + 16 * gmax < r1 ? c0 + 16 * gmax : r1;
        int ng = 0;
        for (int g0 = c0; g0 < c1; g0 += 16, ng++) v16_unpack(t, W, rb, g0, c1 - g0 < 16 ? c1 - g0 : 16, nb, tmp, grp + gb * ng);
        for (int i = 0; i < tk->ntiles; i++) {
            const int k0 = 8 * i, T = ntok - k0 < 8 ? ntok - k0 : 8;
            const uint8_t *tile = tk->mem + (size_t)i * nb * V16_TILE_BLOCK_BYTES;
            for (int g = 0; g < ng; g++) {
                const int g0 = c0 + 16 * g, nr = c1 - g0 < 16 ? c1 - g0 : 16;
                DISPATCH_T8(V16_TILE_T, t, grp + gb * g, nb, tile, out + (size_t)k0 * ldo + g0, ldo, nr);
            }
        }
    }
}

#define V16_ROWS(suffix, t)                                                                                       \
    A512 static void v16r_##suffix(const uint8_t *W, size_t rb, int r0, int r1, int nb, int ntok,                \
                                    const v16_toks *tk, float *out, int ldo, uint8_t *tmp, uint8_t *grp, int gmax) { \
        v16_rows(t, W, rb, r0, r1, nb, ntok, tk, out, ldo, tmp, grp, gmax);                                       \
    }
V16_ROWS(q4_0, RQ_Q4_0)
V16_ROWS(q4_1, RQ_Q4_1)
V16_ROWS(q5_0, RQ_Q5_0)
V16_ROWS(q5_1, RQ_Q5_1)
V16_ROWS(q8_0, RQ_Q8_0)
V16_ROWS(q4_K, RQ_Q4_K)
V16_ROWS(q5_K, RQ_Q5_K)
V16_ROWS(q6_K, RQ_Q6_K)
V16_ROWS(iq4_nl, RQ_IQ4_NL)
V16_ROWS(iq4_xs, RQ_IQ4_XS)

typedef void (*v16_rows_fn)(const uint8_t *W, size_t rb, int r0, int r1, int nb, int ntok, const v16_toks *tk,
                            float *out, int ldo, uint8_t *tmp, uint8_t *grp, int gmax);

#endif /* x86 */
