/* Quantized weight formats, int8 activations, dot products and matmuls.
 * See quants.h for the contract. Layout facts: ggml's ggml-common.h / ggml-quants.c.
 *
 * Integer model used by every path (scalar reference and SIMD alike): for activation block b
 * (32 values, scale d_b, int8 q) and the matching 32 weights with integer values w
 * (offset removed), the block contributes   scale_w * d_b * sum(w * q)   plus, for types
 * with mins,   - min_w * d_b * S_b   where S_b = sum16[2b] + sum16[2b+1].
 */
#include "quants.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ------------------------------------------------------------------------------------------ */
/* Block layouts (ggml)                                                                        */

#define QK 32
#define QK_K 256

typedef struct { uint16_t d; uint8_t qs[16]; } blk_q4_0;
typedef struct { uint16_t d, m; uint8_t qs[16]; } blk_q4_1;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_0;
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_1;
typedef struct { uint16_t d; int8_t qs[32]; } blk_q8_0;
typedef struct { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; } blk_q2_K;
typedef struct { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; } blk_q3_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } blk_q4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } blk_q5_K;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } blk_q6_K;

_Static_assert(sizeof(blk_q4_0) == 18, "q4_0");
_Static_assert(sizeof(blk_q4_1) == 20, "q4_1");
_Static_assert(sizeof(blk_q5_0) == 22, "q5_0");
_Static_assert(sizeof(blk_q5_1) == 24, "q5_1");
_Static_assert(sizeof(blk_q8_0) == 34, "q8_0");
_Static_assert(sizeof(blk_q2_K) == 84, "q2_K");
_Static_assert(sizeof(blk_q3_K) == 110, "q3_K");
_Static_assert(sizeof(blk_q4_K) == 144, "q4_K");
_Static_assert(sizeof(blk_q5_K) == 176, "q5_K");
_Static_assert(sizeof(blk_q6_K) == 210, "q6_K");

/* ------------------------------------------------------------------------------------------ */
/* Type traits: what every part of this file asks about a type, in one table                   */

typedef struct {
    int block_elems, block_bytes;
    int qs_at;     /* legacy types: where the quants start in a block */
    int offset;    /* the kernels' unsigned weight u = value + offset (0: unsigned already) */
    int has_min;   /* the block subtracts min * (sum of activations) */
    int is_float;  /* F32/F16/BF16: multiplied with the f32 activations */
    int packed;    /* has the interleaved kernels: AVX2 slot-packed rows, AVX-512 v16, the R16 layout */
    int pf8;       /* has the AVX2 8-token prefill kernels */
} type_traits;

static const type_traits TRAITS[RQ_BF16 + 1] = {
    /*           elems, bytes, qs_at, offset, min, float, packed, pf8 */
    [RQ_F32] = {1, 4, 0, 0, 0, 1, 0, 0},
    [RQ_F16] = {1, 2, 0, 0, 0, 1, 0, 0},
    [RQ_BF16] = {1, 2, 0, 0, 0, 1, 0, 0},
    [RQ_Q4_0] = {QK, sizeof(blk_q4_0), 2, 8, 0, 0, 1, 1},
    [RQ_Q4_1] = {QK, sizeof(blk_q4_1), 4, 0, 1, 0, 1, 1},
    [RQ_Q5_0] = {QK, sizeof(blk_q5_0), 6, 16, 0, 0, 1, 1},
    [RQ_Q5_1] = {QK, sizeof(blk_q5_1), 8, 0, 1, 0, 1, 1},
    [RQ_Q8_0] = {QK, sizeof(blk_q8_0), 2, 128, 0, 0, 1, 0},
    [RQ_Q2_K] = {QK_K, sizeof(blk_q2_K), 0, 0, 1, 0, 0, 0},
    [RQ_Q3_K] = {QK_K, sizeof(blk_q3_K), 0, 4, 0, 0, 0, 0},
    [RQ_Q4_K] = {QK_K, sizeof(blk_q4_K), 0, 0, 1, 0, 1, 1},
    [RQ_Q5_K] = {QK_K, sizeof(blk_q5_K), 0, 0, 1, 0, 0, 0},
    [RQ_Q6_K] = {QK_K, sizeof(blk_q6_K), 0, 32, 0, 0, 1, 1},
};

/* The traits of t; an all-zero row (block_elems 0) for an unknown type. */
static inline const type_traits *traits(int t) {
    static const type_traits none = {0};
    return t >= 0 && t <= RQ_BF16 && TRAITS[t].block_elems ? &TRAITS[t] : &none;
}

