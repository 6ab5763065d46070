/* The float kernels of the forward pass: e^x, the gated activations, attention over the KV ring,
 * and the KV stores (attention.h). Each SIMD kernel follows its scalar reference: exp_ref and
 * exp8 / exp16, gated_act_ref and gated_act_256, attend_row_ref and attend_rows_256 / _512,
 * rq_f32_to_f16 and f32_to_f16_row_f16c. */
#include "attention.h"
#include "quants.h"   /* the kernel path; f16 conversions */

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include "simd.h"   /* <immintrin.h> (and the SIMDe switch of the test build) */
#define A256F __attribute__((target("avx2,fma,f16c")))
#define AINL static inline __attribute__((always_inline))
#endif

/* ---------------------------------------------------------------- e^x */

/* e^x for the softmax and the gated activations, in place of libm's expf (a call per score was
 * 9 % of prefill). exp8 / exp16 below do the same operations lane for lane, so every kernel path
 * gets the same values. Max error 0.81 ulp, 99.8 % of floats correctly rounded (expf: 0.50 ulp).
 * x = n ln2 + r + c: r exact (ln2's high part has 21 bits, so fma(-n, hi, x) does not round), c =
 * -n lo tiny; e^(r+c) ~ 1 + r + r^2 q(r) + c (1 + r) with q a degree-4 minimax fit (relative error
 * 4e-9) and 1 + r kept as an exact hi + lo, so the sum rounds once; 2^n is applied in two halves,
 * so subnormal results and overflow to +inf come out right. 0 below -104; NaN stays NaN. */
#define EXP_LOG2E 0x1.715476p+0f
#define EXP_LN2_HI 0x1.62e43p-1f      /* 21 significant bits */
#define EXP_LN2_LO -0x1.05c610p-29f   /* ln2 - EXP_LN2_HI */
#define EXP_MIN -104.0f               /* e^x rounds to 0 from here down */
#define EXP_MAX 88.8f                 /* overflows to +inf from 88.73 up */
#define EXP_Q0 0x1.fffffcp-2f
#define EXP_Q1 0x1.555492p-3f
#define EXP_Q2 0x1.5558f2p-5f
#define EXP_Q3 0x1.123a0ap-7f
#define EXP_Q4 0x1.6a23f0p-10f

static inline float pow2i(float n) {   /* 2^n for integral -126 <= n <= 127 */
    int32_t bits = ((int32_t)n + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float exp_ref(float x) {
    if (x != x) return x;
    const float xc = x < EXP_MIN ? EXP_MIN : (x > EXP_MAX ? EXP_MAX : x);
    const float n = rintf(xc * EXP_LOG2E);
    const float r = fmaf(-n, EXP_LN2_HI, xc), c = n * -EXP_LN2_LO;
    const float q = fmaf(fmaf(fmaf(fmaf(EXP_Q4, r, EXP_Q3), r, EXP_Q2), r, EXP_Q1), r, EXP_Q0);
    const float t = fmaf(q, r * r, fmaf(c, r, c));
    const float hi = 1.0f + r, lo = (1.0f - hi) + r;
    const float p = hi + (lo + t);
    const float h = floorf(n * 0.5f);
    return p * pow2i(h) * pow2i(n - h);
}

#if defined(__x86_64__) || defined(__i386__)
A256F static inline __m256 pow2_8(__m256 n) {   /* pow2i on 8 lanes */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

A512 static inline __m512 pow2_16(__m512 n) {   /* pow2i on 16 lanes */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}

/* exp_ref on 8 lanes: the same operations, so the same results bit for bit. */
A256F static inline __m256 exp8(__m256 x) {
    const __m256 xc = _mm256_min_ps(_mm256_set1_ps(EXP_MAX), _mm256_max_ps(_mm256_set1_ps(EXP_MIN), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), xc);
    const __m256 c = _mm256_mul_ps(n, _mm256_set1_ps(-EXP_LN2_LO));
    __m256 q = _mm256_fmadd_ps(_mm256_set1_ps(EXP_Q4), r, _mm256_set1_ps(EXP_Q3));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(EXP_Q2));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(EXP_Q1));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(EXP_Q0));
    const __m256 t = _mm256_fmadd_ps(q, _mm256_mul_ps(r, r), _mm256_fmadd_ps(c, r, c));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 hi = _mm256_add_ps(one, r), lo = _mm256_add_ps(_mm256_sub_ps(one, hi), r);
    const __m256 p = _mm256_add_ps(hi, _mm256_add_ps(lo, t));
    const __m256 h = _mm256_round_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    return _mm256_mul_ps(_mm256_mul_ps(p, pow2_8(h)), pow2_8(_mm256_sub_ps(n, h)));   /* NaN lanes: p is NaN */
}

/* exp_ref on 16 lanes, the same operations as exp8: its deliberate AVX-512 twin (the 16-lane
 * softmax's), kept apart because C has no vector type generic over the width. */
