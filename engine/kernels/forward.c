/* The transformer forward pass. Read rq_forward() top to bottom; helpers come first. */
#define _GNU_SOURCE   /* sincosf */
#include "forward.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define ALIGN 64

struct rq_model {
    rq_config cfg;
    rq_weights w;
    rq_kv kv;
    int q_dim, kv_dim, max_cols, n_threads;

    /* scratch for one pass of up to max_ubatch tokens */
    float *x;       /* residual stream      [U][n_embd]  */
    float *xb;      /* normed input / sublayer output [U][max(n_embd, q_dim)] */
    float *q;       /* [U][q_dim] */
    float *k, *v;   /* [U][kv_dim] */
    float *att_out; /* [U][q_dim] */
    float *hb, *hb2;/* [U][n_ff] */
    float *down2;   /* [2U][n_embd]: ffn_down of the activation and of its rounding residual */
    float *scores;  /* [threads][capacity] */
    float *rope_freq[2];   /* per rotated pair i: base^(-2i/head_dim), [0] global, [1] local layers */
    float *rope_cs[2];     /* this pass's (cos, sin) per token and pair, [U][head_dim/2][2], per base */
    rq_act *acts;   /* [2U], each over max_cols */
    int8_t *act_qs;
    float *act_d;
    int32_t *act_sum16;

    float *record;  /* test hook: residual after each layer */
    int record_max;
};

static void *alloc_aligned(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, ALIGN, bytes ? bytes : ALIGN) != 0) return NULL;
    memset(p, 0, bytes);
    return p;
}

/* ---------------------------------------------------------------- small float ops */

/* Hot float loops get per-CPU clones; the binary stays portable. */
#define RQ_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

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

/* out = x / sqrt(mean(x^2) + eps) * weight */
RQ_CLONES static void rmsnorm(float *out, const float *x, const float *weight, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float scale = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * scale * weight[i];
}

static void add_inplace(float *y, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += x[i];
}

/* (cos, sin) of pair i's angle pos * freq[i] for one position: cs[2i], cs[2i+1]. */
static void rope_angles(float *cs, const float *freq, int half, int pos) {
    for (int i = 0; i < half; i++) sincosf((float)pos * freq[i], &cs[2 * i + 1], &cs[2 * i]);
}

/* Rotate each head of vec (n_heads x head_dim) by the angles cs of its position (rope_angles).
 * neox = 0: pairs (2i, 2i+1) (llama); neox = 1: pairs (i, i + d/2) (gemma3, qwen2). */
static void rope(float *vec, int n_heads, int head_dim, const float *cs, int neox) {
    int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        float c = cs[2 * i], s = cs[2 * i + 1];
        for (int h = 0; h < n_heads; h++) {
            float *hv = vec + (size_t)h * head_dim;
            int a = neox ? i : 2 * i;
            int b = neox ? i + half : 2 * i + 1;
            float x0 = hv[a], x1 = hv[b];
            hv[a] = x0 * c - x1 * s;
            hv[b] = x0 * s + x1 * c;
        }
    }
}

/* ---------------------------------------------------------------- weights helpers */

static const float *f32_data(const rq_tensor *t) { return (const float *)t->data; }

/* Per-token work of a prefill pass (norms, quantizing, RoPE, activations, residual adds), split
 * across the threads: each token's result is computed exactly as alone, only elsewhere. Serial
 * for one token (decode), where a parallel region costs more than the work. */
#define FOR_TOKENS _Pragma("omp parallel for num_threads(m->n_threads) schedule(static) if (n > 1)")

static void quantize_rows(rq_model *m, const float *x, int n, int cols, int ld) {
    FOR_TOKENS
    for (int t = 0; t < n; t++) {
        m->acts[t].n = cols;
        rq_quantize_act(x + (size_t)t * ld, cols, &m->acts[t]);
    }
}

/* out[t][0..rows) = W x[t] for the n activations already quantized in m->acts. */
static void matmul(rq_model *m, const rq_tensor *W, int n, float *out, int ldo) {
    rq_matmul_r16(W->type, W->data, W->r16, W->rows, W->cols, m->acts, n, out, ldo, m->n_threads);
}

