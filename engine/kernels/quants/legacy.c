/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). The legacy 32-element types Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0: one file,
 * because their SIMD kernels are shared (one slot kernel, one prefill unpacker, one R16 block
 * loader, branching on the type where Q5's fifth bit or Q8_0's signed bytes differ). Block
 * structs, dequantization, scalar reference dot products, R16 units and repacking, AVX2 slot
 * kernels, prefill unpacking and R16 block loading. IQ4_NL (iq4_nl.c) runs these kernels too: a
 * Q4_0 block whose nibbles are looked up (iq4_block_256, iq4_lookup8_*) into signed values. */

typedef struct { uint16_t d; uint8_t qs[16]; } blk_q4_0;
typedef struct { uint16_t d, m; uint8_t qs[16]; } blk_q4_1;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_0;
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_1;
typedef struct { uint16_t d; int8_t qs[32]; } blk_q8_0;

_Static_assert(sizeof(blk_q4_0) == 18, "q4_0");
_Static_assert(sizeof(blk_q4_1) == 20, "q4_1");
_Static_assert(sizeof(blk_q5_0) == 22, "q5_0");
_Static_assert(sizeof(blk_q5_1) == 24, "q5_1");
_Static_assert(sizeof(blk_q8_0) == 34, "q8_0");

static inline int legacy_bs(int t) { return traits(t)->block_bytes; }
static inline int legacy_qoff(int t) { return traits(t)->qs_at; }   /* offset of qs in the block */

/* ------------------------------------------------------------------------------------------ */
/* Dequantization (ground truth)                                                               */