A512 static inline __m512 exp16(__m512 x) {
    const __m512 xc = _mm512_min_ps(_mm512_set1_ps(EXP_MAX), _mm512_max_ps(_mm512_set1_ps(EXP_MIN), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), xc);
    const __m512 c = _mm512_mul_ps(n, _mm512_set1_ps(-EXP_LN2_LO));
    __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(EXP_Q4), r, _mm512_set1_ps(EXP_Q3));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(EXP_Q2));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(EXP_Q1));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(EXP_Q0));
    const __m512 t = _mm512_fmadd_ps(q, _mm512_mul_ps(r, r), _mm512_fmadd_ps(c, r, c));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 hi = _mm512_add_ps(one, r), lo = _mm512_add_ps(_mm512_sub_ps(one, hi), r);
    const __m512 p = _mm512_add_ps(hi, _mm512_add_ps(lo, t));
    const __m512 h = _mm512_roundscale_ps(_mm512_mul_ps(n, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    return _mm512_mul_ps(_mm512_mul_ps(p, pow2_16(h)), pow2_16(_mm512_sub_ps(n, h)));
}

A256F static int exp_array_256(const float *x, float *y, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
    return i;
}

A512 static int exp_array_512(const float *x, float *y, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, exp16(_mm512_loadu_ps(x + i)));
    return i;
}
#endif

void rq_exp(const float *x, float *y, int n) {
    int i = 0;
#if defined(__x86_64__) || defined(__i386__)
    if (rq_kernel_path() == RQ_PATH_AVX512) i = exp_array_512(x, y, n);
    else if (rq_kernel_path() == RQ_PATH_AVX2) i = exp_array_256(x, y, n);
#endif
    for (; i < n; i++) y[i] = exp_ref(x[i]);
}

/* x = cap * tanh(x / cap) on x[0..n), as cap * (1 - 2 / (e^(2x / cap) + 1)) with rq_exp, whose
 * lanes equal exp_ref's: the same values on every kernel path (libm's tanhf would be a call per
 * score). Gemma 2 caps its attention scores and its logits. */
static void softcap(float *x, int n, float cap) {
    const float k = 2.0f / cap;
    for (int i = 0; i < n; i++) x[i] *= k;
    rq_exp(x, x, n);
    for (int i = 0; i < n; i++) x[i] = cap * (1.0f - 2.0f / (x[i] + 1.0f));
}

void rq_softcap(float *x, int n, float cap) { softcap(x, n, cap); }   /* the logits' (forward.c) */

/* ---------------------------------------------------------------- gated activations */

/* SiLU x * sigmoid(x) and GELU-tanh 0.5 x (1 + tanh(u)) = x * sigmoid(2u): g[i] = act(g[i]) * up[i]. */
static void gated_act_ref(float *g, const float *up, size_t n, int gelu) {
    const float k = 0.7978845608028654f;   /* sqrt(2 / pi) */
    for (size_t i = 0; i < n; i++) {
        float x = g[i];
        float z = gelu ? -2.0f * (k * (x + 0.044715f * x * x * x)) : -x;
        g[i] = x / (1.0f + exp_ref(z)) * up[i];
    }
}

#if defined(__x86_64__) || defined(__i386__)
A256F static void gated_act_256(float *g, const float *up, size_t n, int gelu) {
    size_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 z;
        if (gelu) {
            __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                     _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
            z = _mm256_mul_ps(_mm256_set1_ps(-2.0f), u);
        } else {
            z = _mm256_sub_ps(_mm256_setzero_ps(), x);
        }
        __m256 y = _mm256_div_ps(x, _mm256_add_ps(one, exp8(z)));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(y, _mm256_loadu_ps(up + i)));
    }
    gated_act_ref(g + i, up + i, n - i, gelu);
}
#endif

void rq_gated_act(float *g, const float *up, size_t n, int gelu) {
#if defined(__x86_64__) || defined(__i386__)
    if (rq_kernel_path() != RQ_PATH_SCALAR) { gated_act_256(g, up, n, gelu); return; }
#endif
    gated_act_ref(g, up, n, gelu);
}

/* ---------------------------------------------------------------- attention */

/* Attention reads each KV head's keys and values once for a block of query rows - the query
 * heads of that KV head, for a few consecutive tokens - instead of once per row. Each row still
 * computes its own float sequence: its scores key by key, the softmax over its own keys, its
 * output summed over its keys in order. So a token's result does not depend on the block it ran
 * in (one pass, split passes and decode agree bit for bit), and the AVX-512 kernel, which runs
 * the AVX2 kernel's 8-lane operations on two rows per vector, gives the AVX2 kernel's results. */

#define ATT_PF_KEYS 32   /* keys ahead that a score tile asks the cache for (prefetch_kv) */
#define ATT_PF_TOKENS 16 /* passes of up to this many tokens prefetch (decode, speculative passes) */

/* One KV head's cache: position j in ring slot j % slots, rows kv_dim apart. */
typedef struct {
    const void *K, *V;   /* this KV head's entry in slot 0; f32, or f16 when f16 is set */
    int kv_dim, slots, hd, f16;
    float scale;
    int prefetch;        /* the keys are likely not in cache: the score tiles prefetch (prefetch_kv) */
    float softcap;       /* > 0: scores become softcap * tanh(score / softcap) before the softmax */
} att_kv;

/* The entry (key or value vector) of this KV head in ring slot `slot` of K or V. */
static inline const void *kv_entry(const att_kv *kv, const void *base, int slot) {
    return (const char *)base + (size_t)slot * kv->kv_dim * (kv->f16 ? sizeof(uint16_t) : sizeof(float));
}