/* ------------------------------------------------------------------------------------------ */
/* f16 / bf16                                                                                  */

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float rq_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    if (exp == 0x1f) return u2f(sign | 0x7f800000u | (man << 13));     /* inf / nan */
    if (exp == 0) {
        if (man == 0) return u2f(sign);                                  /* +-0 */
        float v = (float)man * (1.0f / 16777216.0f);                     /* subnormal: man * 2^-24 */
        return (sign ? -v : v);
    }
    return u2f(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t rq_f32_to_f16(float f) {
    uint32_t x = f2u(f);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);            /* rounds to >= 65520: inf */
    if (ax < 0x38800000u) {                                              /* below 2^-14: subnormal */
        /* value * 2^24, rounded to nearest even */
        float v = u2f(ax) * 16777216.0f;
        float r = nearbyintf(v);                                         /* default mode: RNE */
        return (uint16_t)(sign | (uint32_t)r);
    }
    uint32_t e = (ax >> 23) - 112;
    uint32_t m = ax & 0x7fffff;
    uint32_t h = (e << 10) | (m >> 13);
    uint32_t rem = m & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

float rq_bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

#define F16(x) rq_f16_to_f32(x)

static inline uint32_t load_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* K-type 6-bit (scale, min) pairs packed in 12 bytes (Q4_K, Q5_K). */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q3_K: 16 six-bit scales packed in 12 bytes -> signed values (already minus 32). */
static inline void q3k_scales(const uint8_t *s, int8_t out[16]) {
    for (int j = 0; j < 16; j++) {
        int lo = (j < 8) ? (s[j] & 0xF) : (s[j - 8] >> 4);
        int hi = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
        out[j] = (int8_t)((lo | (hi << 4)) - 32);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Type table                                                                                  */

int rq_type_supported(int t) { return traits(t)->block_elems > 0; }
int rq_block_elems(int t) { return traits(t)->block_elems; }
int rq_block_bytes(int t) { return traits(t)->block_bytes; }

size_t rq_row_bytes(int t, int n) {
    int be = rq_block_elems(t);
    if (be <= 0) return 0;
    return (size_t)(n / be) * (size_t)rq_block_bytes(t);
}

/* ------------------------------------------------------------------------------------------ */
/* Dequantization (ground truth)                                                               */

void rq_dequant_row(int t, const void *row, float *y, int n) {
    switch (t) {
    case RQ_F32:
        memcpy(y, row, (size_t)n * 4);
        return;
    case RQ_F16: {
        const uint16_t *h = row;
        for (int i = 0; i < n; i++) y[i] = F16(h[i]);
        return;
    }
    case RQ_BF16: {
        const uint16_t *h = row;
        for (int i = 0; i < n; i++) y[i] = rq_bf16_to_f32(h[i]);
        return;
    }
    case RQ_Q4_0: {
        const blk_q4_0 *b = row;
        for (int i = 0; i < n / QK; i++, y += QK) {
            float d = F16(b[i].d);
            for (int j = 0; j < 16; j++) {
                y[j] = (float)((b[i].qs[j] & 0xF) - 8) * d;
                y[j + 16] = (float)((b[i].qs[j] >> 4) - 8) * d;
            }
        }
        return;
    }
    case RQ_Q4_1: {
        const blk_q4_1 *b = row;
        for (int i = 0; i < n / QK; i++, y += QK) {
            float d = F16(b[i].d), m = F16(b[i].m);
            for (int j = 0; j < 16; j++) {
                y[j] = (float)(b[i].qs[j] & 0xF) * d + m;
                y[j + 16] = (float)(b[i].qs[j] >> 4) * d + m;
            }
        }
        return;
    }
    case RQ_Q5_0: {
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
        return;
    }
    case RQ_Q5_1: {
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
        return;
    }
    case RQ_Q8_0: {
        const blk_q8_0 *b = row;
        for (int i = 0; i < n / QK; i++, y += QK) {
            float d = F16(b[i].d);
            for (int j = 0; j < 32; j++) y[j] = (float)b[i].qs[j] * d;
        }
        return;
    }
    case RQ_Q2_K: {
        const blk_q2_K *b = row;
        for (int i = 0; i < n / QK_K; i++) {
            float d = F16(b[i].d), dmin = F16(b[i].dmin);
            const uint8_t *q = b[i].qs;
            int is = 0;
            for (int h = 0; h < 2; h++, q += 32) {
                for (int sh = 0; sh < 8; sh += 2) {
                    for (int half = 0; half < 2; half++) {
                        int sc = b[i].scales[is++];
                        float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
                        for (int l = 0; l < 16; l++) *y++ = dl * (float)((q[l + 16 * half] >> sh) & 3) - ml;
                    }
                }
            }
        }
        return;
    }
    case RQ_Q3_K: {
        const blk_q3_K *b = row;
        for (int i = 0; i < n / QK_K; i++) {
            float d = F16(b[i].d);
            int8_t sc[16];
            q3k_scales(b[i].scales, sc);
            const uint8_t *q = b[i].qs;
            int is = 0, m = 1;
            for (int h = 0; h < 2; h++, q += 32) {
                for (int sh = 0; sh < 8; sh += 2, m <<= 1) {
                    for (int half = 0; half < 2; half++) {
                        float dl = d * (float)sc[is++];
                        for (int l = 0; l < 16; l++) {
                            int k = l + 16 * half;
                            int v = ((q[k] >> sh) & 3) - ((b[i].hmask[k] & m) ? 0 : 4);
                            *y++ = dl * (float)v;
                        }
                    }
                }
            }
        }
        return;
    }
    case RQ_Q4_K: {
        const blk_q4_K *b = row;
        for (int i = 0; i < n / QK_K; i++) {
            float d = F16(b[i].d), dmin = F16(b[i].dmin);
            const uint8_t *q = b[i].qs;
            for (int c = 0; c < 4; c++, q += 32) {
                int sc, m;
                scale_min_k4(2 * c, b[i].scales, &sc, &m);
                float d1 = d * (float)sc, m1 = dmin * (float)m;
                scale_min_k4(2 * c + 1, b[i].scales, &sc, &m);
                float d2 = d * (float)sc, m2 = dmin * (float)m;
                for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0xF) - m1;
                for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
            }
        }
        return;
    }
    case RQ_Q5_K: {
        const blk_q5_K *b = row;
        for (int i = 0; i < n / QK_K; i++) {
            float d = F16(b[i].d), dmin = F16(b[i].dmin);
            const uint8_t *q = b[i].qs;
            for (int c = 0; c < 4; c++, q += 32) {
                int sc, m;
                scale_min_k4(2 * c, b[i].scales, &sc, &m);
                float d1 = d * (float)sc, m1 = dmin * (float)m;
                scale_min_k4(2 * c + 1, b[i].scales, &sc, &m);
                float d2 = d * (float)sc, m2 = dmin * (float)m;
                for (int l = 0; l < 32; l++)
                    *y++ = d1 * (float)((q[l] & 0xF) | (((b[i].qh[l] >> (2 * c)) & 1) << 4)) - m1;
                for (int l = 0; l < 32; l++)
                    *y++ = d2 * (float)((q[l] >> 4) | (((b[i].qh[l] >> (2 * c + 1)) & 1) << 4)) - m2;
            }
        }
        return;
    }
    case RQ_Q6_K: {
        const blk_q6_K *b = row;
        for (int i = 0; i < n / QK_K; i++) {
            float d = F16(b[i].d);
            const uint8_t *ql = b[i].ql, *qh = b[i].qh;
            const int8_t *sc = b[i].scales;
            for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, y += 128) {
                for (int l = 0; l < 32; l++) {
                    int is = l / 16;
                    int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[l] = d * (float)sc[is + 0] * (float)q1;
                    y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                    y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                    y[l + 96] = d * (float)sc[is + 6] * (float)q4;
                }
            }
        }
        return;
    }
    default:
        for (int i = 0; i < n; i++) y[i] = NAN;
        return;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Activation quantization                                                                     */

static void quantize_act_ref(const float *x, int n, rq_act *a) {
    a->n = n;
    a->f = x;
    for (int b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            float v = fabsf(xb[j]);
            amax = v > amax ? v : amax;
        }
        float d = amax / 127.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        int use_div = isinf(id);   /* subnormal d: 1/d overflows, divide instead */
        a->d[b] = d;
        int8_t *q = a->qs + 32 * b;
        int s0 = 0, s1 = 0;
        for (int j = 0; j < 32; j++) {
            float f = use_div ? xb[j] / d : xb[j] * id;
            f = f > -127.0f ? f : -127.0f;   /* same NaN handling as maxps/minps */
            f = f < 127.0f ? f : 127.0f;
            int v = (int)roundf(f);
            q[j] = (int8_t)v;
            if (j < 16) s0 += v; else s1 += v;
        }
        a->sum16[2 * b] = s0;
        a->sum16[2 * b + 1] = s1;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Scalar reference dot products                                                               */

static inline int dot32_u(const uint8_t *w, const int8_t *q) {
    int s = 0;
    for (int j = 0; j < 32; j++) s += (int)w[j] * (int)q[j];
    return s;
}
static inline int dot16_s(const int8_t *w, const int8_t *q) {
    int s = 0;
    for (int j = 0; j < 16; j++) s += (int)w[j] * (int)q[j];
    return s;
}

static float dot_f32_ref(int n, const void *row, const rq_act *x) {
    const float *w = row;
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += w[i] * x->f[i];
    return s;
}
static float dot_f16_ref(int n, const void *row, const rq_act *x) {
    const uint16_t *w = row;
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += F16(w[i]) * x->f[i];
    return s;
}
static float dot_bf16_ref(int n, const void *row, const rq_act *x) {
    const uint16_t *w = row;
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += rq_bf16_to_f32(w[i]) * x->f[i];
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

/* K types with 16-element scale groups: unpack 256 signed values (offset removed) + 16 int scales. */
static float dot_q2_K_ref(int n, const void *row, const rq_act *x) {
    const blk_q2_K *b = row;
    float s = 0.0f;
    uint8_t u[256];
    for (int i = 0; i < n / QK_K; i++) {
        const uint8_t *q = b[i].qs;
        uint8_t *up = u;
        for (int h = 0; h < 2; h++, q += 32)
            for (int sh = 0; sh < 8; sh += 2)
                for (int l = 0; l < 32; l++) *up++ = (q[l] >> sh) & 3;
        float d = F16(b[i].d), dmin = F16(b[i].dmin);
        for (int j = 0; j < 8; j++) {
            int blk = i * 8 + j;
            const int8_t *xq = x->qs + 32 * blk;
            int sc0 = b[i].scales[2 * j], sc1 = b[i].scales[2 * j + 1];
            int i0 = 0, i1 = 0;
            for (int l = 0; l < 16; l++) { i0 += u[32 * j + l] * xq[l]; i1 += u[32 * j + 16 + l] * xq[16 + l]; }
            int isc = (sc0 & 0xF) * i0 + (sc1 & 0xF) * i1;
            int imn = (sc0 >> 4) * x->sum16[2 * blk] + (sc1 >> 4) * x->sum16[2 * blk + 1];
            s += x->d[blk] * (d * (float)isc - dmin * (float)imn);
        }
    }
    return s;
}
static float dot_q3_K_ref(int n, const void *row, const rq_act *x) {
    const blk_q3_K *b = row;
    float s = 0.0f;
    uint8_t u[256];
    for (int i = 0; i < n / QK_K; i++) {
        const uint8_t *q = b[i].qs;
        uint8_t *up = u;
        int m = 1;
        for (int h = 0; h < 2; h++, q += 32)
            for (int sh = 0; sh < 8; sh += 2, m <<= 1)
                for (int l = 0; l < 32; l++) *up++ = (uint8_t)(((q[l] >> sh) & 3) | ((b[i].hmask[l] & m) ? 4 : 0));
        int8_t sc[16];
        q3k_scales(b[i].scales, sc);
        float d = F16(b[i].d);
        for (int j = 0; j < 8; j++) {
            int blk = i * 8 + j;
            const int8_t *xq = x->qs + 32 * blk;
            int i0 = 0, i1 = 0;
            for (int l = 0; l < 16; l++) { i0 += u[32 * j + l] * xq[l]; i1 += u[32 * j + 16 + l] * xq[16 + l]; }
            /* value = u - 4 */
            i0 -= 4 * x->sum16[2 * blk];
            i1 -= 4 * x->sum16[2 * blk + 1];
            s += d * x->d[blk] * (float)(sc[2 * j] * i0 + sc[2 * j + 1] * i1);
        }
    }
    return s;
}
static float dot_q6_K_ref(int n, const void *row, const rq_act *x) {
    const blk_q6_K *b = row;
    float s = 0.0f;
    uint8_t u[256];
    for (int i = 0; i < n / QK_K; i++) {
        const uint8_t *ql = b[i].ql, *qh = b[i].qh;
        for (int h = 0; h < 2; h++, ql += 64, qh += 32) {
            uint8_t *up = u + 128 * h;
            for (int l = 0; l < 32; l++) {
                up[l] = (uint8_t)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4));
                up[l + 32] = (uint8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
                up[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                up[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        }
        const int8_t *sc = b[i].scales;
        float d = F16(b[i].d);
        for (int j = 0; j < 8; j++) {
            int blk = i * 8 + j;
            const int8_t *xq = x->qs + 32 * blk;
            int i0 = 0, i1 = 0;
            for (int l = 0; l < 16; l++) { i0 += u[32 * j + l] * xq[l]; i1 += u[32 * j + 16 + l] * xq[16 + l]; }
            i0 -= 32 * x->sum16[2 * blk];
            i1 -= 32 * x->sum16[2 * blk + 1];
            s += d * x->d[blk] * (float)(sc[2 * j] * i0 + sc[2 * j + 1] * i1);
        }
    }
    return s;
}
/* K types with 32-element (scale, min) sub-blocks. */
static float dot_q4_K_ref(int n, const void *row, const rq_act *x) {
    const blk_q4_K *b = row;
    float s = 0.0f;
    uint8_t u[32];
    for (int i = 0; i < n / QK_K; i++) {
        float d = F16(b[i].d), dmin = F16(b[i].dmin);
        for (int j = 0; j < 8; j++) {
            const uint8_t *q = b[i].qs + 32 * (j / 2);
            for (int l = 0; l < 32; l++) u[l] = (j & 1) ? (q[l] >> 4) : (q[l] & 0xF);
            int sc, m;
            scale_min_k4(j, b[i].scales, &sc, &m);
            int blk = i * 8 + j;
            int S = x->sum16[2 * blk] + x->sum16[2 * blk + 1];
            int isum = dot32_u(u, x->qs + 32 * blk);
            s += x->d[blk] * (d * (float)(sc * isum) - dmin * (float)(m * S));
        }
    }
    return s;
}
static float dot_q5_K_ref(int n, const void *row, const rq_act *x) {
    const blk_q5_K *b = row;
    float s = 0.0f;
    uint8_t u[32];
    for (int i = 0; i < n / QK_K; i++) {
        float d = F16(b[i].d), dmin = F16(b[i].dmin);
        for (int j = 0; j < 8; j++) {
            const uint8_t *q = b[i].qs + 32 * (j / 2);
            for (int l = 0; l < 32; l++)
                u[l] = (uint8_t)(((j & 1) ? (q[l] >> 4) : (q[l] & 0xF)) | (((b[i].qh[l] >> j) & 1) << 4));
            int sc, m;
            scale_min_k4(j, b[i].scales, &sc, &m);
            int blk = i * 8 + j;
            int S = x->sum16[2 * blk] + x->sum16[2 * blk + 1];
            int isum = dot32_u(u, x->qs + 32 * blk);
            s += x->d[blk] * (d * (float)(sc * isum) - dmin * (float)(m * S));
        }
    }
    return s;
}

typedef float (*dot_fn)(int n, const void *row, const rq_act *x);

static dot_fn ref_dot(int t) {
    switch (t) {
    case RQ_F32: return dot_f32_ref;
    case RQ_F16: return dot_f16_ref;
    case RQ_BF16: return dot_bf16_ref;
    case RQ_Q4_0: return dot_q4_0_ref;
    case RQ_Q4_1: return dot_q4_1_ref;
    case RQ_Q5_0: return dot_q5_0_ref;
    case RQ_Q5_1: return dot_q5_1_ref;
    case RQ_Q8_0: return dot_q8_0_ref;
    case RQ_Q2_K: return dot_q2_K_ref;
    case RQ_Q3_K: return dot_q3_K_ref;
    case RQ_Q4_K: return dot_q4_K_ref;
    case RQ_Q5_K: return dot_q5_K_ref;
    case RQ_Q6_K: return dot_q6_K_ref;
    default: return NULL;
    }
}

float rq_vec_dot_ref(int t, int n, const void *row, const rq_act *x) {
    dot_fn f = ref_dot(t);
    return f ? f(n, row, x) : NAN;
}

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
 *          (Q4_0 8, Q5_0 16, Q8_0 128, Q6_K 32, Q3_K 4) exactly, in the integer domain
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

static inline int is_float_type(int t) { return traits(t)->is_float; }
static inline int type_offset(int t) { return traits(t)->offset; }
static inline int type_has_min(int t) { return traits(t)->has_min; }

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

#define AINL static inline __attribute__((always_inline))

/* Call IMPL(..., T) with T as a compile-time constant (1..TM). */
#define DISPATCH_T8(IMPL, ...)                                  \
    do {                                                        \
        switch (T) {                                            \
        case 1: IMPL(__VA_ARGS__, 1); break;                    \
        case 2: IMPL(__VA_ARGS__, 2); break;                    \
        case 3: IMPL(__VA_ARGS__, 3); break;                    \
        case 4: IMPL(__VA_ARGS__, 4); break;                    \
        case 5: IMPL(__VA_ARGS__, 5); break;                    \
        case 6: IMPL(__VA_ARGS__, 6); break;                    \
        case 7: IMPL(__VA_ARGS__, 7); break;                    \
        default: IMPL(__VA_ARGS__, 8); break;                   \
        }                                                       \
    } while (0)
#define DISPATCH_T4(IMPL, ...)                                  \
    do {                                                        \
        switch (T) {                                            \
        case 1: IMPL(__VA_ARGS__, 1); break;                    \
        case 2: IMPL(__VA_ARGS__, 2); break;                    \
        case 3: IMPL(__VA_ARGS__, 3); break;                    \
        default: IMPL(__VA_ARGS__, 4); break;                   \
        }                                                       \
    } while (0)

static inline uint16_t load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

static inline int legacy_bs(int t) { return traits(t)->block_bytes; }
static inline int legacy_qoff(int t) { return traits(t)->qs_at; }   /* offset of qs in the block */

/* Q4_K/Q5_K 12-byte scales -> 8 scales (u0,u1) and 8 mins (u2,u3) as bytes, in registers
 * (building the vector from an array in memory would stall on store forwarding). */
static inline void k4_unpack(const uint8_t *s, uint32_t *o0, uint32_t *o1, uint32_t *o2, uint32_t *o3) {
    uint32_t a0 = load_u32(s), a1 = load_u32(s + 4), a2 = load_u32(s + 8);
    *o0 = a0 & 0x3f3f3f3fu;
    *o1 = (a2 & 0x0f0f0f0fu) | (((a0 >> 6) & 0x03030303u) << 4);
    *o2 = a1 & 0x3f3f3f3fu;
    *o3 = ((a2 >> 4) & 0x0f0f0f0fu) | (((a1 >> 6) & 0x03030303u) << 4);
}

/* Q3_K 12-byte scales -> 16 six-bit scales as bytes (not yet minus 32). */
static inline void q3k_unpack(const uint8_t *s, uint32_t *o0, uint32_t *o1, uint32_t *o2, uint32_t *o3) {
    uint32_t a0 = load_u32(s), a1 = load_u32(s + 4), tmp = load_u32(s + 8);
    *o0 = (a0 & 0x0f0f0f0fu) | (((tmp >> 0) & 0x03030303u) << 4);
    *o1 = (a1 & 0x0f0f0f0fu) | (((tmp >> 2) & 0x03030303u) << 4);
    *o2 = ((a0 >> 4) & 0x0f0f0f0fu) | (((tmp >> 4) & 0x03030303u) << 4);
    *o3 = ((a1 >> 4) & 0x0f0f0f0fu) | (((tmp >> 6) & 0x03030303u) << 4);
}

/* ============================== R16: repacked weights, 16 interleaved rows ================= */
/*
 * The v16 group layout computed ahead of time and kept compact: the same bits as the GGUF rows,
 * rearranged so that one 64-byte load holds the same 4-element group of 16 rows. Kernels read it
 * directly (few tokens: decode, short passes) or expand a group once into the v16 layout (many
 * tokens); the integers and the float sequence are v16_pass's, so results equal the GGUF
 * layout's bit for bit on every path.
 * A group of 16 rows is a run of units, each one contiguous so that decode reads one stream:
 * a unit is one block (legacy types) or one super-block of 8 blocks (K types). Entries marked
 * [16] hold one value per row; j is the block within the unit:
 *   Q4_0, Q4_1, Q5_0, Q5_1: NIB [4 g][16] u32 | HB [16] u32 (Q5) | D [16] f16 | M [16] f16 (Q4_1, Q5_1)
 *   Q8_0:                   Q8 [2 h][4 g][16] u32 (the int8 values + 128, as in v16) | D [16] f16
 *   Q4_K: NIB [8 j][4 g][16] | KD [16] f16 | KDM [16] f16 | KSC [8 j][16] u8 | KMN [8 j][16] u8
 *   Q6_K: NIB [8 j][4 g][16] | HB [8 j][2 h][16] u32 | QD [16] f16 | QSC [16 sub][16] i8
 * NIB byte i = lo4(elem 4g+i) | lo4(elem 16+4g+i) << 4 (Q6_K: its low 4 bits); HB (Q5) bit
 * 8i + 4h + g = the 5th bit of elem 16h+4g+i; HB (Q6_K) bits 8i + 2g, +1 = the 2 high bits of
 * elem 16h+4g+i: one shift and one mask put them under the nibbles.
 */
#define R16_V 2   /* layout version; bump when the layout above changes */

static inline int r16_type(int t) { return traits(t)->packed; }

/* Where things are in a group: unit size, blocks per unit, offsets within a unit (0: absent). */
typedef struct {
    const uint8_t *g;
    size_t ub;
    int bpu;
    size_t nib, q8, hb, d, m, kd, kdm, ksc, kmn, qd, qsc;
} r16_ptrs;

static r16_ptrs r16_group_ptrs(int t, const uint8_t *g, int nb) {
    r16_ptrs p;
    memset(&p, 0, sizeof(p));
    (void)nb;
    p.g = g;
    p.bpu = 1;
    switch (t) {
    case RQ_Q4_0: p.nib = 0; p.d = 256; p.ub = 288; break;
    case RQ_Q4_1: p.nib = 0; p.d = 256; p.m = 288; p.ub = 320; break;
    case RQ_Q5_0: p.nib = 0; p.hb = 256; p.d = 320; p.ub = 352; break;
    case RQ_Q5_1: p.nib = 0; p.hb = 256; p.d = 320; p.m = 352; p.ub = 384; break;
    case RQ_Q8_0: p.q8 = 0; p.d = 512; p.ub = 544; break;
    case RQ_Q4_K: p.bpu = 8; p.nib = 0; p.kd = 2048; p.kdm = 2080; p.ksc = 2112; p.kmn = 2240; p.ub = 2368; break;
    case RQ_Q6_K: p.bpu = 8; p.nib = 0; p.hb = 2048; p.qd = 3072; p.qsc = 3104; p.ub = 3360; break;
    default: break;
    }
    return p;
}

static size_t r16_group_bytes_t(int t, int nb) {
    const r16_ptrs p = r16_group_ptrs(t, NULL, nb);
    return p.ub * (size_t)(nb / p.bpu);
}

/* Unit of block b, and b's index within it. */
static inline const uint8_t *r16_unit(const r16_ptrs *p, size_t b) { return p->g + (b / (size_t)p->bpu) * p->ub; }
static inline size_t r16_j(const r16_ptrs *p, size_t b) { return b % (size_t)p->bpu; }

/* --- repacking (scalar: runs once per model file, bound by reading the file) --- */

static void r16_w32(const uint8_t *at, int r, uint32_t v) { memcpy((uint8_t *)at + 4 * r, &v, 4); }
static void r16_w16(const uint8_t *at, int r, uint16_t v) { memcpy((uint8_t *)at + 2 * r, &v, 2); }

/* Row r (0..15) of a group: its blocks' bits and scales into the group's units. */
static void r16_repack_row(int t, const uint8_t *row, int nb, const r16_ptrs *p, int r) {
    if (t == RQ_Q4_0 || t == RQ_Q4_1 || t == RQ_Q5_0 || t == RQ_Q5_1) {
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
        return;
    }
    if (t == RQ_Q8_0) {
        for (int b = 0; b < nb; b++) {
            const uint8_t *A = row + (size_t)b * sizeof(blk_q8_0), *u = r16_unit(p, b);
            for (int j = 0; j < 8; j++) r16_w32(u + p->q8 + 64 * j, r, load_u32(A + 2 + 4 * j) ^ 0x80808080u);
            r16_w16(u + p->d, r, load_u16(A));
        }
        return;
    }
    uint8_t q[32];
    if (t == RQ_Q4_K) {
        for (int s = 0; s < nb / 8; s++) {
            const blk_q4_K *x = (const blk_q4_K *)row + s;
            const uint8_t *u = p->g + (size_t)s * p->ub;
            r16_w16(u + p->kd, r, x->d);
            r16_w16(u + p->kdm, r, x->dmin);
            for (int j = 0; j < 8; j++) {
                int sc, mn;
                scale_min_k4(j, x->scales, &sc, &mn);
                ((uint8_t *)u)[p->ksc + 16 * j + r] = (uint8_t)sc;
                ((uint8_t *)u)[p->kmn + 16 * j + r] = (uint8_t)mn;
                const uint8_t *qs = x->qs + 32 * (j / 2);
                for (int l = 0; l < 32; l++) q[l] = (j & 1) ? (qs[l] >> 4) : (qs[l] & 0xF);
                for (int g = 0; g < 4; g++) {
                    uint32_t v = 0;
                    for (int i = 0; i < 4; i++) v |= (uint32_t)(q[4 * g + i] | (q[16 + 4 * g + i] << 4)) << (8 * i);
                    r16_w32(u + p->nib + 64 * (4 * j + g), r, v);
                }
            }
        }
        return;
    }
    if (t == RQ_Q6_K) {
        for (int s = 0; s < nb / 8; s++) {
            const blk_q6_K *x = (const blk_q6_K *)row + s;
            const uint8_t *u = p->g + (size_t)s * p->ub;
            r16_w16(u + p->qd, r, x->d);
            for (int k = 0; k < 16; k++) ((int8_t *)u)[p->qsc + 16 * k + r] = x->scales[k];
            for (int hh = 0; hh < 2; hh++) {           /* 128-element halves of the super-block */
                const uint8_t *ql = x->ql + 64 * hh, *qh = x->qh + 32 * hh;
                for (int k = 0; k < 4; k++) {          /* 32-element groups: block j = 4hh + k of the unit */
                    for (int l = 0; l < 32; l++) {
                        int lo = k < 2 ? (ql[l + 32 * (k & 1)] & 0xF) : (ql[l + 32 * (k & 1)] >> 4);
                        q[l] = (uint8_t)(lo | (((qh[l] >> (2 * k)) & 3) << 4));
                    }
                    const int j = 4 * hh + k;
                    for (int g = 0; g < 4; g++) {
                        uint32_t v = 0;
                        for (int i = 0; i < 4; i++) v |= (uint32_t)((q[4 * g + i] & 0xF) | ((q[16 + 4 * g + i] & 0xF) << 4)) << (8 * i);
                        r16_w32(u + p->nib + 64 * (4 * j + g), r, v);
                    }
                    for (int h = 0; h < 2; h++) {
                        uint32_t v = 0;
                        for (int g = 0; g < 4; g++)
                            for (int i = 0; i < 4; i++) v |= (uint32_t)(q[16 * h + 4 * g + i] >> 4) << (8 * i + 2 * g);
                        r16_w32(u + p->hb + 64 * (2 * j + h), r, v);
                    }
                }
            }
        }
    }
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

#include "simd.h"   /* x86: <immintrin.h>, RQ_HAVE_X86, the A512 target; -DRQ_SIMDE_AVX512: SIMDe test build */
#ifdef RQ_HAVE_X86

/* ============================== AVX-512 ================================================== */
/* The AVX-512 path runs the AVX2 kernels except for prefill matmuls (v16_*, below the AVX2
 * section), which compute the same float sequence, so both paths give the same results. The
 * earlier AVX-512 kernels (2 blocks per vector, a float sequence of their own) lost to the AVX2
 * ones in prefill on every CPU measured, and in decode on Intel; removed. */

/* --- activation quantization (same results as quantize_act_ref, bit for bit) --- */

/* round half away from zero, like roundf: trunc(|v|) + (frac >= 0.5), sign restored */
A512 AINL __m512i round_away_512(__m512 v) {
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
    __m512 av = _mm512_abs_ps(v);
    __m512 t = _mm512_roundscale_ps(av, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(av, t), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    t = _mm512_mask_add_ps(t, up, t, _mm512_set1_ps(1.0f));
    __m512i r = _mm512_cvttps_epi32(t);
    __mmask16 neg = _mm512_cmplt_epi32_mask(_mm512_castps_si512(v), _mm512_setzero_si512());
    return _mm512_mask_sub_epi32(r, neg, _mm512_setzero_si512(), r);
}

A512 static void quantize_act_512(const float *x, int n, rq_act *a) {
    a->n = n;
    a->f = x;
    for (int b = 0; b < n / 32; b++) {
        __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        float d = amax / 127.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        a->d[b] = d;
        __m512 vid = _mm512_set1_ps(id), vd = _mm512_set1_ps(d);
        int use_div = isinf(id);
        __m512i q0 = round_away_512(use_div ? _mm512_div_ps(x0, vd) : _mm512_mul_ps(x0, vid));
        __m512i q1 = round_away_512(use_div ? _mm512_div_ps(x1, vd) : _mm512_mul_ps(x1, vid));
        a->sum16[2 * b] = _mm512_reduce_add_epi32(q0);
        a->sum16[2 * b + 1] = _mm512_reduce_add_epi32(q1);
        _mm_storeu_si128((__m128i *)(a->qs + 32 * b), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(a->qs + 32 * b + 16), _mm512_cvtepi32_epi8(q1));
    }
}

/* ============================== AVX2 ====================================================== */

#define A256 __attribute__((target("avx2,fma,f16c")))
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

#define NPAR256(T) 2  /* see NPAR512 */
#define ACC_DECL_256(T)                                                        \
    __m256 acc[2][TMAX2];                                                      \
    for (int t_ = 0; t_ < (T); t_++) acc[0][t_] = acc[1][t_] = _mm256_setzero_ps();

A256 AINL void finish_256(__m256 (*acc)[TMAX2], float *res, const int T) {
    for (int t = 0; t < T; t++)
        res[t] = hsum_256(NPAR256(T) == 2 ? _mm256_add_ps(acc[0][t], acc[1][t]) : acc[0][t]);
}

/* 32 bits -> 32 bytes, 0xFF where the bit is set (byte i <-> bit i) */
A256 AINL __m256i bits_to_bytes_256(uint32_t x) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                           0x0101010101010101LL, 0x0000000000000000LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

A256 AINL void legacy_group_256(const int t, const uint8_t *g, const int cnt, const tile *tv, size_t b,
                                const int T, __m256 (*acc)[TMAX2]) {
    const int bs = legacy_bs(t);
    const int P = NPAR256(T);
    const int offs = type_offset(t) != 0 && t != RQ_Q8_0;
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    const uint8_t *blk[4];
    for (int j = 0; j < 4; j++) blk[j] = j < cnt ? g + (size_t)j * bs : NULL;
    __m256 dm;
    if (type_has_min(t)) {
        __m128i h = _mm_set_epi32(cnt > 3 ? (int)load_u32(blk[3]) : 0, cnt > 2 ? (int)load_u32(blk[2]) : 0,
                                  cnt > 1 ? (int)load_u32(blk[1]) : 0, (int)load_u32(blk[0]));
        dm = _mm256_cvtph_ps(h); /* dA mA dB mB dC mC dD mD */
    } else {
        __m128i h = _mm_set_epi16(0, 0, 0, 0, cnt > 3 ? (short)load_u16(blk[3]) : 0, cnt > 2 ? (short)load_u16(blk[2]) : 0,
                                  cnt > 1 ? (short)load_u16(blk[1]) : 0, (short)load_u16(blk[0]));
        dm = _mm256_castps128_ps256(_mm_cvtph_ps(h));
    }
    for (int j = 0; j < 4; j++) {
        if (j >= cnt) break;
        const uint8_t *A = blk[j];
        const int pi = (P == 2) ? (j & 1) : 0;
        __m256 WD = _mm256_permutevar8x32_ps(dm, _mm256_set1_epi32(type_has_min(t) ? 2 * j : j));
        if (t == RQ_Q8_0) {
            /* signed x signed via |w| * sign(q, w): 128*127*2 fits vpmaddubsw; no offset needed */
            __m256i w = _mm256_loadu_si256((const __m256i *)(A + 2));
            __m256i aw = _mm256_sign_epi8(w, w);
            const int8_t *qb = tv->qs + 32 * (size_t)(b + j) * T;
            const float *tb = tv->td + 8 * (size_t)(b + j) * T;
            for (int k = 0; k < T; k++) {
                __m256i q = _mm256_loadu_si256((const __m256i *)(qb + 32 * k));
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(q, w)), _mm256_set1_epi16(1));
                __m256 s = _mm256_mul_ps(WD, _mm256_loadu_ps(tb + 8 * k));
                acc[pi][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[pi][k]);
            }
            continue;
        }
        __m128i x = _mm_loadu_si128((const __m128i *)(A + legacy_qoff(t)));
        __m256i U = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), m0f);
        if (t == RQ_Q5_0 || t == RQ_Q5_1) {
            __m256i hb = bits_to_bytes_256(load_u32(A + ((t == RQ_Q5_0) ? 2 : 4)));
            U = _mm256_or_si256(U, _mm256_and_si256(hb, _mm256_set1_epi8(16)));
        }
        blk_256(U, WD, tv, b + j, T, offs, acc[pi]);
    }
    if (type_has_min(t)) {
        __m256 MEXP = _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(1, 1, 3, 3, 5, 5, 7, 7));
        const float *db = tv->ds + (b >> 3) * (size_t)T * 16 + 2 * (b & 4);
        for (int k = 0; k < T; k++) acc[P - 1][k] = _mm256_fmadd_ps(MEXP, _mm256_loadu_ps(db + 16 * k), acc[P - 1][k]);
    }
}

A256 AINL void legacy_row_256(const int t, const uint8_t *row, int n, const tile *tv, float *res, const int T) {
    const int bs = legacy_bs(t);
    const size_t nb = (size_t)(n / QK);
    ACC_DECL_256(T);
    size_t b = 0;
    for (; b + 4 <= nb; b += 4) legacy_group_256(t, row + b * bs, 4, tv, b, T, acc);
    switch (nb - b) {   /* tail group, specialized on its size */
    case 1: legacy_group_256(t, row + b * bs, 1, tv, b, T, acc); break;
    case 2: legacy_group_256(t, row + b * bs, 2, tv, b, T, acc); break;
    case 3: legacy_group_256(t, row + b * bs, 3, tv, b, T, acc); break;
    default: break;
    }
    finish_256(acc, res, T);
}

/* 16 per-group mins (two vectors of 8) x DS of one superblock */
A256 AINL void kmin_256(__m256 m_lo, __m256 m_hi, const tile *tv, int i, const int T, __m256 *acc0, __m256 *acc1) {
    const float *db = tv->ds + (size_t)i * T * 16;
    for (int k = 0; k < T; k++) {
        acc0[k] = _mm256_fmadd_ps(m_lo, _mm256_loadu_ps(db + 16 * k), acc0[k]);
        acc1[k] = _mm256_fmadd_ps(m_hi, _mm256_loadu_ps(db + 16 * k + 8), acc1[k]);
    }
}

A256 AINL void q45k_row_256(const int t, const uint8_t *row, int n, const tile *tv, float *res, const int T) {
    const int nsb = n / QK_K;
    const int P = NPAR256(T);
    ACC_DECL_256(T);
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < nsb; i++) {
        const uint8_t *qs, *qh = NULL, *scales;
        uint16_t dh, dminh;
        if (t == RQ_Q4_K) {
            const blk_q4_K *x = (const blk_q4_K *)row + i;
            scales = x->scales; dh = x->d; dminh = x->dmin; qs = x->qs;
        } else {
            const blk_q5_K *x = (const blk_q5_K *)row + i;
            scales = x->scales; dh = x->d; dminh = x->dmin; qs = x->qs; qh = x->qh;
        }
        uint32_t u0, u1, u2, u3;
        k4_unpack(scales, &u0, &u1, &u2, &u3);
        __m128i v = _mm_set_epi32((int)u3, (int)u2, (int)u1, (int)u0);
        __m256 dsc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_set1_ps(_cvtsh_ss(dh)));
        __m256 dmn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))),
                                   _mm256_set1_ps(-_cvtsh_ss(dminh)));
        kmin_256(_mm256_permutevar8x32_ps(dmn, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)),
                 _mm256_permutevar8x32_ps(dmn, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)), tv, i, T, acc[0], acc[P - 1]);
        __m256i H = _mm256_setzero_si256();
        if (t == RQ_Q5_K) H = _mm256_loadu_si256((const __m256i *)qh);
        for (int c = 0; c < 4; c++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            for (int e = 0; e < 2; e++) {
                const int j = 2 * c + e;
                __m256i U = _mm256_and_si256(e ? _mm256_srli_epi16(x, 4) : x, m0f);
                if (t == RQ_Q5_K) {
                    const __m256i bit = _mm256_set1_epi8((char)(1 << j));
                    __m256i hb = _mm256_cmpeq_epi8(_mm256_and_si256(H, bit), bit);
                    U = _mm256_or_si256(U, _mm256_and_si256(hb, _mm256_set1_epi8(16)));
                }
                __m256 WD = _mm256_permutevar8x32_ps(dsc, _mm256_set1_epi32(j));
                blk_256(U, WD, tv, 8 * i + j, T, 0, acc[e & (P - 1)]);
            }
        }
    }
    finish_256(acc, res, T);
}

