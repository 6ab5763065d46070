/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). Token tiles: the activations of a matmul's tokens laid out for the SIMD
 * kernels (tile, prep_tile), and the kernel function types that take them. */

/* ------------------------------------------------------------------------------------------ */
/* SIMD kernels                                                                                */
/*
 * One row of weights against a tile of T tokens. The row's blocks are decoded once per tile
 * into unsigned bytes U in element order (0..255, offsets NOT removed) and per-lane float
 * weight scales WD (one 32-bit lane = 4 consecutive elements, all under one scale), then every
 * token of the tile does, per 32 (AVX2) or 64 (AVX-512) elements:
 *     p    = sum_4 U*q  (+ NQ)             vpdpbusd, or vpmaddubsw + vpmaddwd
 *     acc += float(p) * WD * TD
 * Per-token arrays, prepared once per matmul (prep_tok):
 *     TD = d_b, expanded to 8 lanes per activation block
 *     NQ = -offset * (sum of the 4 q of the lane), 8 int32 per block: removes the weight offset
 *          (Q4_0 8, Q5_0 16, Q8_0 and IQ4_* 128, Q6_K 32, Q3_K 4) exactly, in the integer domain
 *     DS = d_b * sum16, 2 per block: for types with mins (Q4_1, Q5_1, Q4_K, Q5_K, Q2_K), whose
 *          min terms  sum_g min_g * d_b * S_g  are one FMA per 4 (legacy) or 8 (K) blocks.
 */

#define TMAX 8

/* Token data for one tile of T tokens, interleaved so that a kernel reaches every token of the
 * tile at a constant displacement from one pointer per array. A "unit" is the blocks one
 * vector instruction covers: 2 activation blocks (AVX-512) or 1 (AVX2).
 *   qs: [unit][T][32*ub]   int8
 *   td: [unit][T][8*ub]    d_b expanded to the 8 lanes of each block
 *   nq: [unit][T][8*ub]    -offset * sum of the 4 q of each lane (offset types only)
 *   ds: [8 blocks][T][16]  d_b * sum16 (types with mins only)
 * Missing blocks (tails) are zero. */
typedef struct {
    int T;
    const int8_t *qs;
    const float *td;
    const int32_t *nq;
    const float *ds;
    const float *f[TMAX];
    /* Packed-slot data of the AVX2 legacy kernels (see legacy_slots_256), T <= 4, per block b:
     *   td4[8b..]: d_k(b) for k = 0..3, twice;  nq4[8b..]: -offset * sum16_k[2b] (k = 0..3), then
     *   -offset * sum16_k[2b+1];  ds4[4b + k] = d_k(b) * (sum16_k[2b] + sum16_k[2b+1]) (mins),
     *   with one zero block of padding. Missing tokens are zero. */
    const float *td4;
    const int32_t *nq4;
    const float *ds4;
    /* Prefill data of the AVX2 8-token kernels (see pf8_row_256), tiles of T >= 3 only, per block b:
     *   qs8[256b + 32j + 4k + i] = q_k[32b + 4j + i]  (dword j of the block for the 8 tokens k)
     *   td8[8b + k] = d_k(b);  nq8[16b + 8h + k] = -offset * sum16_k[2b+h];
     *   ds8[8b + k] = d_k(b) * (sum16_k[2b] + sum16_k[2b+1]).  Missing tokens are zero. */
    const int8_t *qs8;
    const float *td8;
    const int32_t *nq8;
    const float *ds8;
} tile;

typedef void (*kern_fn)(const uint8_t *row, int n, const tile *tl, float *res);
typedef void (*rows_fn)(const uint8_t *W, size_t rb, int r0, int r1, int n, const tile *tv, float *out, int ldo, int k0);
typedef void (*pf8_unpack_fn)(const uint8_t *W, size_t rb, int r0, int r1, int nb, uint8_t *buf);
typedef void (*pf8_rows_fn)(const uint8_t *buf, int r0, int r1, int nb, const tile *tv, float *out, int ldo, int k0);

/* AVX2 kernels (ub == 1) that pack (row, token) slots into vector lanes. */
static inline int slot_packed(int t, int ub) { return ub == 1 && traits(t)->packed; }

/* Types with the AVX2 8-token prefill kernels (tiles of T >= 3 tokens, see pf8_row_256). */
static inline int pf8_type(int t, int ub) { return ub == 1 && traits(t)->pf8; }
#define PF8_MIN_T 3
static size_t pf8_tile_bytes(int nb) { return (size_t)nb * (256 + 32 + 64 + 32); }

/* Bytes of one tile's arrays (64-byte multiples). */
static size_t tile_bytes_base(int t, int ub, int T, int nb) {
    if (is_float_type(t)) return 0;
    size_t nu = (size_t)((nb + ub - 1) / ub), nc = (size_t)((nb + 7) / 8);
    size_t qs = nu * T * 32 * ub, v = nu * T * 8 * ub * 4;
    size_t sz = qs + v;
    if (type_offset(t)) sz += v;
    if (type_has_min(t)) sz += nc * T * 16 * 4;
    if (slot_packed(t, ub)) sz += (size_t)(nb + 2) * (8 * 4 + 8 * 4 + 4 * 4) + 64;
    return (sz + 63) & ~(size_t)63;
}
static size_t tile_bytes(int t, int ub, int T, int nb) {
    size_t sz = tile_bytes_base(t, ub, T, nb);
    if (pf8_type(t, ub) && T >= PF8_MIN_T) sz += pf8_tile_bytes(nb);
    return (sz + 63) & ~(size_t)63;
}