static void dequant_q4_0(const void *row, float *y, int n) {
    const blk_q4_0 *b = row;
    for (int i = 0; i < n / QK; i++, y += QK) {
        float d = F16(b[i].d);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)((b[i].qs[j] & 0xF) - 8) * d;
            y[j + 16] = (float)((b[i].qs[j] >> 4) - 8) * d;
        }
    }
}
static void dequant_q4_1(const void *row, float *y, int n) {
    const blk_q4_1 *b = row;
    for (int i = 0; i < n / QK; i++, y += QK) {
        float d = F16(b[i].d), m = F16(b[i].m);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)(b[i].qs[j] & 0xF) * d + m;
            y[j + 16] = (float)(b[i].qs[j] >> 4) * d + m;
        }
    }
}
static void dequant_q5_0(const void *row, float *y, int n) {
    const blk_q5_0 *b = row;
    for (int i = 0; i < n / QK; i++, y += QK) {
        float d = F16(b[i].d);
        uint32_t qh = load_u32(b[i].qh);
        for (int j = 0; j < 16; j++) {
            int h0 = (qh >> j) & 1, h1 = (qh >> (j + 16)) & 1;
            y[j] = (float)(((b[i].qs[j] & 0xF) | (h0 << 4)) - 16) * d;
            y[j + 16] = (float)(((b[i].qs[j] >> 4) | (h1 << 4)) - 16) * d;
        }
    }
}
static void dequant_q5_1(const void *row, float *y, int n) {
    const blk_q5_1 *b = row;
    for (int i = 0; i < n / QK; i++, y += QK) {
        float d = F16(b[i].d), m = F16(b[i].m);
        uint32_t qh = load_u32(b[i].qh);
        for (int j = 0; j < 16; j++) {
            int h0 = (qh >> j) & 1, h1 = (qh >> (j + 16)) & 1;
            y[j] = (float)((b[i].qs[j] & 0xF) | (h0 << 4)) * d + m;
            y[j + 16] = (float)((b[i].qs[j] >> 4) | (h1 << 4)) * d + m;
        }
    }
}
static void dequant_q8_0(const void *row, float *y, int n) {
    const blk_q8_0 *b = row;
    for (int i = 0; i < n / QK; i++, y += QK) {
        float d = F16(b[i].d);
        for (int j = 0; j < 32; j++) y[j] = (float)b[i].qs[j] * d;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Scalar reference dot products                                                               */

static inline int dot16_s(const int8_t *w, const int8_t *q) {
    int s = 0;
    for (int j = 0; j < 16; j++) s += (int)w[j] * (int)q[j];
    return s;
}

/* Legacy types: unpack block to unsigned 0..31 values in element order, then integer dot. */
static float dot_q4_0_ref(int n, const void *row, const rq_act *x) {
    const blk_q4_0 *b = row;
    float s = 0.0f;
    uint8_t u[32];
    for (int i = 0; i < n / QK; i++) {
        for (int j = 0; j < 16; j++) { u[j] = b[i].qs[j] & 0xF; u[j + 16] = b[i].qs[j] >> 4; }
        int S = x->sum16[2 * i] + x->sum16[2 * i + 1];
        int isum = dot32_u(u, x->qs + 32 * i) - 8 * S;
        s += F16(b[i].d) * x->d[i] * (float)isum;
    }
    return s;
}
static float dot_q4_1_ref(int n, const void *row, const rq_act *x) {
    const blk_q4_1 *b = row;
    float s = 0.0f;
    uint8_t u[32];
    for (int i = 0; i < n / QK; i++) {
        for (int j = 0; j < 16; j++) { u[j] = b[i].qs[j] & 0xF; u[j + 16] = b[i].qs[j] >> 4; }
        int S = x->sum16[2 * i] + x->sum16[2 * i + 1];
        int isum = dot32_u(u, x->qs + 32 * i);
        s += x->d[i] * (F16(b[i].d) * (float)isum + F16(b[i].m) * (float)S);
    }
    return s;
}
static inline void unpack_q5(const uint8_t *qs, const uint8_t *qhb, uint8_t *u) {
    uint32_t qh = load_u32(qhb);
    for (int j = 0; j < 16; j++) {
        u[j] = (uint8_t)((qs[j] & 0xF) | (((qh >> j) & 1) << 4));
        u[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
}
static float dot_q5_0_ref(int n, const void *row, const rq_act *x) {
    const blk_q5_0 *b = row;
    float s = 0.0f;
    uint8_t u[32];
    for (int i = 0; i < n / QK; i++) {
        unpack_q5(b[i].qs, b[i].qh, u);
        int S = x->sum16[2 * i] + x->sum16[2 * i + 1];
        int isum = dot32_u(u, x->qs + 32 * i) - 16 * S;
        s += F16(b[i].d) * x->d[i] * (float)isum;
    }
    return s;
}
static float dot_q5_1_ref(int n, const void *row, const rq_act *x) {
    const blk_q5_1 *b = row;
    float s = 0.0f;
    uint8_t u[32];
    for (int i = 0; i < n / QK; i++) {
        unpack_q5(b[i].qs, b[i].qh, u);
        int S = x->sum16[2 * i] + x->sum16[2 * i + 1];
        int isum = dot32_u(u, x->qs + 32 * i);
        s += x->d[i] * (F16(b[i].d) * (float)isum + F16(b[i].m) * (float)S);
    }
    return s;
}
static float dot_q8_0_ref(int n, const void *row, const rq_act *x) {
    const blk_q8_0 *b = row;
    float s = 0.0f;
    for (int i = 0; i < n / QK; i++) {
        int isum = dot16_s(b[i].qs, x->qs + 32 * i) + dot16_s(b[i].qs + 16, x->qs + 32 * i + 16);
        s += F16(b[i].d) * x->d[i] * (float)isum;
    }
    return s;
}

/* ------------------------------------------------------------------------------------------ */
/* R16 (see r16_layout.c): a unit is one block                                                 */

/*   Q4_0, Q4_1, Q5_0, Q5_1: NIB [4 g][16] u32 | HB [16] u32 (Q5) | D [16] f16 | M [16] f16 (Q4_1, Q5_1)
 *   Q8_0:                   Q8 [2 h][4 g][16] u32 (the int8 values + 128, as in v16) | D [16] f16
 *   IQ4_NL:                 Q4_0's (the same block bytes; the table lookup comes after loading) */
static inline void r16_layout_legacy(int t, r16_ptrs *p) {
    switch (t) {
    case RQ_Q4_0:
    case RQ_IQ4_NL: p->nib = 0; p->d = 256; p->ub = 288; break;
    case RQ_Q4_1: p->nib = 0; p->d = 256; p->m = 288; p->ub = 320; break;
    case RQ_Q5_0: p->nib = 0; p->hb = 256; p->d = 320; p->ub = 352; break;
    case RQ_Q5_1: p->nib = 0; p->hb = 256; p->d = 320; p->m = 352; p->ub = 384; break;
    case RQ_Q8_0: p->q8 = 0; p->d = 512; p->ub = 544; break;
    default: break;
    }
}

/* Row r (0..15) of a group: its blocks' bits and scales into the group's units (Q4_0 .. Q5_1, IQ4_NL). */
static void r16_repack_row_legacy(int t, const uint8_t *row, int nb, const r16_ptrs *p, int r) {
    const int bs = legacy_bs(t), qoff = legacy_qoff(t);
    for (int b = 0; b < nb; b++) {
        const uint8_t *A = row + (size_t)b * bs, *u = r16_unit(p, b);
        for (int g = 0; g < 4; g++) r16_w32(u + p->nib + 64 * g, r, load_u32(A + qoff + 4 * g));
        r16_w16(u + p->d, r, load_u16(A));
        if (p->m) r16_w16(u + p->m, r, load_u16(A + 2));
        if (p->hb) {
            uint32_t qh = load_u32(A + (t == RQ_Q5_0 ? 2 : 4)), v = 0;
            for (int h = 0; h < 2; h++)
                for (int g = 0; g < 4; g++)
                    for (int i = 0; i < 4; i++) v |= ((qh >> (16 * h + 4 * g + i)) & 1u) << (8 * i + 4 * h + g);
            r16_w32(u + p->hb, r, v);
        }
    }
}

/* The same for Q8_0. */
static void r16_repack_row_q8_0(const uint8_t *row, int nb, const r16_ptrs *p, int r) {
    for (int b = 0; b < nb; b++) {
        const uint8_t *A = row + (size_t)b * sizeof(blk_q8_0), *u = r16_unit(p, b);
        for (int j = 0; j < 8; j++) r16_w32(u + p->q8 + 64 * j, r, load_u32(A + 2 + 4 * j) ^ 0x80808080u);
        r16_w16(u + p->d, r, load_u16(A));
    }
}

#ifdef RQ_HAVE_X86

/* 32 bits -> 32 bytes, 0xFF where the bit is set (byte i <-> bit i) */
A256 AINL __m256i bits_to_bytes_256(uint32_t x) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                           0x0101010101010101LL, 0x0000000000000000LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

/* --- Legacy types, packed slots ------------------------------------------------------------
 * A "slot" is one (row, token) pair. Four slots share a vector: lane s holds slot s's sum over
 * elements 0-15 of each block, lane s + 4 over elements 16-31. Slots are 4 tokens of one row
 * (TS = 4: prefill), 2 rows x 2 tokens (TS = 2) or 4 rows of one token (TS = 1: decode). For
 * every slot and every mode the lane computes the same thing, so a (row, token) result does not
 * depend on its neighbours:
 *     per block b:       acc_(b&1) = fma(float(P_b), dw(b) * da(b), acc_(b&1))   P_b exact int
 *                        (offset removed); two accumulators by block parity hide the FMA latency
 *     per blocks b, b+1: accM = fma(m(b + h), da(b + h) * S(b + h), accM)       (types with mins)
 *     result = (A[s] + A[s+4]) + (accM[s] + accM[s+4]),  A = acc_0 + acc_1
 * The signed types (type_s8_block: Q8_0, IQ4_NL) join the halves in int32 first: per block b,
 *     acc_(b&1) = fma(float(P_b,0 + P_b,1), dw(b) * da(b), acc_(b&1)),  result = A[s]
 * (one float step a block instead of one a half: their whole-tile prefill kernel 1.13-1.26x).
 * The int sums of the 4 slots are packed with 3 vphaddd instead of converting and scaling each
 * slot separately (4x fewer cvt / mul / fma than one slot per vector). */

/* Lane index vectors that spread per-token (idxK) or per-row (idxR) values over the slots. */
A256 AINL __m256i slot_tok_idx(const int TS) {   /* lane (s, h) <- token s % TS, half h */
    return TS == 4 ? _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
         : TS == 2 ? _mm256_setr_epi32(0, 1, 0, 1, 4, 5, 4, 5)
                   : _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
}

/* f16 (d, m) of block b of the RS rows -> [d_r0 m_r0 d_r1 m_r1 ...] as floats (m is junk for
 * types without mins: the first 2 bytes after d, always inside the block). */
A256 AINL __m256 slot_dm(const int t, const int TS, const uint8_t *const *rows, size_t b) {
    const int bs = legacy_bs(t);
    const int RS = 4 / TS;
    __m128i v;
    if (RS == 1) v = _mm_cvtsi32_si128((int)load_u32(rows[0] + b * bs));
    else if (RS == 2) v = _mm_setr_epi32((int)load_u32(rows[0] + b * bs), (int)load_u32(rows[1] + b * bs), 0, 0);
    else v = _mm_setr_epi32((int)load_u32(rows[0] + b * bs), (int)load_u32(rows[1] + b * bs),
                            (int)load_u32(rows[2] + b * bs), (int)load_u32(rows[3] + b * bs));
    return _mm256_cvtph_ps(v);
}

/* lanes (s, h) <- d of row s / TS from a slot_dm vector */
A256 AINL __m256 slot_wd(const int TS, __m256 dm) {
    const __m256i idx = TS == 4 ? _mm256_setzero_si256()
                      : TS == 2 ? _mm256_setr_epi32(0, 0, 2, 2, 0, 0, 2, 2)
                                : _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    return _mm256_permutevar8x32_ps(dm, idx);
}

/* lanes (s, h) <- m of row s / TS in block b + h, from the slot_dm vectors of blocks b and b+1 */
A256 AINL __m256 slot_m(const int TS, __m256 dm0, __m256 dm1) {
    const __m256i idx = TS == 4 ? _mm256_set1_epi32(1)
                      : TS == 2 ? _mm256_setr_epi32(1, 1, 3, 3, 1, 1, 3, 3)
                                : _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
    return _mm256_blend_ps(_mm256_permutevar8x32_ps(dm0, idx), _mm256_permutevar8x32_ps(dm1, idx), 0xF0);
}

/* One block b of the RS rows against the slots' tokens (q[k]: their block b): packed exact int sums. */
A256 AINL __m256i slot_block(const int t, const int TS, const uint8_t *const *rows, size_t b,
                             const int8_t *const *q) {
    const int bs = legacy_bs(t);
    const int RS = 4 / TS;
    const __m256i ones = _mm256_set1_epi16(1), m0f = _mm256_set1_epi8(0x0F);
    __m256i p[4];
    for (int r = 0; r < RS; r++) {
        const uint8_t *A = rows[r] + b * bs;
        if (type_s8(t)) {   /* Q8_0, IQ4_NL: signed values through the sign trick */
            const __m256i w = t == RQ_Q8_0 ? _mm256_loadu_si256((const __m256i *)(A + 2)) : iq4_block_256(A + 2, 0);
            const __m256i aw = _mm256_sign_epi8(w, w);
            for (int k = 0; k < TS; k++) {
                __m256i qv = _mm256_loadu_si256((const __m256i *)q[k]);
                p[r * TS + k] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(qv, w)), ones);
            }
            continue;
        }
        __m128i x = _mm_loadu_si128((const __m128i *)(A + legacy_qoff(t)));
        __m256i U = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), m0f);
        if (t == RQ_Q5_0 || t == RQ_Q5_1) {
            __m256i hb = bits_to_bytes_256(load_u32(A + ((t == RQ_Q5_0) ? 2 : 4)));
            U = _mm256_or_si256(U, _mm256_and_si256(hb, _mm256_set1_epi8(16)));
        }
        for (int k = 0; k < TS; k++) {
            __m256i qv = _mm256_loadu_si256((const __m256i *)q[k]);
            p[r * TS + k] = _mm256_madd_epi16(_mm256_maddubs_epi16(U, qv), ones);
        }
    }
    return _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
}