/* An entry as floats: itself (f32), or widened into buf (f16; exact). */
static const float *kv_floats(const att_kv *kv, const void *entry, float *buf) {
    if (!kv->f16) return (const float *)entry;
    for (int i = 0; i < kv->hd; i++) buf[i] = rq_f16_to_f32(((const uint16_t *)entry)[i]);
    return buf;
}

/* One query row: a head of one token, the key positions it sees (lo..hi) and its output. */
typedef struct {
    const float *q;
    float *out;
    int lo, hi;
} att_row;

static inline int next_slot(int slot, int slots) { return slot + 1 == slots ? 0 : slot + 1; }

/* The keys a block of NR rows attends: [*lo, *hi] seen by some row, [*all_lo, *all_hi] by all. */
static inline void rows_key_span(const att_row *rows, int NR, int *lo, int *hi, int *all_lo, int *all_hi) {
    *lo = *all_lo = rows[0].lo;
    *hi = *all_hi = rows[0].hi;
    for (int r = 1; r < NR; r++) {
        *lo = rows[r].lo < *lo ? rows[r].lo : *lo;
        *hi = rows[r].hi > *hi ? rows[r].hi : *hi;
        *all_lo = rows[r].lo > *all_lo ? rows[r].lo : *all_lo;
        *all_hi = rows[r].hi < *all_hi ? rows[r].hi : *all_hi;
    }
}

/* Bit r set when row r sees key position j. */
static inline unsigned rows_seeing(const att_row *rows, int NR, int j) {
    unsigned on = 0;
    for (int r = 0; r < NR; r++) on |= (unsigned)(rows[r].lo <= j && j <= rows[r].hi) << r;
    return on;
}

/* Row r's scores in a block: sc + r * stride, key j at j - j0 (j0: the block's first key). The
 * stride leaves room for 4-key tiles, which may write 3 scores past a row's last key. */
static int block_stride(int keys) { return (keys + 3 + 15) & ~15; }

static int block_keys(const att_row *rows, int n_rows, int *j0) {
    int lo, hi, all_lo, all_hi;
    rows_key_span(rows, n_rows, &lo, &hi, &all_lo, &all_hi);
    *j0 = lo;
    return hi - lo + 1;
}

/* Scratch floats for a block of n_rows rows over `keys` positions, on any path (the AVX-512
 * kernel's: rows rounded up to 4, with their q interleaved). */
static size_t block_floats(int n_rows, int keys, int hd) {
    return (size_t)((n_rows + 3) & ~3) * (size_t)(block_stride(keys) + hd);
}


/* Dot product with 16 independent partial sums in a fixed order (n a multiple of 16 is the fast
 * case): the compiler may vectorize it without reassociating, so every clone gives one result
 * whatever the caller. A plain `s += a[i] * b[i]` stays scalar without -ffast-math. */
static inline float dot_f32(const float *a, const float *b, int n) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    for (int j = 0; i + j < n; j++) acc[j] += a[i + j] * b[i + j];
    for (int j = 0; j < 8; j++) acc[j] += acc[j + 8];
    for (int j = 0; j < 4; j++) acc[j] += acc[j + 4];
    return (acc[0] + acc[2]) + (acc[1] + acc[3]);
}

static inline void axpy_f32(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* Reference version, one row: softmax(scale * q.k) weighted sum of v. sc: scratch of its keys. */
static void attend_row_ref(const att_kv *kv, const att_row *row, float *sc) {
    const int lo = row->lo, pos = row->hi, nk = pos - lo + 1, hd = kv->hd;
    float mx = -INFINITY, buf[hd];
    for (int j = lo; j <= pos; j++)
        sc[j - lo] = dot_f32(row->q, kv_floats(kv, kv_entry(kv, kv->K, j % kv->slots), buf), hd) * kv->scale;
    if (kv->softcap > 0) softcap(sc, nk, kv->softcap);
    for (int j = 0; j < nk; j++) mx = sc[j] > mx ? sc[j] : mx;
    float sum = 0.0f;
    for (int j = 0; j < nk; j++) sc[j] = exp_ref(sc[j] - mx);
    for (int j = 0; j < nk; j++) sum += sc[j];
    memset(row->out, 0, sizeof(float) * hd);
    const float inv = 1.0f / sum;
    for (int j = lo; j <= pos; j++)
        axpy_f32(row->out, sc[j - lo] * inv, kv_floats(kv, kv_entry(kv, kv->V, j % kv->slots), buf), hd);
}

#if defined(__x86_64__) || defined(__i386__)
A256F static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Eight / sixteen floats of a KV entry from element i: f32 as is, f16 widened on the load (exact,
 * so both element types give the same sums for the same values). f16 is a constant wherever these
 * are inlined, so each kernel is compiled once per element type. */
A256F AINL __m256 kv_load8(const void *e, int i, const int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)e + i)))
               : _mm256_loadu_ps((const float *)e + i);
}

A512 AINL __m512 kv_load16(const void *e, int i, const int f16) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)e + i)))
               : _mm512_loadu_ps((const float *)e + i);
}

A256F static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* hsum8 of a[0..8) at once, each summed as hsum8 sums: [a0 a2 a4 a6 a1 a3 a5 a7]. */
A256F static inline __m256 hsum8_x8(const __m256 *a) {
    __m256 x[4], y[2];
    for (int i = 0; i < 4; i++)   /* lanes l + (l + 4): [a[2i] | a[2i + 1]] */
        x[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)   /* then l + (l + 2) */
        y[i] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(y[0], y[1], 0x88), _mm256_shuffle_ps(y[0], y[1], 0xDD));
}