/* lanes 0-3 = v[g], lanes 4-7 = v[g+1] of a 16-float scale set held in two vectors */
A256 AINL __m256 pair4_256(__m256 lo, __m256 hi, int g) {
    __m256 src = g < 8 ? lo : hi;
    const int gg = g & 7;
    return _mm256_permutevar8x32_ps(src, _mm256_setr_epi32(gg, gg, gg, gg, gg + 1, gg + 1, gg + 1, gg + 1));
}

A256 AINL void q23k_row_256(const int t, const uint8_t *row, int n, const tile *tv, float *res, const int T) {
    const int nsb = n / QK_K;
    const int P = NPAR256(T);
    const int offs = (t == RQ_Q3_K);
    ACC_DECL_256(T);
    const __m256i m03 = _mm256_set1_epi8(3);
    for (int i = 0; i < nsb; i++) {
        const uint8_t *qs, *hm = NULL;
        __m256 wd_lo, wd_hi;
        if (t == RQ_Q3_K) {
            const blk_q3_K *x = (const blk_q3_K *)row + i;
            uint32_t a0, a1, a2, a3;
            q3k_unpack(x->scales, &a0, &a1, &a2, &a3);
            __m128i s8 = _mm_sub_epi8(_mm_set_epi32((int)a3, (int)a2, (int)a1, (int)a0), _mm_set1_epi8(32));
            __m256 d = _mm256_set1_ps(_cvtsh_ss(x->d));
            wd_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)), d);
            wd_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))), d);
            qs = x->qs;
            hm = x->hmask;
        } else {
            const blk_q2_K *x = (const blk_q2_K *)row + i;
            __m128i s8 = _mm_loadu_si128((const __m128i *)x->scales);
            __m128i lo4 = _mm_and_si128(s8, _mm_set1_epi8(15));
            __m128i hi4 = _mm_and_si128(_mm_srli_epi16(s8, 4), _mm_set1_epi8(15));
            __m256 d = _mm256_set1_ps(_cvtsh_ss(x->d)), dm = _mm256_set1_ps(-_cvtsh_ss(x->dmin));
            wd_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo4)), d);
            wd_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo4, 8))), d);
            kmin_256(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi4)), dm),
                     _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi4, 8))), dm), tv, i, T, acc[0], acc[P - 1]);
            qs = x->qs;
        }
        __m256i HM = _mm256_setzero_si256();
        if (t == RQ_Q3_K) HM = _mm256_loadu_si256((const __m256i *)hm);
        for (int h = 0; h < 2; h++) {
            __m256i Q = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
            for (int k = 0; k < 4; k++) {
                __m256i U = _mm256_and_si256(_mm256_srli_epi16(Q, 2 * k), m03);
                if (t == RQ_Q3_K) {
                    const __m256i bit = _mm256_set1_epi8((char)(1 << (4 * h + k)));
                    __m256i hb = _mm256_cmpeq_epi8(_mm256_and_si256(HM, bit), bit);
                    U = _mm256_or_si256(U, _mm256_and_si256(hb, _mm256_set1_epi8(4)));
                }
                blk_256(U, pair4_256(wd_lo, wd_hi, 8 * h + 2 * k), tv, 8 * i + 4 * h + k, T, offs, acc[k & (P - 1)]);
            }
        }
    }
    finish_256(acc, res, T);
}

A256 AINL __m256 fload_256(const int t, const uint8_t *row, int i) {
    if (t == RQ_F32) return _mm256_loadu_ps((const float *)row + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
    if (t == RQ_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

A256 AINL float fscalar(const int t, const uint8_t *row, int i) {
    if (t == RQ_F32) return ((const float *)row)[i];
    uint16_t h = ((const uint16_t *)row)[i];
    return t == RQ_F16 ? _cvtsh_ss(h) : rq_bf16_to_f32(h);
}

A256 AINL void float_row_256(const int t, const uint8_t *row, int n, const tile *tv, float *res, const int T) {
    __m256 acc[2][TMAX2];
    for (int k = 0; k < T; k++) acc[0][k] = acc[1][k] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 w0 = fload_256(t, row, i), w1 = fload_256(t, row, i + 8);
        for (int k = 0; k < T; k++) {
            acc[0][k] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(tv->f[k] + i), acc[0][k]);
            acc[1][k] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(tv->f[k] + i + 8), acc[1][k]);
        }
    }
    for (; i + 8 <= n; i += 8) {
        __m256 w = fload_256(t, row, i);
        for (int k = 0; k < T; k++) acc[0][k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(tv->f[k] + i), acc[0][k]);
    }
    for (int k = 0; k < T; k++) {
        float s = hsum_256(_mm256_add_ps(acc[0][k], acc[1][k]));
        for (int j = i; j < n; j++) s += fscalar(t, row, j) * tv->f[k][j];
        res[k] = s;
    }
}


/* --- activation quantization (same results as quantize_act_ref, bit for bit) --- */

A256 AINL __m256i round_away_256(__m256 v) {
    v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 av = _mm256_and_ps(v, absmask);
    __m256 t = _mm256_round_ps(av, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256 up = _mm256_cmp_ps(_mm256_sub_ps(av, t), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    t = _mm256_add_ps(t, _mm256_and_ps(up, _mm256_set1_ps(1.0f)));
    return _mm256_sign_epi32(_mm256_cvttps_epi32(t), _mm256_or_si256(_mm256_castps_si256(v), _mm256_set1_epi32(1)));
}

A256 AINL int hsum_epi32_256(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

A256 static void quantize_act_256(const float *x, int n, rq_act *a) {
    a->n = n;
    a->f = x;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int b = 0; b < n / 32; b++) {
        __m256 v[4];
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(x + 32 * b + 8 * k);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                 _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float d = amax / 127.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        a->d[b] = d;
        __m256 vid = _mm256_set1_ps(id), vd = _mm256_set1_ps(d);
        int use_div = isinf(id);
        __m256i r[4];
        for (int k = 0; k < 4; k++) r[k] = round_away_256(use_div ? _mm256_div_ps(v[k], vd) : _mm256_mul_ps(v[k], vid));
        a->sum16[2 * b] = hsum_epi32_256(_mm256_add_epi32(r[0], r[1]));
        a->sum16[2 * b + 1] = hsum_epi32_256(_mm256_add_epi32(r[2], r[3]));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(a->qs + 32 * b), p);
    }
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
        if (t == RQ_Q8_0) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(A + 2));
            __m256i aw = _mm256_sign_epi8(w, w);
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
    const int mins = type_has_min(t);
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
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(as), _mm256_extractf128_ps(as, 1));
    if (mins) a = _mm_add_ps(a, _mm_add_ps(_mm256_castps256_ps128(accM), _mm256_extractf128_ps(accM, 1)));
    _mm_storeu_ps(res, a);
}

/* --- K types in the slot scheme: 32-element blocks, 4 token slots of one row; slots past the
 * tile's T are dead (zero) and skipped, so T = 1 costs one slot (same lanes, same results). */