/* Slots of RS = 4 / TS rows x TS tokens (tokens tok[0..TS) of the tile) over nb blocks;
 * res[s] for slot s = row s / TS, token s % TS. pf != 0: prefetch the rows pf bytes further on
 * (the next rows; decode streams the weights from DRAM). */
A256 AINL void legacy_slots_256(const int t, const int TS, const uint8_t *const *rows, int nb, const tile *tv,
                                const int *tok, float *res, size_t pf) {
    const int offs = (t == RQ_Q4_0 || t == RQ_Q5_0);
    const int mins = type_has_min(t), s8b = type_s8_block(t);
    const __m256i idxK = slot_tok_idx(TS);
    const size_t qstride = 32 * (size_t)tv->T;   /* tv->qs is [b][T][32] */
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, accM = _mm256_setzero_ps();
    /* blocks in pairs (b, b+1): the mins of a pair fill one vector; b+1 may be missing */
    const int bs = legacy_bs(t);
    for (int b = 0; b < nb; b += 2) {
        const int have1 = b + 1 < nb;
        /* several rows stream at once here: help the hardware prefetcher (decode reads from DRAM) */
        if (pf) {
            /* Q8_0 decode is bound by how fast one core streams its rows from DRAM (it computes at
             * ~24 GB/s a core): ask for the whole next group into L2 up front as well, which
             * measured ~25 % faster on Zen 3 (the other types are compute-bound; no gain there). */
            if (t == RQ_Q8_0 && b == 0)
                for (size_t o = 0; o < pf; o += 64) _mm_prefetch((const char *)rows[0] + pf + o, _MM_HINT_T1);
            for (int r = 0; r < 4 / TS; r++) _mm_prefetch((const char *)rows[r] + pf + (size_t)b * bs, _MM_HINT_T0);
        }
        __m256 dm0 = slot_dm(t, TS, rows, (size_t)b);
        __m256 dm1 = have1 ? slot_dm(t, TS, rows, (size_t)b + 1) : _mm256_setzero_ps();
        for (int h = 0; h < 1 + have1; h++) {
            const int bb = b + h;
            const int8_t *qb[4];
            for (int k = 0; k < TS; k++) qb[k] = tv->qs + qstride * bb + 32 * tok[k];
            __m256i P = slot_block(t, TS, rows, (size_t)bb, qb);
            if (s8b) P = join_halves_256(P);   /* the block's sum in both halves; the low one is kept */
            if (offs) {
                __m256i nq = _mm256_loadu_si256((const __m256i *)(tv->nq4 + 8 * bb));
                if (TS != 4) nq = _mm256_permutevar8x32_epi32(nq, idxK);
                P = _mm256_add_epi32(P, nq);
            }
            __m256 td = _mm256_loadu_ps(tv->td4 + 8 * bb);
            if (TS != 4) td = _mm256_permutevar8x32_ps(td, idxK);
            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_mul_ps(slot_wd(TS, h ? dm1 : dm0), td), acc[h]);
        }
        if (mins) {
            __m256 ds = _mm256_loadu_ps(tv->ds4 + 4 * b);   /* blocks b, b+1 (zero padding past nb) */
            if (TS != 4) ds = _mm256_permutevar8x32_ps(ds, idxK);
            accM = _mm256_fmadd_ps(slot_m(TS, dm0, dm1), ds, accM);
        }
    }
    const __m256 as = _mm256_add_ps(acc[0], acc[1]);
    __m128 a = s8b ? _mm256_castps256_ps128(as) : _mm_add_ps(_mm256_castps256_ps128(as), _mm256_extractf128_ps(as, 1));
    if (mins) a = _mm_add_ps(a, _mm_add_ps(_mm256_castps256_ps128(accM), _mm256_extractf128_ps(accM, 1)));
    _mm_storeu_ps(res, a);
}