static void add_bias(float *y, const rq_tensor *b, int n, int ld) {
    if (!b->data) return;
    for (int t = 0; t < n; t++) add_inplace(y + (size_t)t * ld, f32_data(b), b->cols);
}

static int layer_is_local(const rq_config *c, int il) {
    return c->sliding_window > 0 && c->swa_pattern > 0 && (il % c->swa_pattern) < c->swa_pattern - 1;
}

/* ---------------------------------------------------------------- model lifetime */

rq_model *rq_model_create(const rq_config *cfg, const rq_weights *w, const rq_kv *kv) {
    rq_kernels_init();
    rq_model *m = calloc(1, sizeof(rq_model));
    if (!m) return NULL;
    m->cfg = *cfg;
    m->w = *w;
    m->kv = *kv;
    const rq_config *c = &m->cfg;
    int U = c->max_ubatch > 0 ? c->max_ubatch : 64;
    m->cfg.max_ubatch = U;
    m->n_threads = c->n_threads > 0 ? c->n_threads : omp_get_max_threads();
    m->q_dim = c->n_head * c->head_dim;
    m->kv_dim = c->n_head_kv * c->head_dim;
    int cols = c->n_embd;
    if (m->q_dim > cols) cols = m->q_dim;
    if (c->n_ff > cols) cols = c->n_ff;
    m->max_cols = cols;

    size_t xb_dim = (size_t)(c->n_embd > m->q_dim ? c->n_embd : m->q_dim);
    m->x = alloc_aligned(sizeof(float) * U * c->n_embd);
    m->xb = alloc_aligned(sizeof(float) * U * xb_dim);
    m->q = alloc_aligned(sizeof(float) * U * m->q_dim);
    m->k = alloc_aligned(sizeof(float) * U * m->kv_dim);
    m->v = alloc_aligned(sizeof(float) * U * m->kv_dim);
    m->att_out = alloc_aligned(sizeof(float) * U * m->q_dim);
    m->hb = alloc_aligned(sizeof(float) * U * c->n_ff);
    m->hb2 = alloc_aligned(sizeof(float) * U * c->n_ff);
    m->down2 = alloc_aligned(sizeof(float) * 2 * U * c->n_embd);
    m->scores = alloc_aligned(sizeof(float) * (size_t)m->n_threads * (kv->capacity + 1));
    m->acts = calloc(2 * U, sizeof(rq_act));
    m->act_qs = alloc_aligned((size_t)2 * U * cols);
    m->act_d = alloc_aligned(sizeof(float) * (size_t)2 * U * (cols / 32));
    m->act_sum16 = alloc_aligned(sizeof(int32_t) * (size_t)2 * U * (cols / 16));
    /* The angles depend on the position and the base only: computed once per pass for all
     * layers, from frequencies computed once here (powf per token and pair cost ~1 % of prefill). */
    const int half = c->head_dim / 2;
    for (int b = 0; b < 2; b++) {
        m->rope_freq[b] = alloc_aligned(sizeof(float) * half);
        m->rope_cs[b] = alloc_aligned(sizeof(float) * U * c->head_dim);
        if (!m->rope_freq[b] || !m->rope_cs[b]) {
            rq_model_free(m);
            return NULL;
        }
        const float base = b ? c->rope_base_local : c->rope_base;
        for (int i = 0; i < half; i++) m->rope_freq[b][i] = powf(base, -2.0f * (float)i / (float)c->head_dim);
    }
    if (!m->x || !m->xb || !m->q || !m->k || !m->v || !m->att_out || !m->hb || !m->hb2 || !m->down2 ||
        !m->scores || !m->acts || !m->act_qs || !m->act_d || !m->act_sum16) {
        rq_model_free(m);
        return NULL;
    }
    for (int t = 0; t < 2 * U; t++) {
        m->acts[t].qs = m->act_qs + (size_t)t * cols;
        m->acts[t].d = m->act_d + (size_t)t * (cols / 32);
        m->acts[t].sum16 = m->act_sum16 + (size_t)t * (cols / 16);
    }
    return m;
}

void rq_model_free(rq_model *m) {
    if (!m) return;
    free(m->x); free(m->xb); free(m->q); free(m->k); free(m->v); free(m->att_out);
    free(m->hb); free(m->hb2); free(m->down2); free(m->scores); free(m->acts);
    free(m->act_qs); free(m->act_d); free(m->act_sum16);
    for (int b = 0; b < 2; b++) { free(m->rope_freq[b]); free(m->rope_cs[b]); }
    free(m);
}

