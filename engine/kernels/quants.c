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

int rq_type_supported(int t) {
    switch (t) {
    case RQ_F32: case RQ_F16: case RQ_BF16:
    case RQ_Q4_0: case RQ_Q4_1: case RQ_Q5_0: case RQ_Q5_1: case RQ_Q8_0:
    case RQ_Q2_K: case RQ_Q3_K: case RQ_Q4_K: case RQ_Q5_K: case RQ_Q6_K:
        return 1;
    default:
        return 0;
    }
}

int rq_block_elems(int t) {
    switch (t) {
    case RQ_F32: case RQ_F16: case RQ_BF16: return 1;
    case RQ_Q4_0: case RQ_Q4_1: case RQ_Q5_0: case RQ_Q5_1: case RQ_Q8_0: return QK;
    case RQ_Q2_K: case RQ_Q3_K: case RQ_Q4_K: case RQ_Q5_K: case RQ_Q6_K: return QK_K;
    default: return 0;
    }
}

int rq_block_bytes(int t) {
    switch (t) {
    case RQ_F32: return 4;
    case RQ_F16: case RQ_BF16: return 2;
    case RQ_Q4_0: return sizeof(blk_q4_0);
    case RQ_Q4_1: return sizeof(blk_q4_1);
    case RQ_Q5_0: return sizeof(blk_q5_0);
    case RQ_Q5_1: return sizeof(blk_q5_1);
    case RQ_Q8_0: return sizeof(blk_q8_0);
    case RQ_Q2_K: return sizeof(blk_q2_K);
    case RQ_Q3_K: return sizeof(blk_q3_K);
    case RQ_Q4_K: return sizeof(blk_q4_K);
    case RQ_Q5_K: return sizeof(blk_q5_K);
    case RQ_Q6_K: return sizeof(blk_q6_K);
    default: return 0;
    }
}

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

void rq_quantize_act(const float *x, int n, rq_act *a) {
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
        a->d[b] = d;
        int8_t *q = a->qs + 32 * b;
        int s0 = 0, s1 = 0;
        for (int j = 0; j < 32; j++) {
            int v = (int)roundf(xb[j] * id);
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
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
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
               __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
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

static dot_fn path_dot(int path, int t) {
    (void)path;
    return ref_dot(t);
}

float rq_vec_dot(int t, int n, const void *row, const rq_act *x) {
    dot_fn f = path_dot(rq_kernel_path(), t);
    return f ? f(n, row, x) : NAN;
}

static void matmul_rows_generic(dot_fn f, int t, const void *W, int cols, int r0, int r1,
                                const rq_act *acts, int ntok, float *out, int ldo) {
    size_t rb = rq_row_bytes(t, cols);
    const uint8_t *w = W;
    for (int r = r0; r < r1; r++) {
        const void *row = w + (size_t)r * rb;
        for (int k = 0; k < ntok; k++) out[(size_t)k * ldo + r] = f(cols, row, &acts[k]);
    }
}

void rq_matmul_rows(int t, const void *W, int cols, int r0, int r1,
                    const rq_act *acts, int ntok, float *out, int ldo) {
    if (r1 <= r0 || ntok <= 0) return;
    int path = rq_kernel_path();
    dot_fn f = path_dot(path, t);
    if (!f) {
        for (int k = 0; k < ntok; k++)
            for (int r = r0; r < r1; r++) out[(size_t)k * ldo + r] = NAN;
        return;
    }
    matmul_rows_generic(f, t, W, cols, r0, r1, acts, ntok, out, ldo);
}

void rq_matmul(int t, const void *W, int rows, int cols,
               const rq_act *acts, int ntok, float *out, int ldo, int nthreads) {
    rq_kernels_init();
    if (rows <= 0 || ntok <= 0) return;
#ifdef _OPENMP
    int nt = nthreads > 0 ? nthreads : omp_get_max_threads();
    /* Enough rows per chunk to amortize the per-row work; chunks aligned to 16 rows. */
    int nchunk = (rows + 15) / 16;
    if (nt > nchunk) nt = nchunk;
    if (nt <= 1) {
        rq_matmul_rows(t, W, cols, 0, rows, acts, ntok, out, ldo);
        return;
    }
#pragma omp parallel num_threads(nt)
    {
        int ith = omp_get_thread_num(), nth = omp_get_num_threads();
        int c0 = (int)((long)nchunk * ith / nth), c1 = (int)((long)nchunk * (ith + 1) / nth);
        int r0 = c0 * 16, r1 = c1 * 16 < rows ? c1 * 16 : rows;
        rq_matmul_rows(t, W, cols, r0, r1, acts, ntok, out, ldo);
    }
#else
    (void)nthreads;
    rq_matmul_rows(t, W, cols, 0, rows, acts, ntok, out, ldo);
#endif
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