/* Rows [r0, r1) of W (row bytes rb) against the tile's T tokens: out[(k0 + k) * ldo + r]. */
A256 AINL void legacy_rows_256(const int t, const uint8_t *W, size_t rb, int r0, int r1, int n, const tile *tv,
                               float *out, int ldo, int k0) {
    const int nb = n / QK, T = tv->T;
    float res[4];
    if (T >= 3) {
        const int tok[4] = {0, 1, 2, T > 3 ? 3 : 0};
        for (int r = r0; r < r1; r++) {
            const uint8_t *rows[1] = {W + (size_t)r * rb};
            legacy_slots_256(t, 4, rows, nb, tv, tok, res, 0);
            for (int k = 0; k < T; k++) out[(size_t)(k0 + k) * ldo + r] = res[k];
        }
    } else if (T == 2) {
        const int tok[2] = {0, 1};
        for (int r = r0; r < r1; r += 2) {
            const int rr = r + 1 < r1 ? r + 1 : r;
            const uint8_t *rows[2] = {W + (size_t)r * rb, W + (size_t)rr * rb};
            legacy_slots_256(t, 2, rows, nb, tv, tok, res, 2 * rb);
            for (int i = 0; i < 2 && r + i < r1; i++)
                for (int k = 0; k < 2; k++) out[(size_t)(k0 + k) * ldo + r + i] = res[2 * i + k];
        }
    } else {
        const int tok[1] = {0};
        for (int r = r0; r < r1; r += 4) {
            const uint8_t *rows[4];
            for (int i = 0; i < 4; i++) rows[i] = W + (size_t)(r + i < r1 ? r + i : r) * rb;
            legacy_slots_256(t, 1, rows, nb, tv, tok, res, 4 * rb);
            for (int i = 0; i < 4 && r + i < r1; i++) out[(size_t)k0 * ldo + r + i] = res[i];
        }
    }
}