/* Scaled scores of rows qa, qb against keys kp[0..4) into sa[0..4), sb[0..4): per (row, key) one
 * 8-lane FMA chain over hd, then hsum8's sum. Eight chains hide the FMA latency (hd is often 64). */
A256F AINL void scores_2x4_256(const float *qa, const float *qb, const void *const *kp, int hd, float scale,
                               float *sa, float *sb, const int f16) {
    __m256 acc[8];   /* [2 key + row] */
    for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
    for (int i = 0; i < hd; i += 8) {
        const __m256 q0 = _mm256_loadu_ps(qa + i), q1 = _mm256_loadu_ps(qb + i);
        for (int u = 0; u < 4; u++) {
            const __m256 k = kv_load8(kp[u], i, f16);
            acc[2 * u] = _mm256_fmadd_ps(q0, k, acc[2 * u]);
            acc[2 * u + 1] = _mm256_fmadd_ps(q1, k, acc[2 * u + 1]);
        }
    }
    const __m256 s = _mm256_mul_ps(hsum8_x8(acc), _mm256_set1_ps(scale));
    _mm_storeu_ps(sa, _mm256_castps256_ps128(s));
    _mm_storeu_ps(sb, _mm256_extractf128_ps(s, 1));
}

/* Pointers to keys j..j+3 for a 4-key tile (past hi: key hi again, its score unused); *slot, key
 * j's ring slot, steps along. */
AINL void tile_keys(const att_kv *kv, int j, int hi, int *slot, const void **kp) {
    for (int u = 0; u < 4; u++) {
        kp[u] = kv_entry(kv, kv->K, *slot);
        if (j + u < hi) *slot = next_slot(*slot, kv->slots);
    }
}

/* Prefetch the key and value entries of the 4 positions ATT_PF_KEYS after the tile at ring slot
 * `slot` (within the ring; past hi harmless). One head's entries sit kv_dim apart, so the hardware
 * prefetchers see a stride, not a stream, and without this the score tiles waited on their keys:
 * SmolLM2's one-token pass at 1,200 positions took 4.4 ms on 2 threads, 3.75 ms with it. The
 * values are wanted only after the softmax, by which time they are in L2 (a head's values over
 * 1,000+ positions: ~130 KB at f16). Only in passes of a few tokens (ATT_PF_TOKENS; kv->prefetch),
 * and only for a block's first rows: in a prefill most blocks find the keys in cache, and the
 * extra instructions cost 1-3 % of a SmolLM2 prefill. */
AINL void prefetch_kv(const att_kv *kv, int slot) {
    const size_t entry = (size_t)kv->hd * (kv->f16 ? sizeof(uint16_t) : sizeof(float));
    for (int u = 0; u < 4; u++) {
        int s = slot + ATT_PF_KEYS + u;
        s = s >= kv->slots ? s - kv->slots : s;
        if (s >= kv->slots) continue;   /* a ring shorter than the distance */
        const char *k = kv_entry(kv, kv->K, s), *v = kv_entry(kv, kv->V, s);
        for (size_t o = 0; o < entry; o += 64) {
            _mm_prefetch(k + o, _MM_HINT_T0);
            _mm_prefetch(v + o, _MM_HINT_T1);
        }
    }
}

/* Scores of every row of the block, two rows per tile (an odd last row twice, into the spare
 * score row after it). */
A256F AINL void block_scores_256(const att_kv *kv, const att_row *rows, int n_rows, float *sc, int stride, int j0,
                                 const int f16) {
    for (int r = 0; r < n_rows; r += 2) {
        const att_row *a = &rows[r], *b = &rows[r + 1 < n_rows ? r + 1 : r];
        const int pf = r == 0 && kv->prefetch;
        const int lo = a->lo < b->lo ? a->lo : b->lo, hi = a->hi > b->hi ? a->hi : b->hi;
        float *sa = sc + (size_t)r * stride, *sb = sa + stride;
        int slot = lo % kv->slots;
        for (int j = lo; j <= hi; j += 4) {
            const void *kp[4];
            if (pf) prefetch_kv(kv, slot);
            tile_keys(kv, j, hi, &slot, kp);
            scores_2x4_256(a->q, b->q, kp, kv->hd, kv->scale, sa + (j - j0), sb + (j - j0), f16);
        }
    }
}

/* s[0..nk) = softmax(s): e^(s - max), times 1 / sum; the sum over 8 lanes from s[0] (masked tail)
 * then hsum8. */
A256F static void softmax_256(float *s, int nk) {
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= nk; i += 8) vmx = _mm256_max_ps(_mm256_loadu_ps(s + i), vmx);
    float mx = hmax8(vmx);
    for (; i < nk; i++) mx = s[i] > mx ? s[i] : mx;
    __m256 vs = _mm256_setzero_ps();
    for (i = 0; i + 8 <= nk; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(s + i, e);
        vs = _mm256_add_ps(vs, e);
    }
    if (i < nk) {   /* tail: masked lanes contribute 0 */
        const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nk - i), idx);
        __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(s + i, mask), _mm256_set1_ps(mx)));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(mask));
        _mm256_maskstore_ps(s + i, mask, e);
        vs = _mm256_add_ps(vs, e);
    }
    const float inv = 1.0f / hsum8(vs);
    for (i = 0; i + 8 <= nk; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(inv)));
    for (; i < nk; i++) s[i] *= inv;
}