/* U against the live tokens' block b, packed */
A256 AINL __m256i slot_pack_tok(__m256i U, const tile *tv, size_t b, const int T) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *qb = tv->qs + 32 * (size_t)T * b;
    __m256i p[4];
    for (int k = 0; k < 4; k++)
        p[k] = k < T ? _mm256_madd_epi16(_mm256_maddubs_epi16(U, _mm256_loadu_si256((const __m256i *)(qb + 32 * k))), ones)
                     : _mm256_setzero_si256();
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

/* Q4_K super-block x: its 8 group scales times d and its 8 group mins times -dmin, as floats. */
A256 AINL void q4k_scales_256(const blk_q4_K *x, __m256 *dsc, __m256 *dmn) {
    uint32_t u0, u1, u2, u3;
    k4_unpack(x->scales, &u0, &u1, &u2, &u3);
    __m128i v = _mm_set_epi32((int)u3, (int)u2, (int)u1, (int)u0);
    *dsc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_set1_ps(_cvtsh_ss(x->d)));
    *dmn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))),
                         _mm256_set1_ps(-_cvtsh_ss(x->dmin)));
}

/* Q6_K super-block x: its 16 scales times d, as floats [0, 8) in lo and [8, 16) in hi. */
A256 AINL void q6k_scales_256(const blk_q6_K *x, __m256 *lo, __m256 *hi) {
    __m128i s8 = _mm_loadu_si128((const __m128i *)x->scales);
    __m256 d = _mm256_set1_ps(_cvtsh_ss(x->d));
    *lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)), d);
    *hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))), d);
}

/* Q6_K super-block x, half h: the 32 unsigned 6-bit values (offset 32 not removed) of its
 * 32-element group k (0..3), from 4 low bits in ql and 2 high bits in qh. */
A256 AINL __m256i q6k_group_256(const blk_q6_K *x, int h, int k) {
    const __m256i m0f = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i L = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h + 32 * (k & 1)));
    const __m256i H = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
    const __m256i Lk = k < 2 ? _mm256_and_si256(L, m0f) : _mm256_and_si256(_mm256_srli_epi16(L, 4), m0f);
    const __m256i Hk = k == 0 ? _mm256_slli_epi16(H, 4) : k == 1 ? _mm256_slli_epi16(H, 2)
                     : k == 2 ? H : _mm256_srli_epi16(H, 2);
    return _mm256_or_si256(Lk, _mm256_and_si256(Hk, m30));
}

A256 AINL void q4k_slots_256(const uint8_t *row, int n, const tile *tv, float *res, const int T) {
    const int nsb = n / QK_K;
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, accM = _mm256_setzero_ps();
    for (int i = 0; i < nsb; i++) {
        const blk_q4_K *x = (const blk_q4_K *)row + i;
        __m256 dsc, dmn;
        q4k_scales_256(x, &dsc, &dmn);
        for (int c = 0; c < 4; c++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * c));
            for (int e = 0; e < 2; e++) {
                const int j = 2 * c + e;
                const size_t b = 8 * (size_t)i + j;
                __m256i U = _mm256_and_si256(e ? _mm256_srli_epi16(xq, 4) : xq, m0f);
                __m256i P = slot_pack_tok(U, tv, b, T);
                __m256 wd = _mm256_permutevar8x32_ps(dsc, _mm256_set1_epi32(j));
                acc[e] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_mul_ps(wd, _mm256_loadu_ps(tv->td4 + 8 * b)), acc[e]);
            }
            const __m256 M = _mm256_permutevar8x32_ps(dmn, _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c,
                                                                          2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1));
            accM = _mm256_fmadd_ps(M, _mm256_loadu_ps(tv->ds4 + 4 * (8 * (size_t)i + 2 * c)), accM);
        }
    }
    slot_finish(acc[0], acc[1], accM, 1, res, T);
}

A256 AINL void q6k_slots_256(const uint8_t *row, int n, const tile *tv, float *res, const int T) {
    const int nsb = n / QK_K;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < nsb; i++) {
        const blk_q6_K *x = (const blk_q6_K *)row + i;
        __m256 sc_lo, sc_hi;
        q6k_scales_256(x, &sc_lo, &sc_hi);
        for (int h = 0; h < 2; h++) {
            for (int k = 0; k < 4; k++) {
                const size_t b = 8 * (size_t)i + 4 * h + k;
                __m256i P = _mm256_add_epi32(slot_pack_tok(q6k_group_256(x, h, k), tv, b, T),
                                             _mm256_loadu_si256((const __m256i *)(tv->nq4 + 8 * b)));
                __m256 wd = pair4_256(sc_lo, sc_hi, 8 * h + 2 * k);   /* 16-element scales: one per half */
                acc[k & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_mul_ps(wd, _mm256_loadu_ps(tv->td4 + 8 * b)), acc[k & 1]);
            }
        }
    }
    slot_finish(acc[0], acc[1], acc[0], 0, res, T);
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

#define KERN256(name, IMPL, ...)                                                        \
    A256 static void name(const uint8_t *row, int n, const tile *tv, float *res) {      \
        const int T = tv->T;                                                            \
        DISPATCH_T4(IMPL, __VA_ARGS__);                                                 \
    }

KERN256(k256_q4_0, legacy_row_256, RQ_Q4_0, row, n, tv, res)
KERN256(k256_q4_1, legacy_row_256, RQ_Q4_1, row, n, tv, res)
KERN256(k256_q5_0, legacy_row_256, RQ_Q5_0, row, n, tv, res)
KERN256(k256_q5_1, legacy_row_256, RQ_Q5_1, row, n, tv, res)
KERN256(k256_q8_0, legacy_row_256, RQ_Q8_0, row, n, tv, res)
KERN256(k256_q2_K, q23k_row_256, RQ_Q2_K, row, n, tv, res)
KERN256(k256_q3_K, q23k_row_256, RQ_Q3_K, row, n, tv, res)
KERN256(k256_q4_K, q4k_slots_256, row, n, tv, res)
KERN256(k256_q5_K, q45k_row_256, RQ_Q5_K, row, n, tv, res)
KERN256(k256_q6_K, q6k_slots_256, row, n, tv, res)
KERN256(k256_f32, float_row_256, RQ_F32, row, n, tv, res)
KERN256(k256_f16, float_row_256, RQ_F16, row, n, tv, res)
KERN256(k256_bf16, float_row_256, RQ_BF16, row, n, tv, res)

/* --- K types, decode: 4 rows x 1 token per vector ------------------------------------------
 * The slot kernels above put the tile's tokens in the lanes; with one token (decode) 3 of the 4
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

/* exact sums of U_r . q over each 16-element half, packed [r0lo r1lo r2lo r3lo r0hi .. r3hi] */
A256 AINL __m256i rows4_pack(const __m256i *U, __m256i q) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p[4];
    for (int r = 0; r < 4; r++) p[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(U[r], q), ones);
    return _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
}

A256 AINL void rows4_finish(__m256 acc0, __m256 acc1, __m256 accM, const int mins, float *res) {
    const __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    if (mins) a = _mm_add_ps(a, _mm_add_ps(_mm256_castps256_ps128(accM), _mm256_extractf128_ps(accM, 1)));
    _mm_storeu_ps(res, a);
}

A256 static void q4k_rows4_256(const uint8_t *const *rows, int n, const tile *tv, float *res, size_t pf) {
    const int nsb = n / QK_K;
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    const __m256i tok0 = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, accM = _mm256_setzero_ps();
    for (int i = 0; i < nsb; i++) {
        const blk_q4_K *x[4];
        __m256 dsc[4], dmn[4], SC[4], MN[4];
        for (int r = 0; r < 4; r++) {
            x[r] = (const blk_q4_K *)rows[r] + i;
            if (pf) _mm_prefetch((const char *)x[r] + pf, _MM_HINT_T0), _mm_prefetch((const char *)x[r] + pf + 64, _MM_HINT_T0);
            q4k_scales_256(x[r], &dsc[r], &dmn[r]);
        }
        rows4_transpose(dsc, SC);
        rows4_transpose(dmn, MN);
        for (int c = 0; c < 4; c++) {
            __m256i xq[4];
            for (int r = 0; r < 4; r++) xq[r] = _mm256_loadu_si256((const __m256i *)(x[r]->qs + 32 * c));
            for (int e = 0; e < 2; e++) {
                const int j = 2 * c + e;
                const size_t b = 8 * (size_t)i + j;
                __m256i U[4];
                for (int r = 0; r < 4; r++) U[r] = _mm256_and_si256(e ? _mm256_srli_epi16(xq[r], 4) : xq[r], m0f);
                const __m256i P = rows4_pack(U, _mm256_loadu_si256((const __m256i *)(tv->qs + 32 * b)));
                const __m256 wd = rows4_pair(SC, j, j);
                acc[e] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_mul_ps(wd, _mm256_set1_ps(tv->td4[8 * b])), acc[e]);
            }
            const __m256 M = rows4_pair(MN, 2 * c, 2 * c + 1);
            const __m256 ds = _mm256_permutevar8x32_ps(_mm256_loadu_ps(tv->ds4 + 4 * (8 * (size_t)i + 2 * c)), tok0);
            accM = _mm256_fmadd_ps(M, ds, accM);
        }
    }
    rows4_finish(acc[0], acc[1], accM, 1, res);
}

A256 static void q6k_rows4_256(const uint8_t *const *rows, int n, const tile *tv, float *res, size_t pf) {
    const int nsb = n / QK_K;
    const __m256i tok0 = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < nsb; i++) {
        const blk_q6_K *x[4];
        __m256 lo[4], hi[4], SL[4], SH[4];
        for (int r = 0; r < 4; r++) {
            x[r] = (const blk_q6_K *)rows[r] + i;
            if (pf)
                for (int o = 0; o < (int)sizeof(blk_q6_K); o += 64) _mm_prefetch((const char *)x[r] + pf + o, _MM_HINT_T0);
            q6k_scales_256(x[r], &lo[r], &hi[r]);
        }
        rows4_transpose(lo, SL);
        rows4_transpose(hi, SH);
        for (int h = 0; h < 2; h++) {
            for (int k = 0; k < 4; k++) {
                const size_t b = 8 * (size_t)i + 4 * h + k;
                __m256i U[4];
                for (int r = 0; r < 4; r++) U[r] = q6k_group_256(x[r], h, k);
                __m256i P = rows4_pack(U, _mm256_loadu_si256((const __m256i *)(tv->qs + 32 * b)));
                P = _mm256_add_epi32(P, _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(tv->nq4 + 8 * b)), tok0));
                const int g = 8 * h + 2 * k;   /* 16-element scales: one per half */
                const __m256 wd = g < 8 ? rows4_pair(SL, g, g + 1) : rows4_pair(SH, g - 8, g - 7);
                acc[k & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_mul_ps(wd, _mm256_set1_ps(tv->td4[8 * b])), acc[k & 1]);
            }
        }
    }
    rows4_finish(acc[0], acc[1], acc[0], 0, res);
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

A256 static void r256_q4_K(const uint8_t *W, size_t rb, int r0, int r1, int n, const tile *tv, float *out, int ldo, int k0) {
    krows_256(k256_q4_K, q4k_rows4_256, W, rb, r0, r1, n, tv, out, ldo, k0);
}
A256 static void r256_q6_K(const uint8_t *W, size_t rb, int r0, int r1, int n, const tile *tv, float *out, int ldo, int k0) {
    krows_256(k256_q6_K, q6k_rows4_256, W, rb, r0, r1, n, tv, out, ldo, k0);
}

/* --- Prefill: 8 tokens x 1 row per vector, on weights unpacked once per row chunk ----------
 * Tiles of T >= 3 tokens. A row chunk's weights are first unpacked (pf8_unpack_*) to, per row
 * and block b: 32 unsigned bytes in element order (offsets not removed), the float weight scale
 * of each 16-element half (WD) and the float min (M, types with mins). Then every tile passes
 * over the chunk, one row at a time: each 32-bit lane is one token k of the tile. Per half h of
 * block b, dword j (4 elements) of the weights is broadcast and multiplied with dword j of the
 * 8 tokens (tile.qs8) by vpmaddubsw; the int16 sums of a half add up exactly (U <= 31: 4 x 7874;
 * Q6_K U <= 63: pairs only), and one vpmaddwd gives the exact half sum P per token: no
 * horizontal adds (vphaddd costs ~2.5 cycles on Zen 3). The float sequence per (row, token) lane is that of legacy_slots_256 /
 * q4k_slots_256 / q6k_slots_256 exactly (so results do not depend on the tile):
 *     acc_(b&1),h = fma(float(P_b,h + NQ), WD_b,h * d_b, acc_(b&1),h)
 *     accM_(b&1)  = fma(M_b, d_b * S_b, accM_(b&1))      (mins; a padded fma(0, 0, .) if nb is odd)
 *     result = ((acc_0,0 + acc_1,0) + (acc_0,1 + acc_1,1)) + (accM_0 + accM_1) */

static size_t pf8_urow_bytes(int nb) { return ((size_t)nb * (32 + 8 + 4) + 63) & ~(size_t)63; }

A256 AINL void pf8_store_scales(uint8_t *ur, int nb, int b, float w0, float w1, float m) {
    float *WD = (float *)(ur + 32 * (size_t)nb);
    WD[2 * b] = w0;
    WD[2 * b + 1] = w1;
    WD[2 * (size_t)nb + b] = m;
}

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

A256 AINL void pf8_unpack_q4k(const uint8_t *row, int nb, uint8_t *ur) {
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < nb / 8; i++) {
        const blk_q4_K *x = (const blk_q4_K *)row + i;
        __m256 dsc, dmn;
        q4k_scales_256(x, &dsc, &dmn);
        float sc[8], mn[8];
        _mm256_storeu_ps(sc, dsc);
        _mm256_storeu_ps(mn, dmn);
        for (int c = 0; c < 4; c++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * c));
            for (int e = 0; e < 2; e++) {
                const int j = 2 * c + e, b = 8 * i + j;
                _mm256_storeu_si256((__m256i *)(ur + 32 * (size_t)b), _mm256_and_si256(e ? _mm256_srli_epi16(xq, 4) : xq, m0f));
                pf8_store_scales(ur, nb, b, sc[j], sc[j], mn[j]);
            }
        }
    }
}

A256 AINL void pf8_unpack_q6k(const uint8_t *row, int nb, uint8_t *ur) {
    for (int i = 0; i < nb / 8; i++) {
        const blk_q6_K *x = (const blk_q6_K *)row + i;
        __m256 sc_lo, sc_hi;
        q6k_scales_256(x, &sc_lo, &sc_hi);
        float sc[16];
        _mm256_storeu_ps(sc, sc_lo);
        _mm256_storeu_ps(sc + 8, sc_hi);
        for (int h = 0; h < 2; h++) {
            for (int k = 0; k < 4; k++) {
                const int b = 8 * i + 4 * h + k;
                _mm256_storeu_si256((__m256i *)(ur + 32 * (size_t)b), q6k_group_256(x, h, k));
                pf8_store_scales(ur, nb, b, sc[8 * h + 2 * k], sc[8 * h + 2 * k + 1], 0.0f);
            }
        }
    }
}

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
    const float *WD[2];
    for (int r = 0; r < R; r++) WD[r] = (const float *)(ur[r] + 32 * (size_t)nb);
    for (int b = par; b < nb; b += 2) {
        const int8_t *q = tv->qs8 + 256 * (size_t)b;
        const __m256 td = _mm256_loadu_ps(tv->td8 + 8 * (size_t)b);
        __m256 s[2];
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

/* R unpacked rows against the 8 token lanes of the tile: res[8 r + k]. */
A256 AINL void pf8_rowsR_256(const int t, const int R, const uint8_t *const *ur, int nb, const tile *tv, float *res) {
    __m256 aE[2][2], aO[2][2], mE[2], mO[2];
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
        else if (t == RQ_Q6_K) pf8_unpack_q6k(row, nb, ur);
        else pf8_unpack_legacy(t, row, nb, ur);
    }
}

/* Rows [r0, r1), unpacked at buf, against a tile of T >= 3 tokens: out[(k0 + k) * ldo + r].
 * (Two rows per pass sharing the tokens' loads, or two tiles sharing the weight broadcasts,
 * measured no faster on Zen 3: the multiply pipes and register pressure limit.) */