#define ROWS256(name, t)                                                                                   \
    A256 static void name(const uint8_t *W, size_t rb, int r0, int r1, int n, const tile *tv, float *out,   \
                          int ldo, int k0) {                                                               \
        legacy_rows_256(t, W, rb, r0, r1, n, tv, out, ldo, k0);                                            \
    }
ROWS256(r256_q4_0, RQ_Q4_0)
ROWS256(r256_q4_1, RQ_Q4_1)
ROWS256(r256_q5_0, RQ_Q5_0)
ROWS256(r256_q5_1, RQ_Q5_1)
ROWS256(r256_q8_0, RQ_Q8_0)
ROWS256(r256_iq4_nl, RQ_IQ4_NL)

/* --- Prefill (see pf8.c) ---------------------------------------------------------------------- */

A256 AINL void pf8_unpack_legacy(const int t, const uint8_t *row, int nb, uint8_t *ur) {
    const int bs = legacy_bs(t);
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const uint8_t *A = row + (size_t)b * bs;
        __m128i x = _mm_loadu_si128((const __m128i *)(A + legacy_qoff(t)));
        __m256i U = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), m0f);
        if (t == RQ_Q5_0 || t == RQ_Q5_1) {
            __m256i hb = bits_to_bytes_256(load_u32(A + ((t == RQ_Q5_0) ? 2 : 4)));
            U = _mm256_or_si256(U, _mm256_and_si256(hb, _mm256_set1_epi8(16)));
        }
        _mm256_storeu_si256((__m256i *)(ur + 32 * (size_t)b), U);
        float d = _cvtsh_ss(load_u16(A));
        pf8_store_scales(ur, nb, b, d, d, type_has_min(t) ? _cvtsh_ss(load_u16(A + 2)) : 0.0f);
    }
}