/* The weighted sum of the values, written once for both vector widths (wsum_256, wsum_512): outputs
 * c..c + LANES W of rows[0..NR) (NR <= MAX_ROWS), the sum over each row's keys, in order, of its
 * softmax weight (p + r * stride, key j at j - j0) times v. Keys every row sees go without per-row
 * tests. KEY(o, v, c, p, stride, NR, W, rows_on, f16) adds key j's value vector v (its floats c..)
 * times each on-row's weight into its W outputs. */
#define WSUM_BODY(VEC, LANES, MAX_ROWS, ZERO, STORE, KEY)                                                    \
    VEC o[MAX_ROWS][4];                                                                                      \
    int lo, hi, all_lo, all_hi;                                                                              \
    rows_key_span(rows, NR, &lo, &hi, &all_lo, &all_hi);                                                     \
    for (int r = 0; r < NR; r++)                                                                             \
        for (int w = 0; w < W; w++) o[r][w] = ZERO();                                                        \
    int slot = lo % kv->slots, j = lo;                                                                       \
    for (; j <= hi; j++, slot = next_slot(slot, kv->slots)) {                                                \
        if (j >= all_lo && j <= all_hi) break;                                                               \
        KEY(o, kv_entry(kv, kv->V, slot), c, p + (j - j0), stride, NR, W, rows_seeing(rows, NR, j), f16);    \
    }                                                                                                        \
    for (; j <= all_hi; j++, slot = next_slot(slot, kv->slots))                                              \
        KEY(o, kv_entry(kv, kv->V, slot), c, p + (j - j0), stride, NR, W, (1u << NR) - 1, f16);              \
    for (; j <= hi; j++, slot = next_slot(slot, kv->slots)) {                                                \
        KEY(o, kv_entry(kv, kv->V, slot), c, p + (j - j0), stride, NR, W, rows_seeing(rows, NR, j), f16);    \
    }                                                                                                        \
    for (int r = 0; r < NR; r++)                                                                             \
        for (int w = 0; w < W; w++) STORE(rows[r].out + c + LANES * w, o[r][w]);

/* wsum's KEY, for both widths: LOAD a value vector's floats, BCAST a weight (from its address). */
#define WSUM_KEY_BODY(VEC, LANES, LOAD, BCAST, FMADD)                                                        \
    VEC vv[4];                                                                                               \
    for (int w = 0; w < W; w++) vv[w] = LOAD(v, c + LANES * w, f16);                                         \
    for (int r = 0; r < NR; r++) {                                                                           \
        if (!(rows_on >> r & 1)) continue;                                                                   \
        const VEC pr = BCAST(p + (size_t)r * stride);                                                        \
        for (int w = 0; w < W; w++) o[r][w] = FMADD(pr, vv[w], o[r][w]);                                    \
    }

A256F AINL void wsum_key_256(__m256 (*o)[4], const void *v, int c, const float *p, int stride, const int NR,
                             const int W, unsigned rows_on, const int f16) {
    WSUM_KEY_BODY(__m256, 8, kv_load8, _mm256_broadcast_ss, _mm256_fmadd_ps)
}

/* Up to 2 rows of 8-lane outputs. */
A256F AINL void wsum_256(const att_kv *kv, const att_row *rows, const float *p, int stride, int j0, const int NR,
                         const int W, int c, const int f16) {
    WSUM_BODY(__m256, 8, 2, _mm256_setzero_ps, _mm256_storeu_ps, wsum_key_256)
}

/* hd a multiple of 8. Scratch: block_floats(). */
A256F AINL void attend_rows_256_t(const att_kv *kv, const att_row *rows, int n_rows, float *scratch, const int f16) {
    int j0;
    const int stride = block_stride(block_keys(rows, n_rows, &j0)), hd = kv->hd;
    block_scores_256(kv, rows, n_rows, scratch, stride, j0, f16);
    for (int r = 0; r < n_rows; r++) {
        float *s = scratch + (size_t)r * stride + (rows[r].lo - j0);
        if (kv->softcap > 0) softcap(s, rows[r].hi - rows[r].lo + 1, kv->softcap);
        softmax_256(s, rows[r].hi - rows[r].lo + 1);
    }
    for (int r = 0; r < n_rows; r += 2) {   /* two rows share each value load */
        const float *p = scratch + (size_t)r * stride;
        int c = 0;
        if (n_rows - r >= 2) {
            for (; c + 32 <= hd; c += 32) wsum_256(kv, rows + r, p, stride, j0, 2, 4, c, f16);
            for (; c < hd; c += 8) wsum_256(kv, rows + r, p, stride, j0, 2, 1, c, f16);
        } else {
            for (; c + 32 <= hd; c += 32) wsum_256(kv, rows + r, p, stride, j0, 1, 4, c, f16);
            for (; c < hd; c += 8) wsum_256(kv, rows + r, p, stride, j0, 1, 1, c, f16);
        }
    }
}

A256F static void attend_rows_256_f32(const att_kv *kv, const att_row *rows, int n, float *scratch) {
    attend_rows_256_t(kv, rows, n, scratch, 0);
}

A256F static void attend_rows_256_f16(const att_kv *kv, const att_row *rows, int n, float *scratch) {
    attend_rows_256_t(kv, rows, n, scratch, 1);
}