void rq_model_record_layers(rq_model *m, float *buf, int max_tokens) {
    m->record = buf;
    m->record_max = max_tokens;
}

static void record(rq_model *m, int l, int n) {
    if (!m->record || n > m->record_max) return;
    const int d = m->cfg.n_embd;
    memcpy(m->record + ((size_t)l * m->record_max) * d, m->x, sizeof(float) * n * d);
}

/* ---------------------------------------------------------------- the layer passes */

static void embed(rq_model *m, const int32_t *tokens, int n) {
    const rq_config *c = &m->cfg;
    const rq_tensor *E = &m->w.token_embd;
    size_t row_bytes = rq_row_bytes(E->type, E->cols);
    for (int t = 0; t < n; t++) {
        float *xt = m->x + (size_t)t * c->n_embd;
        rq_dequant_row(E->type, (const uint8_t *)E->data + row_bytes * tokens[t], xt, c->n_embd);
        if (c->embd_scale != 1.0f)
            for (int i = 0; i < c->n_embd; i++) xt[i] *= c->embd_scale;
    }
}

/* One query head against keys lo..pos of its KV head (cache rows strided by kv_dim, ring of
 * `slots`): softmax(scale * q.k) weighted sum of v into out[hd]. sc: scratch of pos - lo + 1.
 * Reference version; attend_head_256 below is the AVX2 one. */
static void attend_head_ref(const float *qh, const float *K, const float *V, int kv_dim, int slots,
                            int lo, int pos, int hd, float scale, float *sc, float *out) {
    const int nk = pos - lo + 1;
    float mx = -INFINITY;
    for (int j = lo; j <= pos; j++) {
        float s = dot_f32(qh, K + (size_t)(j % slots) * kv_dim, hd) * scale;
        sc[j - lo] = s;
        mx = s > mx ? s : mx;
    }
    float sum = 0.0f;
    for (int j = 0; j < nk; j++) sc[j] = exp_ref(sc[j] - mx);
    for (int j = 0; j < nk; j++) sum += sc[j];
    memset(out, 0, sizeof(float) * hd);
    const float inv = 1.0f / sum;
    for (int j = lo; j <= pos; j++) axpy_f32(out, sc[j - lo] * inv, V + (size_t)(j % slots) * kv_dim, hd);
}

#if defined(__x86_64__) || defined(__i386__)
#include "simd.h"   /* <immintrin.h> (and the SIMDe switch of the test build) */
#define A256F __attribute__((target("avx2,fma")))

A256F static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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

/* exp_ref on 16 lanes, the same operations as exp8. */
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

/* hd a multiple of 8. Each key's dot is one 8-lane accumulator over hd then a fixed horizontal
 * sum, and each output element sums the keys in order, so the result of a (token, head) does
 * not depend on the batch it ran in. */