/* Q8_0 rows in the AVX2 prefill kernels' unpacked form (their unpackers cover 4/5-bit types). */
A256 AINL void v16_unpack_q8_0(const uint8_t *row, int nb, uint8_t *ur) {
    for (int b = 0; b < nb; b++) {
        const uint8_t *A = row + (size_t)b * sizeof(blk_q8_0);
        __m256i q = _mm256_loadu_si256((const __m256i *)(A + 2));
        _mm256_storeu_si256((__m256i *)(ur + 32 * (size_t)b), _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)));
        float d = _cvtsh_ss(load_u16(A));
        pf8_store_scales(ur, nb, b, d, d, 0.0f);
    }
}

/* --- R16 (see r16.c) -------------------------------------------------------------------------- */

/* The fifth bits of a block's 16 rows (HB: one u32 per row, bit 8i + 4h + g for element 16h + 4g + i)
 * into the v16 U vectors W[4h + g] as 0x10 of byte i (Q5_0, Q5_1 and Q5_K). */
A512 AINL void r16_hb5_512(const uint8_t *hb_at, __m512i *W) {
    const __m512i hb = _mm512_loadu_si512(hb_at), b5 = _mm512_set1_epi8(0x10);
    for (int k = 0; k < 8; k++) {   /* bit 8i + k -> 0x10 of byte i */
        const __m512i hk = k <= 4 ? _mm512_slli_epi32(hb, 4 - k) : _mm512_srli_epi32(hb, k - 4);
        W[k] = _mm512_or_si512(W[k], _mm512_and_si512(hk, b5));
    }
}