A256 AINL void pf8_rows_256(const int t, const uint8_t *buf, int r0, int r1, int nb, const tile *tv, float *out,
                            int ldo, int k0) {
    const size_t us = pf8_urow_bytes(nb);
    const int T = tv->T;
    _Alignas(32) float res[8];
    for (int r = r0; r < r1; r++) {
        const uint8_t *ur[1] = {buf + (size_t)(r - r0) * us};
        pf8_rowsR_256(t, 1, ur, nb, tv, res);
        for (int k = 0; k < T; k++) out[(size_t)(k0 + k) * ldo + r] = res[k];
    }
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
PF8_256(q6_K, RQ_Q6_K)

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
typedef struct {
    int nb, ntiles;
    uint8_t *mem;   /* ntiles x nb x V16_TILE_BLOCK_BYTES */
    tile *pf8;      /* AVX2 prefill from R16: the same tiles in the AVX2 prefill kernels' form, or NULL */
} v16_toks;

static void v16_prep_tile(int t, const rq_act *acts, int ntok, int i, v16_toks *tk) {
    const int nb = tk->nb, off = type_offset(t), k0 = 8 * i;
    const int T = ntok - k0 < 8 ? ntok - k0 : 8;
    uint8_t *m = tk->mem + (size_t)i * nb * V16_TILE_BLOCK_BYTES;
    if (T < 8) memset(m, 0, (size_t)nb * V16_TILE_BLOCK_BYTES);
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

/* Rows [r0, r0 + nr) (nr <= 16) -> one interleaved group at grp; tmp holds 16 unpacked rows. */
A512 static void v16_unpack(const int t, const uint8_t *W, size_t rb, int r0, int nr, int nb, uint8_t *tmp,
                             uint8_t *grp) {
    const size_t us = pf8_urow_bytes(nb);
    for (int r = 0; r < 16; r++) {
        uint8_t *ur = tmp + (size_t)r * us;
        if (r >= nr) { memset(ur, 0, us); continue; }
        const uint8_t *row = W + (size_t)(r0 + r) * rb;
        if (t == RQ_Q4_K) pf8_unpack_q4k(row, nb, ur);
        else if (t == RQ_Q6_K) pf8_unpack_q6k(row, nb, ur);
        else if (t == RQ_Q8_0) v16_unpack_q8_0(row, nb, ur);
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
        _mm512_storeu_ps(WD + 32 * (size_t)b, _mm512_i32gather_ps(idx, sWD + 2 * (size_t)b, 1));
        _mm512_storeu_ps(WD + 32 * (size_t)b + 16, _mm512_i32gather_ps(idx, sWD + 2 * (size_t)b + 1, 1));
        if (mins) _mm512_storeu_ps(M + 16 * (size_t)b, _mm512_i32gather_ps(idx, sM + b, 1));
    }
}

/* Blocks par, par + 2, ... of a group against the T tokens of a tile: acc[k][h] per half. */
A512 AINL void v16_pass(const int t, const uint8_t *grp, int nb, const int T, const uint8_t *tile, const int par,
                         __m512 (*acc)[2]) {
    const int offs = type_offset(t) != 0, q6 = (t == RQ_Q6_K);
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
        __m512 r = _mm512_add_ps(_mm512_add_ps(a[0][k], a[1][k]), _mm512_add_ps(a[2][k], a[3][k]));
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
V16_ROWS(q6_K, RQ_Q6_K)

typedef void (*v16_rows_fn)(const uint8_t *W, size_t rb, int r0, int r1, int nb, int ntok, const v16_toks *tk,
                            float *out, int ldo, uint8_t *tmp, uint8_t *grp, int gmax);

/* ---- R16 kernels (layout and repacking: see the R16 section above) ---- */


/* Block b of a group in registers: W[4h + g] (the v16 U vectors), the half scales and the mins. */
A512 AINL void r16_block(const int t, const r16_ptrs *p, size_t b, __m512i *W, __m512 *wd0, __m512 *wd1, __m512 *mn) {
    const __m512i m0f = _mm512_set1_epi8(0x0F);
    const uint8_t *u = r16_unit(p, b);
    const size_t j = r16_j(p, b);
    if (t == RQ_Q8_0) {
        for (int k = 0; k < 8; k++) W[k] = _mm512_loadu_si512(u + p->q8 + 64 * k);
    } else {
        for (int g = 0; g < 4; g++) {
            const __m512i v = _mm512_loadu_si512(u + p->nib + 64 * (4 * j + g));
            W[g] = _mm512_and_si512(v, m0f);
            W[4 + g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m0f);
        }
        if (t == RQ_Q5_0 || t == RQ_Q5_1) {
            const __m512i hb = _mm512_loadu_si512(u + p->hb), b5 = _mm512_set1_epi8(0x10);
            for (int k = 0; k < 8; k++) {   /* bit 8i + k -> 0x10 of byte i */
                const __m512i hk = k <= 4 ? _mm512_slli_epi32(hb, 4 - k) : _mm512_srli_epi32(hb, k - 4);
                W[k] = _mm512_or_si512(W[k], _mm512_and_si512(hk, b5));
            }
        } else if (t == RQ_Q6_K) {
            const __m512i m30 = _mm512_set1_epi8(0x30);
            for (int h = 0; h < 2; h++) {
                const __m512i hb = _mm512_loadu_si512(u + p->hb + 64 * (2 * j + h));
                for (int g = 0; g < 4; g++) {   /* bits 8i + 2g, +1 -> 0x30 of byte i */
                    const __m512i hg = g < 2 ? _mm512_slli_epi32(hb, 4 - 2 * g) : _mm512_srli_epi32(hb, 2 * g - 4);
                    W[4 * h + g] = _mm512_or_si512(W[4 * h + g], _mm512_and_si512(hg, m30));
                }
            }
        }
    }
    if (t == RQ_Q4_K) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + p->kd)));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + p->kdm)));
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(u + p->ksc + 16 * j))));
        const __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(u + p->kmn + 16 * j))));
        *wd0 = *wd1 = _mm512_mul_ps(sc, d);   /* as q4k_scales_256: float(sc) * d, float(m) * -dmin */
        *mn = _mm512_mul_ps(m, _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dm), _mm512_set1_epi32((int)0x80000000))));
    } else if (t == RQ_Q6_K) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + p->qd)));
        const int8_t *qs = (const int8_t *)(u + p->qsc + 16 * 2 * j);
        *wd0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs))), d);
        *wd1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)))), d);
        *mn = _mm512_setzero_ps();
    } else {
        *wd0 = *wd1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + p->d)));
        *mn = p->m ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + p->m))) : _mm512_setzero_ps();
    }
}

/* A group expanded into the v16 layout (for calls with many tokens: expanded once, then every
 * token tile runs v16_tile on it). */
A512 static void r16_expand(const int t, const uint8_t *g, int nb, uint8_t *grp) {
    const r16_ptrs p = r16_group_ptrs(t, g, nb);
    __m512i *U = (__m512i *)grp;
    float *WD = (float *)(grp + 512 * (size_t)nb), *M = WD + 32 * (size_t)nb;
    for (int b = 0; b < nb; b++) {
        __m512i W[8];
        __m512 wd0, wd1, mn;
        r16_block(t, &p, (size_t)b, W, &wd0, &wd1, &mn);
        for (int j = 0; j < 8; j++) _mm512_storeu_si512(U + 8 * (size_t)b + j, W[j]);
        _mm512_storeu_ps(WD + 32 * (size_t)b, wd0);
        _mm512_storeu_ps(WD + 32 * (size_t)b + 16, wd1);
        _mm512_storeu_ps(M + 16 * (size_t)b, mn);
    }
}

#ifndef R16_PF_AHEAD
#define R16_PF_AHEAD 6144
#endif
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
            if (r16_j(p, (size_t)b) == 0) {   /* decode streams from DRAM: ask for a unit further on early */
                const char *ahead = (const char *)r16_unit(p, (size_t)b) + R16_PF_AHEAD;
                for (size_t o = 0; o < p->ub; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
            }
            r16_block_acc(t, p, (size_t)b, T, tile, k0, aE, mE);
            r16_block_acc(t, p, (size_t)b + 1, T, tile, k0, aO, mO);
        }
        if (b < nb) r16_block_acc(t, p, (size_t)b, T, tile, k0, aE, mE);
        return;
    }
    for (int b = par; b < nb; b += 2) r16_block_acc(t, p, (size_t)b, T, tile, k0, par ? aO : aE, par ? mO : mE);
}

#define R16_TMAX 4
A512 AINL void r16_tile(const int t, const r16_ptrs *p, int nb, const int T, const uint8_t *tile, int k0, float *out,
                        int ldo, int nr) {
    __m512 aE[R16_TMAX][2], aO[R16_TMAX][2], mE[R16_TMAX], mO[R16_TMAX];
    for (int k = 0; k < T; k++) aE[k][0] = aE[k][1] = aO[k][0] = aO[k][1] = mE[k] = mO[k] = _mm512_setzero_ps();
    if (T <= 2) {
        r16_pass(t, p, nb, T, tile, k0, -1, aE, mE, aO, mO);
    } else {   /* one parity at a time: half the accumulators live */
        r16_pass(t, p, nb, T, tile, k0, 0, aE, mE, aO, mO);
        r16_pass(t, p, nb, T, tile, k0, 1, aE, mE, aO, mO);
    }
    const __mmask16 keep = nr >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nr) - 1);
    for (int k = 0; k < T; k++) {
        __m512 r = _mm512_add_ps(_mm512_add_ps(aE[k][0], aO[k][0]), _mm512_add_ps(aE[k][1], aO[k][1]));
        if (type_has_min(t)) {
            __m512 mo = mO[k];
            if (nb & 1) mo = _mm512_add_ps(mo, _mm512_setzero_ps());   /* the slot kernels' padded fma(0, 0, .) */
            r = _mm512_add_ps(r, _mm512_add_ps(mE[k], mo));
        }
        _mm512_mask_storeu_ps(out + (size_t)k * ldo, keep, r);
    }
}

#define R16_TILE_T(t, p, nb, tile, k0, out, ldo, nr, T) r16_tile(t, p, nb, T, tile, k0, out, ldo, nr)

/* Tokens at or above this take the expand-then-v16 route. */
#define R16_EXPAND_MIN_TOK 12

/* Groups [g0, g1) of a repacked matrix (rows rows) against all token tiles. Many tokens: up to
 * gmax groups at a time are expanded into grp (gmax v16 group buffers) and every tile runs over
 * them; few tokens: straight from the packed data. */
A512 AINL void r16_groups(const int t, const uint8_t *R, int rows, int g0, int g1, int nb, int ntok,
                          const v16_toks *tk, float *out, int ldo, uint8_t *grp, int gmax) {
    const size_t gbytes = r16_group_bytes_t(t, nb), vb = (v16_group_bytes(nb) + 63) & ~(size_t)63;
    if (ntok >= R16_EXPAND_MIN_TOK) {
        for (int c0 = g0; c0 < g1; c0 += gmax) {
            const int c1 = c0 + gmax < g1 ? c0 + gmax : g1;
            for (int g = c0; g < c1; g++) r16_expand(t, R + gbytes * (size_t)g, nb, grp + vb * (size_t)(g - c0));
            for (int i = 0; i < tk->ntiles; i++) {
                const int k0 = 8 * i, T = ntok - k0 < 8 ? ntok - k0 : 8;
                const uint8_t *tile = tk->mem + (size_t)i * nb * V16_TILE_BLOCK_BYTES;
                for (int g = c0; g < c1; g++) {
                    const int r0 = 16 * g, nr = rows - r0 < 16 ? rows - r0 : 16;
                    DISPATCH_T8(V16_TILE_T, t, grp + vb * (size_t)(g - c0), nb, tile, out + (size_t)k0 * ldo + r0, ldo, nr);
                }
            }
        }
        return;
    }
    for (int g = g0; g < g1; g++) {
        const r16_ptrs p = r16_group_ptrs(t, R + gbytes * (size_t)g, nb);
        const int r0 = 16 * g, nr = rows - r0 < 16 ? rows - r0 : 16;
        for (int i = 0; i < tk->ntiles; i++) {
            const uint8_t *tile = tk->mem + (size_t)i * nb * V16_TILE_BLOCK_BYTES;
            for (int k0 = 0; k0 < 8 && 8 * i + k0 < ntok; k0 += R16_TMAX) {
                const int left = ntok - 8 * i - k0, T = left < R16_TMAX ? left : R16_TMAX;
                DISPATCH_T4(R16_TILE_T, t, &p, nb, tile, k0, out + (size_t)(8 * i + k0) * ldo + r0, ldo, nr);
            }
        }
    }
}

#define R16_GROUPS(suffix, t)                                                                                   \
    A512 static void r16g_##suffix(const uint8_t *R, int rows, int g0, int g1, int nb, int ntok, const v16_toks *tk, \
                                   float *out, int ldo, uint8_t *grp, int gmax) {                               \
        r16_groups(t, R, rows, g0, g1, nb, ntok, tk, out, ldo, grp, gmax);                                      \
    }
R16_GROUPS(q4_0, RQ_Q4_0)
R16_GROUPS(q4_1, RQ_Q4_1)
R16_GROUPS(q5_0, RQ_Q5_0)
R16_GROUPS(q5_1, RQ_Q5_1)
R16_GROUPS(q8_0, RQ_Q8_0)
R16_GROUPS(q4_K, RQ_Q4_K)
R16_GROUPS(q6_K, RQ_Q6_K)

typedef void (*r16_groups_fn)(const uint8_t *R, int rows, int g0, int g1, int nb, int ntok, const v16_toks *tk,
                              float *out, int ldo, uint8_t *grp, int gmax);

/* ---- R16 on AVX2: the same layout and float sequence, 8 rows per vector (the low or high 32
 * bytes of each 64-byte entry: rows 0-7 or 8-15 of the group), vpmaddubsw + vpmaddwd for the
 * exact integer sums (as the AVX2 prefill kernels: 4-bit and 5-bit values add up in int16, Q6_K
 * in pairs, Q8_0 through the sign trick on its signed values). ---- */

/* Block b of a group, rows 8q..8q+7: the v16 U vectors, half scales and mins. */
A256 AINL void r16_block_256(const int t, const r16_ptrs *p, size_t b, const int q, __m256i *W, __m256 *wd0,
                             __m256 *wd1, __m256 *mn) {
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    const uint8_t *u = r16_unit(p, b);
    const size_t j = r16_j(p, b), o = 32 * (size_t)q;
    if (t == RQ_Q8_0) {
        for (int k = 0; k < 8; k++) W[k] = _mm256_loadu_si256((const __m256i *)(u + p->q8 + 64 * k + o));
    } else {
        for (int g = 0; g < 4; g++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(u + p->nib + 64 * (4 * j + g) + o));
            W[g] = _mm256_and_si256(v, m0f);
            W[4 + g] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f);
        }
        if (t == RQ_Q5_0 || t == RQ_Q5_1) {
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(u + p->hb + o)), b5 = _mm256_set1_epi8(0x10);
            for (int k = 0; k < 8; k++) {
                const __m256i hk = k <= 4 ? _mm256_slli_epi32(hb, 4 - k) : _mm256_srli_epi32(hb, k - 4);
                W[k] = _mm256_or_si256(W[k], _mm256_and_si256(hk, b5));
            }
        } else if (t == RQ_Q6_K) {
            const __m256i m30 = _mm256_set1_epi8(0x30);
            for (int h = 0; h < 2; h++) {
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(u + p->hb + 64 * (2 * j + h) + o));
                for (int g = 0; g < 4; g++) {
                    const __m256i hg = g < 2 ? _mm256_slli_epi32(hb, 4 - 2 * g) : _mm256_srli_epi32(hb, 2 * g - 4);
                    W[4 * h + g] = _mm256_or_si256(W[4 * h + g], _mm256_and_si256(hg, m30));
                }
            }
        }
    }
    const size_t o16 = 16 * (size_t)q, o8 = 8 * (size_t)q;
    if (t == RQ_Q4_K) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->kd + o16)));
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->kdm + o16)));
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + p->ksc + 16 * j + o8))));
        const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + p->kmn + 16 * j + o8))));
        *wd0 = *wd1 = _mm256_mul_ps(sc, d);
        *mn = _mm256_mul_ps(m, _mm256_xor_ps(dm, _mm256_set1_ps(-0.0f)));
    } else if (t == RQ_Q6_K) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->qd + o16)));
        const uint8_t *qs = u + p->qsc + 32 * j + o8;
        *wd0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qs))), d);
        *wd1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 16)))), d);
        *mn = _mm256_setzero_ps();
    } else {
        *wd0 = *wd1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->d + o16)));
        *mn = p->m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + p->m + o16))) : _mm256_setzero_ps();
    }
}

/* Exact sum over the 16 elements of a half: 8 rows' U (Wh[0..3]: groups g) times one token's
 * activations qd (16 bytes). Q8_0 returns the offset-free sum directly. */