A256F static void attend_head_256(const float *qh, const float *K, const float *V, int kv_dim, int slots,
                                  int lo, int pos, int hd, float scale, float *sc, float *out) {
    const int nk = pos - lo + 1;
    /* Keys are visited in order with their ring slot stepped along (no division per key). Eight
     * keys at a time: eight independent FMA chains hide the FMA latency (hd is often only 64). */
    int j = 0, slot = lo % slots;
    const float *kp[8];
    for (; j + 8 <= nk; j += 8) {
        for (int u = 0; u < 8; u++) {
            kp[u] = K + (size_t)slot * kv_dim;
            slot = slot + 1 == slots ? 0 : slot + 1;
        }
        __m256 a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
        for (int i = 0; i < hd; i += 8) {
            __m256 q = _mm256_loadu_ps(qh + i);
            for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(q, _mm256_loadu_ps(kp[u] + i), a[u]);
        }
        for (int u = 0; u < 8; u++) sc[j + u] = hsum8(a[u]) * scale;
    }
    for (; j < nk; j++) {
        const float *k0 = K + (size_t)slot * kv_dim;
        slot = slot + 1 == slots ? 0 : slot + 1;
        __m256 a0 = _mm256_setzero_ps();
        for (int i = 0; i < hd; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(k0 + i), a0);
        sc[j] = hsum8(a0) * scale;
    }
    float mx = -INFINITY;
    for (int i = 0; i < nk; i++) mx = sc[i] > mx ? sc[i] : mx;
    __m256 vs = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= nk; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + i), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(sc + i, e);
        vs = _mm256_add_ps(vs, e);
    }
    if (i < nk) {   /* tail: masked lanes contribute 0 */
        const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nk - i), idx);
        __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(sc + i, mask), _mm256_set1_ps(mx)));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(mask));
        _mm256_maskstore_ps(sc + i, mask, e);
        vs = _mm256_add_ps(vs, e);
    }
    const float inv = 1.0f / hsum8(vs);
    int c = 0;
    for (; c + 64 <= hd; c += 64) {   /* 64 outputs in registers over all keys */
        __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0, o4 = o0, o5 = o0, o6 = o0, o7 = o0;
        int vslot = lo % slots;
        for (int jj = 0; jj < nk; jj++) {
            const float *v = V + (size_t)vslot * kv_dim + c;
            vslot = vslot + 1 == slots ? 0 : vslot + 1;
            const __m256 p = _mm256_set1_ps(sc[jj] * inv);
            o0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), o0);
            o1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), o1);
            o2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), o2);
            o3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), o3);
            o4 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 32), o4);
            o5 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 40), o5);
            o6 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 48), o6);
            o7 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 56), o7);
        }
        float *oc = out + c;
        _mm256_storeu_ps(oc, o0); _mm256_storeu_ps(oc + 8, o1); _mm256_storeu_ps(oc + 16, o2);
        _mm256_storeu_ps(oc + 24, o3); _mm256_storeu_ps(oc + 32, o4); _mm256_storeu_ps(oc + 40, o5);
        _mm256_storeu_ps(oc + 48, o6); _mm256_storeu_ps(oc + 56, o7);
    }
    for (; c < hd; c += 8) {   /* hd not a multiple of 64: the rest 8 outputs at a time */
        __m256 o = _mm256_setzero_ps();
        int vslot = lo % slots;
        for (int jj = 0; jj < nk; jj++) {
            const float *v = V + (size_t)vslot * kv_dim + c;
            vslot = vslot + 1 == slots ? 0 : vslot + 1;
            o = _mm256_fmadd_ps(_mm256_set1_ps(sc[jj] * inv), _mm256_loadu_ps(v), o);
        }
        _mm256_storeu_ps(out + c, o);
    }
}
#endif

static void attend_head(const float *qh, const float *K, const float *V, int kv_dim, int slots,
                        int lo, int pos, int hd, float scale, float *sc, float *out) {
#if defined(__x86_64__) || defined(__i386__)
    if (hd % 8 == 0 && rq_kernel_path() != RQ_PATH_SCALAR) {
        attend_head_256(qh, K, V, kv_dim, slots, lo, pos, hd, scale, sc, out);
        return;
    }
#endif
    attend_head_ref(qh, K, V, kv_dim, slots, lo, pos, hd, scale, sc, out);
}

#if defined(__x86_64__) || defined(__i386__)
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

static void gated_act(float *g, const float *up, size_t n, int gelu) {
#if defined(__x86_64__) || defined(__i386__)
    if (rq_kernel_path() != RQ_PATH_SCALAR) { gated_act_256(g, up, n, gelu); return; }
#endif
    gated_act_ref(g, up, n, gelu);
}

/* Self-attention for n tokens at positions pos0..: writes K,V into the cache, attends, and
 * leaves the projected output (before the residual add) in m->xb. */