/* The AVX-512 twins of the AVX2 attention kernels above. Deliberate twins: 16 lanes change the data
 * layout (two rows' 8-lane chains per vector in the scores, four rows per value load, 16-lane exps
 * in the softmax), not only the intrinsics, so they keep bodies of their own; each runs its AVX2
 * twin's per-lane operations in the same order, so both give the same results bit for bit (tested).
 * What differs only in width shares one body (WSUM_BODY, WSUM_KEY_BODY). */

/* _mm512_shuffle_f32x4 (SIMDe 0.7.4, of the test build, has only the integer form) */
#define SHUFFLE_F32X4(a, b, imm) \
    _mm512_castsi512_ps(_mm512_shuffle_i32x4(_mm512_castps_si512(a), _mm512_castps_si512(b), (imm)))

/* hsum8_x8 on 16 sums: a[2 key + pair] holds row pair `pair`'s two 8-lane sums for that key
 * ([row 2 pair | row 2 pair + 1]); 128-bit lane r of the result holds row r's sums for keys 0..3. */
A512 static inline __m512 hsum8_x16(const __m512 *a) {
    __m512 x[4], y[2];
    for (int i = 0; i < 4; i++)   /* lanes l + (l + 4) of each half: [a[2i] lo | hi | a[2i+1] lo | hi] */
        x[i] = _mm512_add_ps(SHUFFLE_F32X4(a[2 * i], a[2 * i + 1], 0x88), SHUFFLE_F32X4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)   /* then l + (l + 2) */
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

/* scores_2x4_256 for 4 rows: qi0, qi1 hold rows (0, 1) and (2, 3) interleaved per 8 floats, each
 * key is broadcast to both halves, so one FMA runs two rows' 8-lane chains. */
A512 AINL void scores_4x4_512(const float *qi0, const float *qi1, const void *const *kp, int hd, float scale,
                              float *const *s, int at, const int f16) {
    __m512 acc[8];   /* [2 key + row pair] */
    for (int u = 0; u < 8; u++) acc[u] = _mm512_setzero_ps();
    for (int i = 0; i < hd; i += 8) {
        const __m512 q0 = _mm512_loadu_ps(qi0 + 2 * i), q1 = _mm512_loadu_ps(qi1 + 2 * i);
        for (int u = 0; u < 4; u++) {
            const __m512 k = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(kv_load8(kp[u], i, f16))));
            acc[2 * u] = _mm512_fmadd_ps(q0, k, acc[2 * u]);
            acc[2 * u + 1] = _mm512_fmadd_ps(q1, k, acc[2 * u + 1]);
        }
    }
    const __m512 v = _mm512_mul_ps(hsum8_x16(acc), _mm512_set1_ps(scale));
    _mm_storeu_ps(s[0] + at, _mm512_castps512_ps128(v));
    _mm_storeu_ps(s[1] + at, _mm512_extractf32x4_ps(v, 1));
    _mm_storeu_ps(s[2] + at, _mm512_extractf32x4_ps(v, 2));
    _mm_storeu_ps(s[3] + at, _mm512_extractf32x4_ps(v, 3));
}

/* softmax_256 with 16-lane exps; the sum adds each 8-lane half in turn, as softmax_256 does. */
A512 static void softmax_512(float *s, int nk) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 vmx = ninf;
    int i = 0;
    for (; i + 16 <= nk; i += 16) vmx = _mm512_max_ps(_mm512_loadu_ps(s + i), vmx);
    const __mmask16 tail = (__mmask16)((1u << (nk - i)) - 1);
    if (tail) vmx = _mm512_max_ps(_mm512_mask_loadu_ps(ninf, tail, s + i), vmx);
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx));
    __m256 vs = _mm256_setzero_ps();
    for (i = 0; i + 16 <= nk; i += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), mx));
        _mm512_storeu_ps(s + i, e);
        vs = _mm256_add_ps(vs, _mm512_castps512_ps256(e));
        vs = _mm256_add_ps(vs, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    if (tail) {   /* masked lanes are 0: adding them changes no sum */
        const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + i), mx)));
        _mm512_mask_storeu_ps(s + i, tail, e);
        vs = _mm256_add_ps(vs, _mm512_castps512_ps256(e));
        vs = _mm256_add_ps(vs, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    const __m512 inv = _mm512_set1_ps(1.0f / hsum8(vs));
    for (i = 0; i + 16 <= nk; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
    if (tail) _mm512_mask_storeu_ps(s + i, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + i), inv));
}

#define SET1_512(at) _mm512_set1_ps(*(at))   /* a weight from its address, as _mm256_broadcast_ss takes it */

A512 AINL void wsum_key_512(__m512 (*o)[4], const void *v, int c, const float *p, int stride, const int NR,
                            const int W, unsigned rows_on, const int f16) {
    WSUM_KEY_BODY(__m512, 16, kv_load16, SET1_512, _mm512_fmadd_ps)
}

/* wsum_256 on 16-lane outputs (the same per-lane sums), up to 4 rows. */
A512 AINL void wsum_512(const att_kv *kv, const att_row *rows, const float *p, int stride, int j0, const int NR,
                        const int W, int c, const int f16) {
    WSUM_BODY(__m512, 16, 4, _mm512_setzero_ps, _mm512_storeu_ps, wsum_key_512)
}