A256 AINL __m256i r16_dot_256(const int t, const __m256i *Wh, const uint8_t *qd) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (t == RQ_Q8_0) {
        const __m256i x80 = _mm256_set1_epi8((char)0x80);
        __m256i s = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            const __m256i w = _mm256_xor_si256(Wh[g], x80), a = _mm256_set1_epi32((int)load_u32(qd + 4 * g));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w)), ones));
        }
        return s;
    }
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
    const int offs = type_offset(t) != 0 && t != RQ_Q8_0, mins = type_has_min(t);
    const int32_t *nq = (const int32_t *)(tb + 256);
    const float *d = (const float *)(tb + 320), *ds = (const float *)(tb + 352);
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
        __m256 r = _mm256_add_ps(_mm256_add_ps(aE[k][0], aO[k][0]), _mm256_add_ps(aE[k][1], aO[k][1]));
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

/* Rows 8q.. of a packed group against T <= 2 tokens, every block read once (decode). */
A256 AINL void r16_half_256(const int t, const r16_ptrs *p, int nb, const int T, const uint8_t *tile, int k0,
                            const int q, float *out, int ldo, int nr) {
    __m256 aE[2][2], aO[2][2], mE[2], mO[2];
    for (int k = 0; k < T; k++) aE[k][0] = aE[k][1] = aO[k][0] = aO[k][1] = mE[k] = mO[k] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        if (q == 0 && r16_j(p, (size_t)b) == 0) {   /* see r16_pass */
            const char *ahead = (const char *)r16_unit(p, (size_t)b) + R16_PF_AHEAD;
            for (size_t o = 0; o < p->ub; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
        }
        __m256i W[8];
        __m256 wd0, wd1, mn;
        r16_block_256(t, p, (size_t)b, q, W, &wd0, &wd1, &mn);
        r16_acc_256(t, W, wd0, wd1, mn, tile + (size_t)b * V16_TILE_BLOCK_BYTES, T, k0, (b & 1) ? aO : aE, (b & 1) ? mO : mE);
    }
    r16_store_256(t, nb, T, aE, aO, mE, mO, out, ldo, nr);
}

/* A packed group expanded into the v16 layout (prefill), with AVX2. */
A256 static void r16_expand_256(const int t, const uint8_t *g, int nb, uint8_t *grp) {
    const r16_ptrs p = r16_group_ptrs(t, g, nb);
    uint8_t *U = grp;
    float *WD = (float *)(grp + 512 * (size_t)nb), *M = WD + 32 * (size_t)nb;
    for (int b = 0; b < nb; b++)
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

/* Rows 8q.. of an expanded (v16) group against T <= 4 tokens (from k0), parity by parity. */
A256 AINL void v8_tile_256(const int t, const uint8_t *grp, int nb, const int T, const uint8_t *tile, int k0,
                           const int q, float *out, int ldo, int nr) {
    const uint8_t *U = grp;
    const float *WD = (const float *)(grp + 512 * (size_t)nb), *M = WD + 32 * (size_t)nb;
    __m256 a[2][4][2], m[2][4];
    for (int par = 0; par < 2; par++) {
        __m256 acc[4][2], accM[4];
        for (int k = 0; k < T; k++) acc[k][0] = acc[k][1] = accM[k] = _mm256_setzero_ps();
        for (int b = par; b < nb; b += 2) {
            __m256i W[8];
            for (int j = 0; j < 8; j++) W[j] = _mm256_loadu_si256((const __m256i *)(U + 512 * (size_t)b + 64 * j + 32 * q));
            const __m256 wd0 = _mm256_loadu_ps(WD + 32 * (size_t)b + 8 * q);
            const __m256 wd1 = t == RQ_Q6_K ? _mm256_loadu_ps(WD + 32 * (size_t)b + 16 + 8 * q) : wd0;   /* one scale product per block */
            const __m256 mn = _mm256_loadu_ps(M + 16 * (size_t)b + 8 * q);
            r16_acc_256(t, W, wd0, wd1, mn, tile + (size_t)b * V16_TILE_BLOCK_BYTES, T, k0, acc, accM);
        }
        for (int k = 0; k < T; k++) { a[par][k][0] = acc[k][0]; a[par][k][1] = acc[k][1]; m[par][k] = accM[k]; }
    }
    r16_store_256(t, nb, T, a[0], a[1], m[0], m[1], out, ldo, nr);
}

/* A packed group back into 16 rows of the AVX2 prefill kernels' unpacked form (pf8_unpack_*'s
 * output: U bytes, half scales, mins), for prefill on AVX2: pf8_rows_256 multiplies them faster
 * than v8 tiles (fewer multiply-pipe operations per MAC), with the same float sequence. */
A256 static void r16_to_pf8_rows_256(const int t, const uint8_t *g, int nb, uint8_t *rows) {
    const r16_ptrs p = r16_group_ptrs(t, g, nb);
    const size_t us = pf8_urow_bytes(nb);
    _Alignas(32) float w0[8], w1[8], m[8];
    for (int b = 0; b < nb; b++)
        for (int q = 0; q < 2; q++) {
            __m256i W[8];
            __m256 wd0, wd1, mn;
            r16_block_256(t, &p, (size_t)b, q, W, &wd0, &wd1, &mn);
            /* 8 x 8 dword transpose: row r gets W[0..7] lane r, its block's 32 values in order */
            const __m256i t0 = _mm256_unpacklo_epi32(W[0], W[1]), t1 = _mm256_unpackhi_epi32(W[0], W[1]);
            const __m256i t2 = _mm256_unpacklo_epi32(W[2], W[3]), t3 = _mm256_unpackhi_epi32(W[2], W[3]);
            const __m256i t4 = _mm256_unpacklo_epi32(W[4], W[5]), t5 = _mm256_unpackhi_epi32(W[4], W[5]);
            const __m256i t6 = _mm256_unpacklo_epi32(W[6], W[7]), t7 = _mm256_unpackhi_epi32(W[6], W[7]);
            const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
            const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
            const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
            const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
            const __m256i r[8] = {_mm256_permute2x128_si256(u0, u4, 0x20), _mm256_permute2x128_si256(u1, u5, 0x20),
                                  _mm256_permute2x128_si256(u2, u6, 0x20), _mm256_permute2x128_si256(u3, u7, 0x20),
                                  _mm256_permute2x128_si256(u0, u4, 0x31), _mm256_permute2x128_si256(u1, u5, 0x31),
                                  _mm256_permute2x128_si256(u2, u6, 0x31), _mm256_permute2x128_si256(u3, u7, 0x31)};
            _mm256_store_ps(w0, wd0);
            _mm256_store_ps(w1, wd1);
            _mm256_store_ps(m, mn);
            for (int i = 0; i < 8; i++) {
                uint8_t *ur = rows + (size_t)(8 * q + i) * us;
                _mm256_storeu_si256((__m256i *)(ur + 32 * (size_t)b), r[i]);
                pf8_store_scales(ur, nb, b, w0[i], w1[i], m[i]);
            }
        }
}

#define R16_HALF_T(t, p, nb, tile, k0, q, out, ldo, nr, T) r16_half_256(t, p, nb, T, tile, k0, q, out, ldo, nr)
#define V8_TILE_T(t, grp, nb, tile, k0, q, out, ldo, nr, T) v8_tile_256(t, grp, nb, T, tile, k0, q, out, ldo, nr)
#define DISPATCH_T2(IMPL, ...)                                  \
    do {                                                        \
        if (T == 1) IMPL(__VA_ARGS__, 1);                       \
        else IMPL(__VA_ARGS__, 2);                              \
    } while (0)

/* r16_groups for AVX2 (same arguments and routes). */
A256 AINL void r16_groups_256(const int t, const uint8_t *R, int rows, int g0, int g1, int nb, int ntok,
                              const v16_toks *tk, float *out, int ldo, uint8_t *grp, int gmax) {
    const size_t gbytes = r16_group_bytes_t(t, nb), vb = (v16_group_bytes(nb) + 63) & ~(size_t)63;
    if (ntok >= R16_EXPAND_MIN_TOK && tk->pf8) {
        const size_t us = pf8_urow_bytes(nb);
        for (int c0 = g0; c0 < g1; c0 += gmax) {
            const int c1 = c0 + gmax < g1 ? c0 + gmax : g1, r1 = 16 * c1 < rows ? 16 * c1 : rows;
            for (int g = c0; g < c1; g++) r16_to_pf8_rows_256(t, R + gbytes * (size_t)g, nb, grp + 16 * us * (size_t)(g - c0));
            for (int i = 0; i < tk->ntiles; i++) pf8_rows_256(t, grp, 16 * c0, r1, nb, &tk->pf8[i], out, ldo, 8 * i);
        }
        return;
    }
    if (ntok >= R16_EXPAND_MIN_TOK) {
        for (int c0 = g0; c0 < g1; c0 += gmax) {
            const int c1 = c0 + gmax < g1 ? c0 + gmax : g1;
            for (int g = c0; g < c1; g++) r16_expand_256(t, R + gbytes * (size_t)g, nb, grp + vb * (size_t)(g - c0));
            for (int i = 0; i < tk->ntiles; i++) {
                const uint8_t *tile = tk->mem + (size_t)i * nb * V16_TILE_BLOCK_BYTES;
                for (int g = c0; g < c1; g++) {
                    const int r0 = 16 * g, nr = rows - r0 < 16 ? rows - r0 : 16;
                    for (int k0 = 0; k0 < 8 && 8 * i + k0 < ntok; k0 += 4) {
                        const int left = ntok - 8 * i - k0, T = left < 4 ? left : 4;
                        for (int q = 0; q < 2 && 8 * q < nr; q++)
                            DISPATCH_T4(V8_TILE_T, t, grp + vb * (size_t)(g - c0), nb, tile, k0, q,
                                        out + (size_t)(8 * i + k0) * ldo + r0 + 8 * q, ldo, nr - 8 * q);
                    }
                }
            }
        }
        return;
    }
    for (int g = g0; g < g1; g++) {
        const r16_ptrs p = r16_group_ptrs(t, R + gbytes * (size_t)g, nb);
        const int r0 = 16 * g, nr = rows - r0 < 16 ? rows - r0 : 16;
        for (int i = 0; i < tk->ntiles; i++) {
            const uint8_t *tile = tk->mem + (size_t)i * nb * V16_TILE_BLOCK_BYTES;
            for (int k0 = 0; k0 < 8 && 8 * i + k0 < ntok; k0 += 2) {
                const int left = ntok - 8 * i - k0, T = left < 2 ? left : 2;
                for (int q = 0; q < 2 && 8 * q < nr; q++)
                    DISPATCH_T2(R16_HALF_T, t, &p, nb, tile, k0, q, out + (size_t)(8 * i + k0) * ldo + r0 + 8 * q, ldo, nr - 8 * q);
            }
        }
    }
}

#define R16_GROUPS_256(suffix, t)                                                                               \
    A256 static void r16g256_##suffix(const uint8_t *R, int rows, int g0, int g1, int nb, int ntok,               \
                                      const v16_toks *tk, float *out, int ldo, uint8_t *grp, int gmax) {        \
        r16_groups_256(t, R, rows, g0, g1, nb, ntok, tk, out, ldo, grp, gmax);                                  \
    }
R16_GROUPS_256(q4_0, RQ_Q4_0)
R16_GROUPS_256(q4_1, RQ_Q4_1)
R16_GROUPS_256(q5_0, RQ_Q5_0)
R16_GROUPS_256(q5_1, RQ_Q5_1)
R16_GROUPS_256(q8_0, RQ_Q8_0)
R16_GROUPS_256(q4_K, RQ_Q4_K)
R16_GROUPS_256(q6_K, RQ_Q6_K)

/* Every SIMD kernel of a type, by family; NULL where the family does not cover it (TRAITS says
 * which do: rq_kernels_init checks that the two agree). */
typedef struct {
    kern_fn k256;              /* AVX2 row x token tile (every type) */
    rows_fn r256;              /* AVX2 slot-packed rows (packed types) */
    pf8_unpack_fn pf8u;        /* AVX2 8-token prefill (pf8 types) */
    pf8_rows_fn pf8r;
    v16_rows_fn v16;           /* AVX-512 16-row prefill (packed types) */
    r16_groups_fn r16_512;     /* R16 layout (packed types) */
    r16_groups_fn r16_256;
} type_kernels;

#define PACKED_KERNELS(sfx) k256_##sfx, r256_##sfx
#define LAYOUT_KERNELS(sfx) v16r_##sfx, r16g_##sfx, r16g256_##sfx
static const type_kernels KERNELS[RQ_BF16 + 1] = {
    [RQ_F32] = {k256_f32},
    [RQ_F16] = {k256_f16},
    [RQ_BF16] = {k256_bf16},
    [RQ_Q2_K] = {k256_q2_K},
    [RQ_Q3_K] = {k256_q3_K},
    [RQ_Q5_K] = {k256_q5_K},
    [RQ_Q4_0] = {PACKED_KERNELS(q4_0), pf8u_q4_0, pf8r_q4_0, LAYOUT_KERNELS(q4_0)},
    [RQ_Q4_1] = {PACKED_KERNELS(q4_1), pf8u_q4_1, pf8r_q4_1, LAYOUT_KERNELS(q4_1)},
    [RQ_Q5_0] = {PACKED_KERNELS(q5_0), pf8u_q5_0, pf8r_q5_0, LAYOUT_KERNELS(q5_0)},
    [RQ_Q5_1] = {PACKED_KERNELS(q5_1), pf8u_q5_1, pf8r_q5_1, LAYOUT_KERNELS(q5_1)},
    [RQ_Q8_0] = {PACKED_KERNELS(q8_0), NULL, NULL, LAYOUT_KERNELS(q8_0)},
    [RQ_Q4_K] = {PACKED_KERNELS(q4_K), pf8u_q4_K, pf8r_q4_K, LAYOUT_KERNELS(q4_K)},
    [RQ_Q6_K] = {PACKED_KERNELS(q6_K), pf8u_q6_K, pf8r_q6_K, LAYOUT_KERNELS(q6_K)},
};

static const type_kernels *kernels(int t) {
    static const type_kernels none = {0};
    return traits(t)->block_elems ? &KERNELS[t] : &none;
}

/* Do TRAITS and KERNELS agree on which families cover each type? */
static int kernel_table_agrees(void) {
    for (int t = 0; t <= RQ_BF16; t++) {
        const type_traits *tr = traits(t);
        const type_kernels *k = kernels(t);
        if (!tr->block_elems) continue;
        const int packed = k->r256 && k->v16 && k->r16_512 && k->r16_256;
        if (!k->k256 || packed != tr->packed || (k->r256 || k->v16 || k->r16_512 || k->r16_256) != tr->packed ||
            (k->pf8u && k->pf8r) != tr->pf8 || (k->pf8u || k->pf8r) != tr->pf8)
            return 0;
    }
    return 1;
}

/* The R16 kernels of a path (avx512 or avx2) for type t, or NULL. */
static r16_groups_fn r16_path_kernel(int path, int t) {
    return path == RQ_PATH_AVX512 ? kernels(t)->r16_512 : path == RQ_PATH_AVX2 ? kernels(t)->r16_256 : NULL;
}

#endif /* x86 */

/* Kernel for (path, type) and the largest token tile it takes; NULL: use the scalar reference. */
static kern_fn simd_kernel(int path, int t, int *tmax, int *ub) {
    *tmax = 1;
    *ub = 1;
#ifdef RQ_HAVE_X86
    if (path == RQ_PATH_AVX512) path = RQ_PATH_AVX2;   /* see the AVX-512 section */
    if (path == RQ_PATH_AVX2) {
        *tmax = pf8_type(t, 1) ? 8 : TMAX2;   /* 8-token tiles: pf8_row_256 */
        return kernels(t)->k256;
    }
#else
    (void)path; (void)t;
#endif
    return NULL;
}

/* Multi-row kernel for (path, type), or NULL: the AVX2 legacy kernels, which pack (row, token)
 * slots (see legacy_slots_256) and need the tile's td4/nq4/ds4 arrays. */
static rows_fn simd_rows_kernel(int path, int t) {
#ifdef RQ_HAVE_X86
    if (path == RQ_PATH_AVX512 || path == RQ_PATH_AVX2) return kernels(t)->r256;
#else
    (void)path; (void)t;
#endif
    return NULL;
}