static void attention(rq_model *m, int il, int n, int pos0) {
    const rq_config *c = &m->cfg;
    const rq_layer_weights *L = &m->w.layers[il];
    const int d = c->n_embd, hd = c->head_dim, q_dim = m->q_dim, kv_dim = m->kv_dim;
    const int local = layer_is_local(c, il);
    const float *rope_cs = m->rope_cs[local];

    FOR_TOKENS
    for (int t = 0; t < n; t++)
        rmsnorm(m->xb + (size_t)t * d, m->x + (size_t)t * d, f32_data(&L->attn_norm), d, c->norm_eps);
    quantize_rows(m, m->xb, n, d, d);
    const rq_matmul_op qkv[3] = {{L->wq.type, L->wq.data, L->wq.rows, m->q, q_dim, L->wq.r16},
                                 {L->wk.type, L->wk.data, L->wk.rows, m->k, kv_dim, L->wk.r16},
                                 {L->wv.type, L->wv.data, L->wv.rows, m->v, kv_dim, L->wv.r16}};
    rq_matmul_multi(qkv, 3, d, m->acts, n, m->n_threads);
    add_bias(m->q, &L->bq, n, q_dim);
    add_bias(m->k, &L->bk, n, kv_dim);
    add_bias(m->v, &L->bv, n, kv_dim);

    const int slots = m->kv.slots[il];
    FOR_TOKENS
    for (int t = 0; t < n; t++) {
        float *qt = m->q + (size_t)t * q_dim, *kt = m->k + (size_t)t * kv_dim;
        if (L->attn_q_norm.data)
            for (int h = 0; h < c->n_head; h++)
                rmsnorm(qt + h * hd, qt + h * hd, f32_data(&L->attn_q_norm), hd, c->norm_eps);
        if (L->attn_k_norm.data)
            for (int h = 0; h < c->n_head_kv; h++)
                rmsnorm(kt + h * hd, kt + h * hd, f32_data(&L->attn_k_norm), hd, c->norm_eps);
        rope(qt, c->n_head, hd, rope_cs + (size_t)t * hd, c->rope_neox);
        rope(kt, c->n_head_kv, hd, rope_cs + (size_t)t * hd, c->rope_neox);
        size_t slot = (size_t)((pos0 + t) % slots);
        memcpy(m->kv.k[il] + slot * kv_dim, kt, sizeof(float) * kv_dim);
        memcpy(m->kv.v[il] + slot * kv_dim, m->v + (size_t)t * kv_dim, sizeof(float) * kv_dim);
    }

    const int group = c->n_head / c->n_head_kv;
    const float *Kc = m->kv.k[il], *Vc = m->kv.v[il];
    #pragma omp parallel for collapse(2) schedule(dynamic) num_threads(m->n_threads) if (n > 1 || pos0 >= 32)
    for (int t = 0; t < n; t++) {
        for (int h = 0; h < c->n_head; h++) {
            const int pos = pos0 + t;
            const int lo = local && pos - c->sliding_window + 1 > 0 ? pos - c->sliding_window + 1 : 0;
            const float *qh = m->q + (size_t)t * q_dim + h * hd;
            const int kvh = (h / group) * hd;
            float *sc = m->scores + (size_t)omp_get_thread_num() * (m->kv.capacity + 1);
            attend_head(qh, Kc + kvh, Vc + kvh, kv_dim, slots, lo, pos, hd, c->attn_scale, sc,
                        m->att_out + (size_t)t * q_dim + h * hd);
        }
    }

    quantize_rows(m, m->att_out, n, q_dim, q_dim);
    matmul(m, &L->wo, n, m->xb, d);
    if (L->post_attn_norm.data) {
        FOR_TOKENS
        for (int t = 0; t < n; t++)
            rmsnorm(m->xb + (size_t)t * d, m->xb + (size_t)t * d, f32_data(&L->post_attn_norm), d, c->norm_eps);
    }
}