/* The same for 8 rows (hb_at: their 32 bytes), AVX2. */
A256 AINL void r16_hb5_256(const uint8_t *hb_at, __m256i *W) {
    const __m256i hb = _mm256_loadu_si256((const __m256i *)hb_at), b5 = _mm256_set1_epi8(0x10);
    for (int k = 0; k < 8; k++) {
        const __m256i hk = k <= 4 ? _mm256_slli_epi32(hb, 4 - k) : _mm256_srli_epi32(hb, k - 4);
        W[k] = _mm256_or_si256(W[k], _mm256_and_si256(hk, b5));
    }
}

/* Block b (j within its unit u) of a legacy or IQ4_NL group: the v16 U vectors W[4h + g], the half
 * scales (d twice) and the mins (see r16_block). */
A512 AINL void r16_block_legacy(const int t, const r16_ptrs *p, const uint8_t *u, size_t j, __m512i *W, __m512 *wd0,
                                __m512 *wd1, __m512 *mn) {
    if (t == RQ_Q8_0) {
        for (int k = 0; k < 8; k++) W[k] = _mm512_loadu_si512(u + p->q8 + 64 * k);
    } else {
        r16_nib_512(p, u, j, W);
        if (t == RQ_IQ4_NL) iq4_lookup8_512(W);
        if (t == RQ_Q5_0 || t == RQ_Q5_1) r16_hb5_512(u + p->hb, W);
    }
    *wd0 = *wd1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + p->d)));
    *mn = p->m ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + p->m))) : _mm512_setzero_ps();
}

/* The same for rows 8q..8q+7, AVX2 (see r16_block_256; Q8_0 and IQ4_NL: the signed values). */
A256 AINL void r16_block_legacy_256(const int t, const r16_ptrs *p, const uint8_t *u, size_t j, const int q,
                                    __m256i *W, __m256 *wd0, __m256 *wd1, __m256 *mn) {
    const size_t o = 32 * (size_t)q;
    if (t == RQ_Q8_0) {
        const __m256i x80 = _mm256_set1_epi8((char)0x80);
        for (int k = 0; k < 8; k++) W[k] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(u + p->q8 + 64 * k + o)), x80);
    } else {
        r16_nib_256(p, u, j, o, W);
        if (t == RQ_IQ4_NL) iq4_lookup8_256(W, 0);
        if (t == RQ_Q5_0 || t == RQ_Q5_1) r16_hb5_256(u + p->hb + o, W);
    }
    const size_t o16 = 16 * (size_t)q;
    *wd0 = *wd1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->d + o16)));
    *mn = p->m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->m + o16))) : _mm256_setzero_ps();
}

/* r16_dot_256 for the signed types (type_s8: Q8_0, IQ4_NL, IQ4_XS; their AVX2 W hold the signed
 * values): through the sign trick (|w| * sign(q, w)), so the sum comes out offset-free. */
A256 AINL __m256i r16_dot_s8_256(const __m256i *Wh, const uint8_t *qd) {
    __m256i s = _mm256_setzero_si256();
    for (int g = 0; g < 4; g++) s = _mm256_add_epi32(s, dot_dwords_256(Wh[g], _mm256_set1_epi32((int)load_u32(qd + 4 * g)), 1));
    return s;
}

#endif /* x86 */