/* 8-token prefill kernels for (path, type) (see pf8_row_256): 0 if none. */
static int simd_pf8(int path, int t, pf8_unpack_fn *u, pf8_rows_fn *r) {
    *u = NULL;
    *r = NULL;
#ifdef RQ_HAVE_X86
    if (path == RQ_PATH_AVX512 || path == RQ_PATH_AVX2) {
        *u = kernels(t)->pf8u;
        *r = kernels(t)->pf8r;
    }
#else
    (void)path; (void)t;
#endif
    return *r != NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Path selection                                                                              */

static int g_path = -1;

int rq_cpu_supports_path(int path) {
    switch (path) {
    case RQ_PATH_SCALAR:
        return 1;
#if defined(__x86_64__) || defined(__i386__)
    case RQ_PATH_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case RQ_PATH_AVX512:
        return rq_cpu_has_avx512();   /* simd.h (in the SIMDe test build: AVX2 + FMA + F16C) */
#endif
    default:
        return 0;
    }
}

void rq_kernels_init(void) {
    if (__atomic_load_n(&g_path, __ATOMIC_ACQUIRE) >= 0) return;
    int p = RQ_PATH_SCALAR;
    if (rq_cpu_supports_path(RQ_PATH_AVX512)) p = RQ_PATH_AVX512;
    else if (rq_cpu_supports_path(RQ_PATH_AVX2)) p = RQ_PATH_AVX2;
    const char *env = getenv("RQLLM_KERNEL");
    if (env && *env) {
        int want = -1;
        if (!strcmp(env, "scalar")) want = RQ_PATH_SCALAR;
        else if (!strcmp(env, "avx2")) want = RQ_PATH_AVX2;
        else if (!strcmp(env, "avx512")) want = RQ_PATH_AVX512;
        if (want >= 0 && rq_cpu_supports_path(want)) p = want;
    }
#ifdef RQ_HAVE_X86
    if (!kernel_table_agrees()) {   /* a programming error: fail loudly, not with a wrong kernel */
        fputs("rqllm: quants.c TRAITS and KERNELS disagree on a type's kernel families\n", stderr);
        abort();
    }
#endif
    int expected = -1;
    __atomic_compare_exchange_n(&g_path, &expected, p, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

int rq_kernel_path(void) {
    rq_kernels_init();
    return __atomic_load_n(&g_path, __ATOMIC_ACQUIRE);
}

int rq_set_kernel_path(int path) {
    rq_kernels_init();
    if (!rq_cpu_supports_path(path)) return -1;
    __atomic_store_n(&g_path, path, __ATOMIC_RELEASE);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Dispatched dot and matmul                                                                   */

void rq_quantize_act(const float *x, int n, rq_act *a) {
#ifdef RQ_HAVE_X86
    int path = rq_kernel_path();
    if (path == RQ_PATH_AVX512) { quantize_act_512(x, n, a); return; }
    if (path == RQ_PATH_AVX2) { quantize_act_256(x, n, a); return; }
#endif
    quantize_act_ref(x, n, a);
}

float rq_vec_dot(int t, int n, const void *row, const rq_act *x) {
    int path = rq_kernel_path(), tmax, ub;
    kern_fn k = path == RQ_PATH_SCALAR ? NULL : simd_kernel(path, t, &tmax, &ub);
    if (!k) return rq_vec_dot_ref(t, n, row, x);
    int nb = n / QK;
    size_t need = tile_bytes(t, ub, 1, nb);
    _Alignas(64) uint8_t sbuf[8192];
    uint8_t *mem = need <= sizeof(sbuf) ? sbuf : aligned_alloc(64, need);
    if (!mem) return rq_vec_dot_ref(t, n, row, x);
    tile tl;
    prep_tile(t, ub, x, 1, nb, mem, &tl);
    float res = 0.0f;
    rows_fn rk = slot_packed(t, ub) ? simd_rows_kernel(path, t) : NULL;
    if (rk) rk(row, rq_row_bytes(t, n), 0, 1, n, &tl, &res, 1, 0);
    else k(row, n, &tl, &res);
    if (mem != sbuf) free(mem);
    return res;
}

static void matmul_rows_ref(int t, const void *W, int cols, int r0, int r1,
                            const rq_act *acts, int ntok, float *out, int ldo) {
    dot_fn f = ref_dot(t);
    size_t rb = rq_row_bytes(t, cols);
    const uint8_t *w = W;
    for (int r = r0; r < r1; r++) {
        const void *row = w + (size_t)r * rb;
        for (int k = 0; k < ntok; k++) out[(size_t)k * ldo + r] = f(cols, row, &acts[k]);
    }
}

/* Token tiles of one matmul: prepared once, shared by every thread. */
typedef struct {
    int ntiles, tmax, ub, nb;
    size_t full;      /* bytes per tile */
    rows_fn rk;       /* multi-row kernel, or NULL: one row at a time */
    tile *tl;
    uint8_t *mem;
    /* 8-token prefill kernels (tiles of T >= PF8_MIN_T), or NULL; one unpack buffer of
     * pf8_rows rows per thread that may run tiles_run on this set */
    pf8_unpack_fn pf8u;
    pf8_rows_fn pf8r;
    int pf8_nbuf, pf8_rows;
    size_t pf8_us;
    uint8_t *pf8_buf;
} tileset;

/* Rows of weights unpacked at a time for the prefill kernels: about 96 KiB, stays in L2. */
#define PF8_CHUNK_BYTES (96 * 1024)

static int tiles_alloc(tileset *ts, int path, int t, int tmax, int ub, int cols, int ntok, int nthreads) {
    ts->rk = slot_packed(t, ub) ? simd_rows_kernel(path, t) : NULL;
    ts->ntiles = (ntok + tmax - 1) / tmax;
    ts->tmax = tmax;
    ts->ub = ub;
    ts->nb = cols / QK;
    ts->full = tile_bytes(t, ub, ntok < tmax ? ntok : tmax, ts->nb);   /* no tile holds more tokens */
    ts->pf8_buf = NULL;
    ts->pf8_nbuf = 0;
    if (!(tmax >= PF8_MIN_T && ntok >= PF8_MIN_T && simd_pf8(path, t, &ts->pf8u, &ts->pf8r))) ts->pf8r = NULL;
    ts->tl = malloc(sizeof(tile) * (size_t)ts->ntiles);
    ts->mem = ts->full ? aligned_alloc(64, ts->full * (size_t)ts->ntiles) : NULL;
    if (ts->pf8r) {
        ts->pf8_us = pf8_urow_bytes(ts->nb);
        ts->pf8_rows = (int)(PF8_CHUNK_BYTES / ts->pf8_us);
        if (ts->pf8_rows < 4) ts->pf8_rows = 4;
        ts->pf8_nbuf = nthreads > 0 ? nthreads : 1;
        ts->pf8_buf = aligned_alloc(64, ts->pf8_us * (size_t)ts->pf8_rows * (size_t)ts->pf8_nbuf);
    }
    if (!ts->tl || (ts->full && !ts->mem) || (ts->pf8r && !ts->pf8_buf)) {
        free(ts->tl);
        free(ts->mem);
        free(ts->pf8_buf);
        return -1;
    }
    return 0;
}

static void tiles_free(tileset *ts) {
    free(ts->tl);
    free(ts->mem);
    free(ts->pf8_buf);
}

static void tiles_prep(tileset *ts, int t, const rq_act *acts, int ntok, int i) {
    int k0 = i * ts->tmax, T = ntok - k0 < ts->tmax ? ntok - k0 : ts->tmax;
    prep_tile(t, ts->ub, acts + k0, T, ts->nb, ts->full ? ts->mem + ts->full * (size_t)i : NULL, &ts->tl[i]);
}

/* Tiles of T >= PF8_MIN_T with the 8-token prefill kernels, others as in tiles_run: each row
 * chunk is unpacked once into this thread's buffer, then every tile passes over it. */
static void tiles_run_pf8(const tileset *ts, kern_fn kern, int t, const uint8_t *W, int cols, int r0, int r1,
                          float *out, int ldo) {
    size_t rb = rq_row_bytes(t, cols);
    int tid = 0;
#ifdef _OPENMP
    if (ts->pf8_nbuf > 1) tid = omp_get_thread_num();
#endif
    uint8_t *buf = ts->pf8_buf + ts->pf8_us * (size_t)ts->pf8_rows * (size_t)tid;
    const int R = ts->pf8_rows;
    float res[TMAX];
    for (int rc = r0; rc < r1; rc += R) {
        int re = rc + R < r1 ? rc + R : r1;
        ts->pf8u(W, rb, rc, re, ts->nb, buf);
        for (int i = 0; i < ts->ntiles; i++) {
            const tile *tl = &ts->tl[i];
            int k0 = i * ts->tmax, T = tl->T;
            if (T >= PF8_MIN_T) ts->pf8r(buf, rc, re, ts->nb, tl, out, ldo, k0);
            else if (ts->rk) ts->rk(W, rb, rc, re, cols, tl, out, ldo, k0);
            else
                for (int r = rc; r < re; r++) {
                    kern(W + (size_t)r * rb, cols, tl, res);
                    for (int j = 0; j < T; j++) out[(size_t)(k0 + j) * ldo + r] = res[j];
                }
        }
    }
}

static void tiles_run(const tileset *ts, kern_fn kern, int t, const uint8_t *W, int cols, int r0, int r1,
                      float *out, int ldo) {
    if (ts->pf8r) {
        tiles_run_pf8(ts, kern, t, W, cols, r0, r1, out, ldo);
        return;
    }
    size_t rb = rq_row_bytes(t, cols);
    /* With several tiles, row chunks small enough to stay in L2 while every tile passes over them. */
    int R = r1 - r0;
    if (ts->ntiles > 1) {
        R = (int)((size_t)(128 * 1024) / (rb ? rb : 1));
        if (R < 4) R = 4;
    }
    float res[TMAX];
    for (int rc = r0; rc < r1; rc += R) {
        int re = rc + R < r1 ? rc + R : r1;
        for (int i = 0; i < ts->ntiles; i++) {
            const tile *tl = &ts->tl[i];
            int k0 = i * ts->tmax, T = tl->T;
            if (ts->rk) {
                ts->rk(W, rb, rc, re, cols, tl, out, ldo, k0);
                continue;
            }
            for (int r = rc; r < re; r++) {
                kern(W + (size_t)r * rb, cols, tl, res);
                for (int j = 0; j < T; j++) out[(size_t)(k0 + j) * ldo + r] = res[j];
            }
        }
    }
}

/* ---- AVX-512 VNNI prefill driver (see v16_pass) ---- */
typedef struct {
    v16_rows_fn fn;
    v16_toks tk;
    int nbuf, gmax;
    size_t tmp_bytes, grp_bytes;
    uint8_t *buf;   /* nbuf x (tmp + gmax groups) */
} v16_set;

static int v16_use(int path, int t, int ntok) {
#ifdef RQ_HAVE_X86
    return path == RQ_PATH_AVX512 && v16_type(t) && ntok >= V16_MIN_TOK;
#else
    (void)path; (void)t; (void)ntok;
    return 0;
#endif
}

#ifdef RQ_HAVE_X86
static int v16_alloc(v16_set *vs, int t, int cols, int ntok, int nbuf) {
    const int nb = cols / QK;
    vs->fn = kernels(t)->v16;
    vs->tk.nb = nb;
    vs->tk.ntiles = (ntok + 7) / 8;
    vs->tk.mem = aligned_alloc(64, (size_t)vs->tk.ntiles * nb * V16_TILE_BLOCK_BYTES);
    vs->nbuf = nbuf;
    vs->tmp_bytes = 16 * pf8_urow_bytes(nb);
    size_t gb = (v16_group_bytes(nb) + 63) & ~(size_t)63;
    vs->gmax = (int)(V16_L2_BYTES / gb);
    if (vs->gmax < 1) vs->gmax = 1;
    if (vs->gmax > 8) vs->gmax = 8;
    vs->grp_bytes = gb * (size_t)vs->gmax;
    vs->buf = aligned_alloc(64, (vs->tmp_bytes + vs->grp_bytes) * (size_t)nbuf);
    if (!vs->fn || !vs->tk.mem || !vs->buf) {
        free(vs->tk.mem);
        free(vs->buf);
        return -1;
    }
    return 0;
}

static void v16_free(v16_set *vs) {
    free(vs->tk.mem);
    free(vs->buf);
}

static void v16_run(const v16_set *vs, int t, const uint8_t *W, int cols, int r0, int r1, int ntok, float *out,
                    int ldo, int buf_id) {
    uint8_t *tmp = vs->buf + (vs->tmp_bytes + vs->grp_bytes) * (size_t)buf_id;
    vs->fn(W, rq_row_bytes(t, cols), r0, r1, vs->tk.nb, ntok, &vs->tk, out, ldo, tmp, tmp + vs->tmp_bytes, vs->gmax);
}

/* Single-threaded: rows [r0, r1). Returns 0 when done, -1 when out of memory (nothing written). */
static int v16_matmul_rows(int t, const uint8_t *W, int cols, int r0, int r1, const rq_act *acts, int ntok,
                           float *out, int ldo) {
    v16_set vs;
    if (v16_alloc(&vs, t, cols, ntok, 1) != 0) return -1;
    for (int i = 0; i < vs.tk.ntiles; i++) v16_prep_tile(t, acts, ntok, i, &vs.tk);
    v16_run(&vs, t, W, cols, r0, r1, ntok, out, ldo, 0);
    v16_free(&vs);
    return 0;
}
#endif

static void fill_nan(int r0, int r1, int ntok, float *out, int ldo) {
    for (int k = 0; k < ntok; k++)
        for (int r = r0; r < r1; r++) out[(size_t)k * ldo + r] = NAN;
}

void rq_matmul_rows(int t, const void *W, int cols, int r0, int r1,
                    const rq_act *acts, int ntok, float *out, int ldo) {
    if (r1 <= r0 || ntok <= 0) return;
    if (!rq_type_supported(t)) {
        fill_nan(r0, r1, ntok, out, ldo);
        return;
    }
    int path = rq_kernel_path(), tmax, ub;
#ifdef RQ_HAVE_X86
    if (v16_use(path, t, ntok) && v16_matmul_rows(t, W, cols, r0, r1, acts, ntok, out, ldo) == 0) return;
#endif
    kern_fn k = path == RQ_PATH_SCALAR ? NULL : simd_kernel(path, t, &tmax, &ub);
    tileset ts;
    if (k && tiles_alloc(&ts, path, t, tmax, ub, cols, ntok, 1) == 0) {
        for (int i = 0; i < ts.ntiles; i++) tiles_prep(&ts, t, acts, ntok, i);
        tiles_run(&ts, k, t, W, cols, r0, r1, out, ldo);
        tiles_free(&ts);
        return;
    }
    matmul_rows_ref(t, W, cols, r0, r1, acts, ntok, out, ldo);
}

/* Below this much weight data (decode-sized calls), opening a parallel region costs more than
 * it saves. */
#define RQ_SERIAL_BYTES (64 * 1024)

/* Rows per work item when threads share a matmul, a multiple of 16. Decode: one contiguous
 * share per thread. Prefill: L2-sized items handed out dynamically (a thread slowed down by
 * other load on its core takes fewer). */
static int chunk_rows(int t, int cols, int rows, int nth, int prefill) {
    long c;
    if (prefill) {
        size_t rb = rq_row_bytes(t, cols);
        c = (long)((size_t)(128 * 1024) / (rb ? rb : 1));
        long cap = rows / (2 * (long)nth);
        if (c > cap) c = cap;
    } else {
        c = (rows + nth - 1) / nth;
    }
    c = (c + 15) / 16 * 16;
    return c < 16 ? 16 : (int)c;
}

#ifdef _OPENMP
/* Body shared by rq_matmul (inside its own region) and rq_matmul_team (inside the caller's):
 * called by every thread of the current team. out is complete for all threads on return when
 * barrier is set (rq_matmul relies on the join at the end of its region instead). */
static void matmul_in_team(int t, const uint8_t *W, int rows, int cols,
                           const rq_act *acts, int ntok, float *out, int ldo, int barrier) {
    int nth = omp_get_num_threads();
    int path = rq_kernel_path(), tmax = 1, ub = 1;
    kern_fn k = (path == RQ_PATH_SCALAR || !rq_type_supported(t)) ? NULL : simd_kernel(path, t, &tmax, &ub);
    if (!rq_type_supported(t)) {
#pragma omp single
        fill_nan(0, rows, ntok, out, ldo);
        return;
    }
#ifdef RQ_HAVE_X86
    if (v16_use(path, t, ntok)) {
        v16_set *vs = NULL;
        int ok = 0;
#pragma omp single copyprivate(vs, ok)
        {
            vs = malloc(sizeof(v16_set));
            ok = vs && v16_alloc(vs, t, cols, ntok, nth) == 0;
            if (!ok) { free(vs); vs = NULL; }
        }
        if (ok) {
            const int cr16 = chunk_rows(t, cols, rows, nth, 1), nch16 = (rows + cr16 - 1) / cr16;
#pragma omp for schedule(static)
            for (int i = 0; i < vs->tk.ntiles; i++) v16_prep_tile(t, acts, ntok, i, &vs->tk);
#pragma omp for schedule(dynamic, 1)
            for (int c = 0; c < nch16; c++) {
                int r0 = c * cr16, r1 = r0 + cr16 < rows ? r0 + cr16 : rows;
                v16_run(vs, t, W, cols, r0, r1, ntok, out, ldo, omp_get_thread_num());
            }
#pragma omp single nowait
            {
                v16_free(vs);
                free(vs);
            }
            return;   /* the loop's barrier: out is complete */
        }
    }
#endif
    int prefill = k && ntok > 2 * tmax;
    int cr = chunk_rows(t, cols, rows, nth, prefill);
    int nch = (rows + cr - 1) / cr;
    if (!prefill) {
        /* decode-sized: each thread prepares its own (small) token tiles, no extra barrier */
        tileset ts;
        int have = k && tiles_alloc(&ts, path, t, tmax, ub, cols, ntok, 1) == 0;
        if (have)
            for (int i = 0; i < ts.ntiles; i++) tiles_prep(&ts, t, acts, ntok, i);
#pragma omp for schedule(static, 1) nowait
        for (int c = 0; c < nch; c++) {
            int r0 = c * cr, r1 = r0 + cr < rows ? r0 + cr : rows;
            if (have) tiles_run(&ts, k, t, W, cols, r0, r1, out, ldo);
            else matmul_rows_ref(t, W, cols, r0, r1, acts, ntok, out, ldo);
        }
        if (have) tiles_free(&ts);
        if (barrier) {
#pragma omp barrier
        }
        return;
    }
    /* prefill: one shared set of token tiles, prepared by the whole team */
    tileset *ts = NULL;
    int ok = 0;
#pragma omp single copyprivate(ts, ok)
    {
        ts = malloc(sizeof(tileset));
        ok = ts && tiles_alloc(ts, path, t, tmax, ub, cols, ntok, nth) == 0;
        if (!ok) { free(ts); ts = NULL; }
    }
    if (!ok) {
#pragma omp for schedule(dynamic, 1)
        for (int c = 0; c < nch; c++) {
            int r0 = c * cr, r1 = r0 + cr < rows ? r0 + cr : rows;
            matmul_rows_ref(t, W, cols, r0, r1, acts, ntok, out, ldo);
        }
        return;
    }
#pragma omp for schedule(static)
    for (int i = 0; i < ts->ntiles; i++) tiles_prep(ts, t, acts, ntok, i);
#pragma omp for schedule(dynamic, 1)
    for (int c = 0; c < nch; c++) {
        int r0 = c * cr, r1 = r0 + cr < rows ? r0 + cr : rows;
        tiles_run(ts, k, t, W, cols, r0, r1, out, ldo);
    }
#pragma omp single nowait
    {
        tiles_free(ts);
        free(ts);
    }
}
#endif

void rq_matmul(int t, const void *W, int rows, int cols,
               const rq_act *acts, int ntok, float *out, int ldo, int nthreads) {
    rq_kernels_init();
    if (rows <= 0 || ntok <= 0) return;
    if (!rq_type_supported(t)) {
        fill_nan(0, rows, ntok, out, ldo);
        return;
    }
#ifdef _OPENMP
    int nt = nthreads > 0 ? nthreads : omp_get_max_threads();
    int nchunk = (rows + 15) / 16;
    if (nt > nchunk) nt = nchunk;
    if (ntok <= 2 && rq_row_bytes(t, cols) * (size_t)rows < RQ_SERIAL_BYTES) nt = 1;
    if (nt <= 1) {
        rq_matmul_rows(t, W, cols, 0, rows, acts, ntok, out, ldo);
        return;
    }
#pragma omp parallel num_threads(nt)
    matmul_in_team(t, W, rows, cols, acts, ntok, out, ldo, 0);   /* the region's end joins */
#else
    (void)nthreads;
    rq_matmul_rows(t, W, cols, 0, rows, acts, ntok, out, ldo);
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* Repacked (R16) weights                                                                      */

int rq_r16_supported(int t) { return r16_type(t); }

int rq_r16_layout_version(void) { return R16_V; }

int rq_r16_usable(void) {
#ifdef RQ_HAVE_X86
    const int path = rq_kernel_path();
    return path == RQ_PATH_AVX512 || path == RQ_PATH_AVX2;
#else
    return 0;
#endif
}

size_t rq_r16_bytes(int t, int rows, int cols) {
    if (!r16_type(t) || rows <= 0 || cols <= 0 || cols % rq_block_elems(t)) return 0;
    return r16_bytes(t, rows, cols);
}

void rq_r16_repack(int t, const void *W, int rows, int cols, void *R, int g0, int g1, int nthreads) {
    if (!rq_r16_bytes(t, rows, cols)) return;
    const int ng = (rows + 15) / 16;
    if (g0 < 0) g0 = 0;
    if (g1 > ng) g1 = ng;
#ifdef _OPENMP
    int nt = nthreads > 0 ? nthreads : omp_get_max_threads();
#pragma omp parallel for num_threads(nt) schedule(dynamic, 4)
#endif
    for (int g = g0; g < g1; g++) r16_repack_groups(t, W, rows, cols, R, g, g + 1);
    (void)nthreads;
}

#ifdef RQ_HAVE_X86
/* Token tile i (8 tokens, fewer at the end: zero-padded) in the AVX2 prefill kernels' form. */
static void r16_prep_pf8_tile(int t, const rq_act *acts, int ntok, int i, int nb, uint8_t *mem, tile *tl) {
    const int k0 = 8 * i, T = ntok - k0 < 8 ? ntok - k0 : 8;
    memset(tl, 0, sizeof(*tl));
    tl->T = T;
    if (T < 8) memset(mem, 0, pf8_tile_bytes(nb));
    prep_tile_pf8(t, acts + k0, T, nb, mem, tl);
}

static void r16_matmul(int t, const uint8_t *R, int rows, int cols, const rq_act *acts, int ntok, float *out,
                       int ldo, int nthreads) {
    const int nb = cols / QK, ng = (rows + 15) / 16;
    const int expand = ntok >= R16_EXPAND_MIN_TOK;
    v16_toks tk = {nb, (ntok + 7) / 8, NULL, NULL};
    tk.mem = aligned_alloc(64, (size_t)tk.ntiles * nb * V16_TILE_BLOCK_BYTES);
    uint8_t *pf8mem = NULL;
    if (expand && rq_kernel_path() == RQ_PATH_AVX2 && pf8_type(t, 1)) {   /* see r16_to_pf8_rows_256 */
        tk.pf8 = calloc((size_t)tk.ntiles, sizeof(tile));
        pf8mem = aligned_alloc(64, (size_t)tk.ntiles * ((pf8_tile_bytes(nb) + 63) & ~(size_t)63));
        if (!tk.pf8 || !pf8mem) { free(tk.pf8); free(pf8mem); tk.pf8 = NULL; pf8mem = NULL; }
    }
    int nt = 1;
#ifdef _OPENMP
    nt = nthreads > 0 ? nthreads : omp_get_max_threads();
    if (!expand && r16_bytes(t, rows, cols) < RQ_SERIAL_BYTES) nt = 1;
#endif
    if (nt > ng) nt = ng;
    size_t vb = (v16_group_bytes(nb) + 63) & ~(size_t)63;
    if (16 * pf8_urow_bytes(nb) > vb) vb = 16 * pf8_urow_bytes(nb);   /* the buffer also holds pf8 rows */
    int gmax = (int)(V16_L2_BYTES / vb);
    gmax = gmax < 1 ? 1 : gmax > 8 ? 8 : gmax;
    uint8_t *grp = expand ? aligned_alloc(64, vb * (size_t)gmax * (size_t)nt) : NULL;
    r16_groups_fn fn = r16_path_kernel(rq_kernel_path(), t);
    if (!tk.mem || (expand && !grp)) {   /* out of memory: NaN, as for an unsupported type */
        free(tk.mem);
        free(grp);
        free(tk.pf8);
        free(pf8mem);
        fill_nan(0, rows, ntok, out, ldo);
        return;
    }
    const size_t pf8b = (pf8_tile_bytes(nb) + 63) & ~(size_t)63;
    if (nt <= 1) {
        for (int i = 0; i < tk.ntiles; i++) v16_prep_tile(t, acts, ntok, i, &tk);
        for (int i = 0; tk.pf8 && i < tk.ntiles; i++) r16_prep_pf8_tile(t, acts, ntok, i, nb, pf8mem + pf8b * (size_t)i, &tk.pf8[i]);
        fn(R, rows, 0, ng, nb, ntok, &tk, out, ldo, grp, gmax);
    } else {
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
        {
#pragma omp for schedule(static)
            for (int i = 0; i < tk.ntiles; i++) {
                v16_prep_tile(t, acts, ntok, i, &tk);
                if (tk.pf8) r16_prep_pf8_tile(t, acts, ntok, i, nb, pf8mem + pf8b * (size_t)i, &tk.pf8[i]);
            }
            if (expand) {
                const int nch = (ng + gmax - 1) / gmax;
                uint8_t *mine = grp + vb * (size_t)gmax * (size_t)omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
                for (int c = 0; c < nch; c++) {
                    const int g0 = c * gmax, g1 = g0 + gmax < ng ? g0 + gmax : ng;
                    fn(R, rows, g0, g1, nb, ntok, &tk, out, ldo, mine, gmax);
                }
            } else {   /* decode-sized: one contiguous share of the groups per thread, by bytes */
                const int me = omp_get_thread_num(), nth = omp_get_num_threads();
                const int g0 = (int)((long)ng * me / nth), g1 = (int)((long)ng * (me + 1) / nth);
                if (g1 > g0) fn(R, rows, g0, g1, nb, ntok, &tk, out, ldo, NULL, gmax);
            }
        }
#endif
    }
    free(tk.mem);
    free(grp);
    free(tk.pf8);
    free(pf8mem);
}
#endif

void rq_matmul_r16(int t, const void *W, const void *R, int rows, int cols, const rq_act *acts, int ntok,
                   float *out, int ldo, int nthreads) {
    rq_kernels_init();
#ifdef RQ_HAVE_X86
    if (R && rows > 0 && ntok > 0 && r16_type(t) && rq_r16_usable()) {
        r16_matmul(t, R, rows, cols, acts, ntok, out, ldo, nthreads);
        return;
    }
#endif
    rq_matmul(t, W, rows, cols, acts, ntok, out, ldo, nthreads);
}

/* First row of op (byte offset `base` in the concatenation, rb bytes a row, rows rows) at or
 * after byte `at`, rounded up to 16 rows: neighbouring threads' ranges meet exactly. */
static int multi_row_at(size_t at, size_t base, size_t rb, int rows) {
    if (at <= base) return 0;
    size_t r = (at - base + rb - 1) / rb;
    r = (r + 15) / 16 * 16;
    return r > (size_t)rows ? rows : (int)r;
}

#ifdef RQ_HAVE_X86
/* Decode-sized calls (ntok <= 2) whose ops all have R16 copies: one parallel job over the ops'
 * concatenated groups, split by bytes, with one token tile (q/k/v or gate/up of a decode step pay
 * for one region and one tile, not one per op). Returns -1 when it does not apply. */
static int r16_matmul_multi(const rq_matmul_op *ops, int nops, int cols, const rq_act *acts, int ntok, int nthreads) {
    if (ntok > 2 || nops > 8) return -1;
    size_t gb[8], total = 0;
    for (int i = 0; i < nops; i++) {
        if (!ops[i].r16 || !r16_type(ops[i].type)) return -1;
        gb[i] = r16_group_bytes_t(ops[i].type, cols / QK);
        total += gb[i] * (size_t)((ops[i].rows + 15) / 16);
    }
    const int nb = cols / QK;
    const size_t tbytes = (size_t)nb * V16_TILE_BLOCK_BYTES;
    uint8_t *mem = aligned_alloc(64, tbytes * (size_t)nops);
    if (!mem) return -1;
    v16_toks tk[8];
    for (int i = 0; i < nops; i++) {   /* one tile per op: nq depends on the type's offset */
        tk[i].nb = nb;
        tk[i].ntiles = 1;
        tk[i].mem = mem + tbytes * (size_t)i;
        v16_prep_tile(ops[i].type, acts, ntok, 0, &tk[i]);
    }
    int nt = 1;
#ifdef _OPENMP
    nt = nthreads > 0 ? nthreads : omp_get_max_threads();
    if (total < RQ_SERIAL_BYTES) nt = 1;
#endif
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
    {
        int me = 0, nth = 1;
#ifdef _OPENMP
        me = omp_get_thread_num();
        nth = omp_get_num_threads();
#endif
        const size_t lo = total * (size_t)me / (size_t)nth, hi = total * (size_t)(me + 1) / (size_t)nth;
        size_t base = 0;
        for (int i = 0; i < nops; i++) {
            const int ng = (ops[i].rows + 15) / 16;
            const size_t end = base + gb[i] * (size_t)ng;
            /* groups whose first byte lies in [lo, hi) */
            const int g0 = lo <= base ? 0 : (int)((lo - base + gb[i] - 1) / gb[i]);
            const int g1 = hi >= end ? ng : (int)((hi - base + gb[i] - 1) / gb[i]);
            if (g1 > g0 && g0 < ng)
                r16_path_kernel(rq_kernel_path(), ops[i].type)(ops[i].r16, ops[i].rows, g0, g1 < ng ? g1 : ng, nb, ntok, &tk[i], ops[i].out, ops[i].ldo, NULL, 1);
            base = end;
        }
    }
    free(mem);
    return 0;
}
#endif

void rq_matmul_multi(const rq_matmul_op *ops, int nops, int cols, const rq_act *acts, int ntok, int nthreads) {
    rq_kernels_init();
    if (rq_r16_usable()) {
        int any = 0;
        for (int i = 0; i < nops; i++) any |= ops[i].r16 != NULL;
        if (any) {
#ifdef RQ_HAVE_X86
            if (r16_matmul_multi(ops, nops, cols, acts, ntok, nthreads) == 0) return;
#endif
            /* many tokens or mixed ops: one by one (each splits its groups across the threads) */
            for (int i = 0; i < nops; i++)
                rq_matmul_r16(ops[i].type, ops[i].W, ops[i].r16, ops[i].rows, cols, acts, ntok, ops[i].out, ops[i].ldo, nthreads);
            return;
        }
    }
    size_t total = 0;
    int simple = ntok > 2;
    for (int i = 0; i < nops; i++) {
        if (!rq_type_supported(ops[i].type)) simple = 1;
        total += rq_row_bytes(ops[i].type, cols) * (size_t)ops[i].rows;
    }
#ifdef _OPENMP
    int nt = nthreads > 0 ? nthreads : omp_get_max_threads();
    if (total < RQ_SERIAL_BYTES) nt = 1;
#else
    int nt = 1;
#endif
    if (simple || nt <= 1) {
        for (int i = 0; i < nops; i++)
            rq_matmul(ops[i].type, ops[i].W, ops[i].rows, cols, acts, ntok, ops[i].out, ops[i].ldo, nthreads);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
    {
        const int me = omp_get_thread_num(), nth = omp_get_num_threads();
        const size_t lo = total * (size_t)me / (size_t)nth, hi = total * (size_t)(me + 1) / (size_t)nth;
        size_t base = 0;
        for (int i = 0; i < nops; i++) {
            const size_t rb = rq_row_bytes(ops[i].type, cols);
            const int r0 = multi_row_at(lo, base, rb, ops[i].rows);
            const int r1 = me == nth - 1 ? ops[i].rows : multi_row_at(hi, base, rb, ops[i].rows);
            if (r1 > r0) rq_matmul_rows(ops[i].type, ops[i].W, cols, r0, r1, acts, ntok, ops[i].out, ops[i].ldo);
            base += rb * (size_t)ops[i].rows;
        }
    }
#endif
}

void rq_matmul_team(int t, const void *W, int rows, int cols,
                    const rq_act *acts, int ntok, float *out, int ldo) {
    rq_kernels_init();
    if (rows <= 0 || ntok <= 0) return;
#ifdef _OPENMP
    if (omp_get_num_threads() > 1) {
        matmul_in_team(t, W, rows, cols, acts, ntok, out, ldo, 1);   /* ends with a barrier */
        return;
    }
#endif
    rq_matmul_rows(t, W, cols, 0, rows, acts, ntok, out, ldo);
}

void rq_matmul_ref(int t, const void *W, int rows, int cols,
                   const rq_act *acts, int ntok, float *out, int ldo) {
    size_t rb = rq_row_bytes(t, cols);
    float *buf = malloc((size_t)cols * sizeof(float));
    if (!buf) return;
    for (int r = 0; r < rows; r++) {
        rq_dequant_row(t, (const uint8_t *)W + (size_t)r * rb, buf, cols);
        for (int k = 0; k < ntok; k++) {
            const float *x = acts[k].f;
            double s = 0.0;
            for (int i = 0; i < cols; i++) s += (double)buf[i] * (double)x[i];
            out[(size_t)k * ldo + r] = (float)s;
        }
    }
    free(buf);
}