/* Gated feed-forward: down(act(gate x) * up x), output (before the residual add) in m->xb. */
static void feed_forward(rq_model *m, int il, int n) {
    const rq_config *c = &m->cfg;
    const rq_layer_weights *L = &m->w.layers[il];
    const int d = c->n_embd, ff = c->n_ff;

    FOR_TOKENS
    for (int t = 0; t < n; t++)
        rmsnorm(m->xb + (size_t)t * d, m->x + (size_t)t * d, f32_data(&L->ffn_norm), d, c->norm_eps);
    quantize_rows(m, m->xb, n, d, d);
    const rq_matmul_op gate_up[2] = {{L->ffn_gate.type, L->ffn_gate.data, L->ffn_gate.rows, m->hb, ff, L->ffn_gate.r16},
                                     {L->ffn_up.type, L->ffn_up.data, L->ffn_up.rows, m->hb2, ff, L->ffn_up.r16}};
    rq_matmul_multi(gate_up, 2, d, m->acts, n, m->n_threads);
    FOR_TOKENS
    for (int t = 0; t < n; t++) gated_act(m->hb + (size_t)t * ff, m->hb2 + (size_t)t * ff, (size_t)ff, c->ffn_gelu);
    /* The gated activations carry outliers that make per-block int8 too coarse for the other
     * values of their block (SmolLM2 loses top-1 agreement here). Since the product is linear,
     * quantize x as int8 plus an int8 rounding residual and run both as 2n "tokens" of one
     * matmul: the weights are still read once, the input gets ~15 bits. */
    quantize_rows(m, m->hb, n, ff, ff);
    if (!c->precise_ffn_down) {
        matmul(m, &L->ffn_down, n, m->xb, d);
    } else {
    FOR_TOKENS
    for (int t = 0; t < n; t++) {
        const rq_act *a = &m->acts[t];
        float *r = m->hb2 + (size_t)t * ff;  /* hb2 is free again: reuse for the residual */
        const float *x = m->hb + (size_t)t * ff;
        for (int i = 0; i < ff; i++) r[i] = x[i] - a->d[i / 32] * (float)a->qs[i];
        m->acts[n + t].n = ff;
        rq_quantize_act(r, ff, &m->acts[n + t]);
    }
    matmul(m, &L->ffn_down, 2 * n, m->down2, d);
    FOR_TOKENS
    for (int t = 0; t < n; t++) {
        float *o = m->xb + (size_t)t * d;
        const float *hi = m->down2 + (size_t)t * d, *lo = m->down2 + (size_t)(n + t) * d;
        for (int i = 0; i < d; i++) o[i] = hi[i] + lo[i];
    }
    }
    if (L->post_ffw_norm.data) {
        FOR_TOKENS
        for (int t = 0; t < n; t++)
            rmsnorm(m->xb + (size_t)t * d, m->xb + (size_t)t * d, f32_data(&L->post_ffw_norm), d, c->norm_eps);
    }
}

/* Final norm and output projection for tokens [t0, n) of the pass. */
static void logits_for(rq_model *m, int t0, int n, float *logits) {
    const rq_config *c = &m->cfg;
    const int d = c->n_embd;
    for (int t = t0; t < n; t++)
        rmsnorm(m->xb + (size_t)(t - t0) * d, m->x + (size_t)t * d, f32_data(&m->w.output_norm), d, c->norm_eps);
    quantize_rows(m, m->xb, n - t0, d, d);
    matmul(m, &m->w.output, n - t0, logits, c->n_vocab);
}

/* One pass of n <= max_ubatch tokens. */
static void forward_pass(rq_model *m, const int32_t *tokens, int n, int pos0, float *logits, int all_logits) {
    const rq_config *c = &m->cfg;
    const int d = c->n_embd;

    embed(m, tokens, n);
    record(m, 0, n);
    const int hd = c->head_dim, n_bases = c->sliding_window > 0 ? 2 : 1;
    FOR_TOKENS
    for (int t = 0; t < n; t++)
        for (int b = 0; b < n_bases; b++) rope_angles(m->rope_cs[b] + (size_t)t * hd, m->rope_freq[b], hd / 2, pos0 + t);
    for (int il = 0; il < c->n_layer; il++) {
        attention(m, il, n, pos0);
        FOR_TOKENS
        for (int t = 0; t < n; t++) add_inplace(m->x + (size_t)t * d, m->xb + (size_t)t * d, d);
        feed_forward(m, il, n);
        FOR_TOKENS
        for (int t = 0; t < n; t++) add_inplace(m->x + (size_t)t * d, m->xb + (size_t)t * d, d);
        record(m, il + 1, n);
    }
    if (logits) logits_for(m, all_logits ? 0 : n - 1, n, logits);
}

int rq_forward(rq_model *m, const int32_t *tokens, int n, int pos0, float *logits, int all_logits) {
    if (n <= 0 || pos0 < 0 || pos0 + n > m->kv.capacity) return -1;
    const int U = m->cfg.max_ubatch;
    for (int start = 0; start < n; start += U) {
        int len = n - start < U ? n - start : U;
        int last = start + len == n;
        float *out = NULL;
        if (all_logits) out = logits + (size_t)start * m->cfg.n_vocab;
        else if (last) out = logits;
        forward_pass(m, tokens + start, len, pos0 + start, out, all_logits);
    }
    return 0;
}