A512 AINL void wsum_rows_512(const att_kv *kv, const att_row *rows, int nr, const float *p, int stride, int j0,
                            const int f16) {
    int c = 0;
    switch (nr) {
#define WSUM_512(NR)                                                                        \
    for (; c + 64 <= kv->hd; c += 64) wsum_512(kv, rows, p, stride, j0, NR, 4, c, f16);     \
    for (; c < kv->hd; c += 16) wsum_512(kv, rows, p, stride, j0, NR, 1, c, f16);           \
    break;
    case 4: WSUM_512(4)
    case 3: WSUM_512(3)
    case 2: WSUM_512(2)
    default: WSUM_512(1)
#undef WSUM_512
    }
}

/* hd a multiple of 16. Scratch: block_floats(). */
A512 AINL void attend_rows_512_t(const att_kv *kv, const att_row *rows, int n_rows, float *scratch, const int f16) {
    int j0;
    const int stride = block_stride(block_keys(rows, n_rows, &j0)), hd = kv->hd, n4 = (n_rows + 3) & ~3;
    /* q of rows (0, 1), (2, 3)... interleaved per 8 floats; rows past the last: the last again,
     * into the spare score rows */
    float *qi = scratch, *sc = scratch + (size_t)n4 * hd;
    for (int r = 0; r < n4; r++) {
        const float *q = rows[r < n_rows ? r : n_rows - 1].q;
        float *dst = qi + (size_t)(r & ~1) * hd + (r & 1) * 8;
        for (int i = 0; i < hd; i += 8) memcpy(dst + 2 * i, q + i, 8 * sizeof(float));
    }
    for (int r = 0; r < n_rows; r += 4) {
        int lo = rows[r].lo, hi = rows[r].hi;
        for (int u = 1; u < 4 && r + u < n_rows; u++) {
            lo = rows[r + u].lo < lo ? rows[r + u].lo : lo;
            hi = rows[r + u].hi > hi ? rows[r + u].hi : hi;
        }
        float *s[4];
        for (int u = 0; u < 4; u++) s[u] = sc + (size_t)(r + u) * stride;
        const int pf = r == 0 && kv->prefetch;
        int slot = lo % kv->slots;
        for (int j = lo; j <= hi; j += 4) {
            const void *kp[4];
            if (pf) prefetch_kv(kv, slot);
            tile_keys(kv, j, hi, &slot, kp);
            scores_4x4_512(qi + (size_t)r * hd, qi + (size_t)(r + 2) * hd, kp, hd, kv->scale, s, j - j0, f16);
        }
    }
    for (int r = 0; r < n_rows; r++) {
        float *s = sc + (size_t)r * stride + (rows[r].lo - j0);
        if (kv->softcap > 0) softcap(s, rows[r].hi - rows[r].lo + 1, kv->softcap);
        softmax_512(s, rows[r].hi - rows[r].lo + 1);
    }
    for (int r = 0; r < n_rows; r += 4)   /* four rows share each value load */
        wsum_rows_512(kv, rows + r, n_rows - r < 4 ? n_rows - r : 4, sc + (size_t)r * stride, stride, j0, f16);
}

A512 static void attend_rows_512_f32(const att_kv *kv, const att_row *rows, int n, float *scratch) {
    attend_rows_512_t(kv, rows, n, scratch, 0);
}

A512 static void attend_rows_512_f16(const att_kv *kv, const att_row *rows, int n, float *scratch) {
    attend_rows_512_t(kv, rows, n, scratch, 1);
}
#endif

/* Attention of one block of rows (one KV head). scratch: block_floats() floats. */
static void attend_rows(const att_kv *kv, const att_row *rows, int n_rows, float *scratch) {
#if defined(__x86_64__) || defined(__i386__)
    const int path = rq_kernel_path();
    if (path == RQ_PATH_AVX512 && kv->hd % 16 == 0) {
        (kv->f16 ? attend_rows_512_f16 : attend_rows_512_f32)(kv, rows, n_rows, scratch);
        return;
    }
    if (path != RQ_PATH_SCALAR && kv->hd % 8 == 0) {   /* on the avx512 path too: the same results */
        (kv->f16 ? attend_rows_256_f16 : attend_rows_256_f32)(kv, rows, n_rows, scratch);
        return;
    }
#endif
    for (int r = 0; r < n_rows; r++) attend_row_ref(kv, &rows[r], scratch);
}

#define ATT_BLOCK_TOKENS 4      /* consecutive tokens per block in prefill */
#define ATT_MAX_ROWS 64         /* rows per block */
#define ATT_PARALLEL_FROM 32    /* decode: below this position one thread runs the heads (a parallel
                                 * region costs more than their work) */

/* At least 256 KB (a block's scores stay in L2), and at least one row over every position. */
size_t rq_att_scratch_floats(int capacity, int hd) {
    const size_t one_row = block_floats(1, capacity, hd);
    return one_row > 64 * 1024 ? one_row : 64 * 1024;
}

/* A pass's attention runs as blocks of `tokens` consecutive tokens x `heads` query heads of one
 * KV head. Given 0, picks them: all of a KV head's query heads, ATT_BLOCK_TOKENS tokens, fewer
 * where the scratch is too small for the keys; for one token, heads split so that every thread
 * gets a block (each block then reads the keys again). */