/* The 8-token layout of a tile (see tile.qs8) at mem. */
static void prep_tile_pf8(int t, const rq_act *acts, int T, int nb, uint8_t *mem, tile *tl) {
    int8_t *qs8 = (int8_t *)mem;
    float *td8 = (float *)(mem + (size_t)nb * 256);
    int32_t *nq8 = (int32_t *)(td8 + (size_t)nb * 8);
    float *ds8 = (float *)(nq8 + (size_t)nb * 16);
    const int off = type_offset(t);
    for (int k = 0; k < T; k++) {
        const rq_act *a = &acts[k];
        for (int b = 0; b < nb; b++) {
            const int8_t *q = a->qs + 32 * b;
            for (int j = 0; j < 8; j++) memcpy(qs8 + 256 * (size_t)b + 32 * j + 4 * k, q + 4 * j, 4);
            int s0 = a->sum16[2 * b], s1 = a->sum16[2 * b + 1];
            td8[8 * (size_t)b + k] = a->d[b];
            nq8[16 * (size_t)b + k] = -off * s0;
            nq8[16 * (size_t)b + 8 + k] = -off * s1;
            ds8[8 * (size_t)b + k] = a->d[b] * (float)(s0 + s1);
        }
    }
    tl->qs8 = qs8;
    tl->td8 = td8;
    tl->nq8 = nq8;
    tl->ds8 = ds8;
}

static void prep_tile(int t, int ub, const rq_act *acts, int T, int nb, uint8_t *mem, tile *tl) {
    memset(tl, 0, sizeof(*tl));
    tl->T = T;
    for (int k = 0; k < T; k++) tl->f[k] = acts[k].f;
    if (is_float_type(t)) return;   /* float weights use acts[k].f only */
    if (pf8_type(t, ub) && T >= PF8_MIN_T) {   /* only the prefill kernels read this tile */
        uint8_t *pm = mem + tile_bytes_base(t, ub, T, nb);
        if (T < 8) memset(pm, 0, pf8_tile_bytes(nb));
        prep_tile_pf8(t, acts, T, nb, pm, tl);
        return;
    }
    size_t nu = (size_t)((nb + ub - 1) / ub), nc = (size_t)((nb + 7) / 8);
    memset(mem, 0, tile_bytes(t, ub, T, nb));
    int8_t *qs = (int8_t *)mem;
    float *td = (float *)(mem + nu * T * 32 * ub);
    int32_t *nq = NULL;
    float *ds = NULL;
    uint8_t *p = (uint8_t *)(td + nu * T * 8 * ub);
    int off = type_offset(t);
    if (off) { nq = (int32_t *)p; p += nu * T * 8 * ub * 4; }
    if (type_has_min(t)) ds = (float *)p;
    for (int k = 0; k < T; k++) {
        const rq_act *a = &acts[k];
        for (int b = 0; b < nb; b++) {
            size_t o = ((size_t)(b / ub) * T + k) * ub + (b % ub);   /* block slot */
            memcpy(qs + 32 * o, a->qs + 32 * b, 32);
            float d = a->d[b];
            for (int i = 0; i < 8; i++) td[8 * o + i] = d;
            if (nq) {
                const int8_t *q = a->qs + 32 * b;
                for (int i = 0; i < 8; i++)
                    nq[8 * o + i] = -off * (q[4 * i] + q[4 * i + 1] + q[4 * i + 2] + q[4 * i + 3]);
            }
            if (ds) {
                size_t c = ((size_t)(b / 8) * T + k) * 16 + 2 * (b % 8);
                ds[c] = d * (float)a->sum16[2 * b];
                ds[c + 1] = d * (float)a->sum16[2 * b + 1];
            }
        }
    }
    if (slot_packed(t, ub)) {
        p = (uint8_t *)td + nu * T * 8 * ub * 4;
        if (off) p += nu * T * 8 * ub * 4;
        if (type_has_min(t)) p += nc * T * 16 * 4;
        float *td4 = (float *)p;
        int32_t *nq4 = (int32_t *)(td4 + 8 * (size_t)(nb + 2));
        float *ds4 = (float *)(nq4 + 8 * (size_t)(nb + 2));
        for (int k = 0; k < T && k < 4; k++) {
            const rq_act *a = &acts[k];
            for (int b = 0; b < nb; b++) {
                int s0 = a->sum16[2 * b], s1 = a->sum16[2 * b + 1];
                td4[8 * b + k] = td4[8 * b + 4 + k] = a->d[b];
                nq4[8 * b + k] = -off * s0;
                nq4[8 * b + 4 + k] = -off * s1;
                ds4[4 * b + k] = a->d[b] * (float)(s0 + s1);
            }
        }
        tl->td4 = td4;
        tl->nq4 = nq4;
        tl->ds4 = ds4;
    }
    (void)nc;
    tl->qs = qs;
    tl->td = td;
    tl->nq = nq;
    tl->ds = ds;
}