static void attention_split(const rq_att_shape *a, int n, int pos0, int n_threads, size_t scratch_floats,
                            int *tokens, int *heads) {
    const int group = a->n_head / a->n_head_kv;
    int t = *tokens > 0 ? *tokens : (n < ATT_BLOCK_TOKENS ? n : ATT_BLOCK_TOKENS);
    int h = *heads;
    if (h <= 0) {
        int per_kv = n == 1 && pos0 >= ATT_PARALLEL_FROM ? (n_threads + a->n_head_kv - 1) / a->n_head_kv : 1;
        per_kv = per_kv < group ? per_kv : group;
        h = (group + per_kv - 1) / per_kv;
    }
    h = h < group ? h : group;
    for (;;) {
        const int keys = a->window > 0 && a->window + t - 1 < pos0 + n ? a->window + t - 1 : pos0 + n;
        if (t * h <= ATT_MAX_ROWS && block_floats(t * h, keys, a->hd) <= scratch_floats) break;
        if (t > 1) t--;
        else if (h > 1) h--;
        else break;
    }
    *tokens = t;
    *heads = h;
}

/* Attention of n tokens at positions pos0.. (q and out: [n][n_head * hd]) over the ring K, V,
 * in blocks of `tokens` x `heads` (0: attention_split's choice) on n_threads threads, each with
 * scratch_floats of scratch. */
void rq_attend_tokens(const rq_att_shape *a, const float *q, const void *K, const void *V, float *out, int n,
                      int pos0, int tokens, int heads, int n_threads, float *scratch, size_t scratch_floats) {
    attention_split(a, n, pos0, n_threads, scratch_floats, &tokens, &heads);
    const int hd = a->hd, group = a->n_head / a->n_head_kv, q_dim = a->n_head * hd;
    const int chunks = (group + heads - 1) / heads, per_block = a->n_head_kv * chunks;
    const int n_blocks = (n + tokens - 1) / tokens;
    /* Later tokens see more keys: their blocks go first, so the threads end together. */
    #pragma omp parallel for schedule(dynamic) num_threads(n_threads) if (n > 1 || pos0 >= ATT_PARALLEL_FROM)
    for (int task = 0; task < n_blocks * per_block; task++) {
        const int b = n_blocks - 1 - task / per_block, kvh = task % per_block / chunks;
        const int h0 = kvh * group + task % chunks * heads;
        const int h1 = h0 + heads < (kvh + 1) * group ? h0 + heads : (kvh + 1) * group;
        const size_t head_at = (size_t)kvh * hd * (a->f16 ? sizeof(uint16_t) : sizeof(float));
        const att_kv kv = {(const char *)K + head_at, (const char *)V + head_at, a->n_head_kv * hd, a->slots, hd, a->f16,
                           a->scale, n <= ATT_PF_TOKENS, a->softcap};
        att_row rows[ATT_MAX_ROWS];
        int nr = 0;
        for (int t = b * tokens; t < n && t < (b + 1) * tokens; t++) {
            const int pos = pos0 + t, lo = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
            for (int h = h0; h < h1; h++)
                rows[nr++] = (att_row){q + (size_t)t * q_dim + h * hd, out + (size_t)t * q_dim + h * hd, lo, pos};
        }
        attend_rows(&kv, rows, nr, scratch + (size_t)omp_get_thread_num() * scratch_floats);
    }
}

int rq_attention(const float *q, const void *k, const void *v, int f16, float *out, int n, int pos0, int n_head,
                 int n_head_kv, int hd, int slots, int window, float scale, float softcap, int tokens, int heads,
                 int n_threads) {
    const int keys = window > 0 && window + n - 1 < pos0 + n ? window + n - 1 : pos0 + n;
    if (n <= 0 || pos0 < 0 || n_head <= 0 || n_head_kv <= 0 || n_head % n_head_kv || hd <= 0 || keys > slots ||
        n_threads <= 0)
        return -1;
    const rq_att_shape a = {n_head, n_head_kv, hd, slots, window, f16 != 0, scale, softcap};
    size_t per_thread = block_floats(ATT_MAX_ROWS, keys, hd);
    const size_t bytes = sizeof(float) * per_thread * n_threads;
    void *scratch = NULL;
    if (posix_memalign(&scratch, 64, bytes) != 0) return -1;
    memset(scratch, 0, bytes);
    rq_attend_tokens(&a, q, k, v, out, n, pos0, tokens, heads, n_threads, scratch, per_thread);
    free(scratch);
    return 0;
}

/* ---------------------------------------------------------------- KV stores (f16 or f32) */

/* rq_f32_to_f16 on 8 lanes: vcvtps2ph rounds to nearest even too, so the halves are the same
 * (a NaN keeps more of its payload). */
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2,f16c"))) static void f32_to_f16_row_f16c(uint16_t *h, const float *x, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) h[i] = rq_f32_to_f16(x[i]);
}
#endif

void rq_kv_store(void *kv, int f16, size_t at, const float *x, int n) {
    if (!f16) {
        memcpy((float *)kv + at, x, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *h = (uint16_t *)kv + at;
#if defined(__x86_64__) || defined(__i386__)
    if (rq_kernel_path() != RQ_PATH_SCALAR) {   /* both SIMD paths have F16C */
        f32_to_f16_row_f16c(h, x, n);
        return;
    }
#endif
    for (int i = 0; i < n; i++) h[i] = rq_f32_to_f16(x[i]);
}
