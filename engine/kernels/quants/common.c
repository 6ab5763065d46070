/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). What every type and kernel shares: block constants, the type_traits row and
 * its accessors (the rows are in tables.c's OPS table, after the types' block structs), f16 /
 * bf16 conversions, byte loads, the K types' packed 12-byte scale format (Q4_K, Q5_K), kernel
 * macros. */

/* ------------------------------------------------------------------------------------------ */
/* Block sizes (ggml); each type's block struct is in its file                                 */

#define QK 32
#define QK_K 256

/* ------------------------------------------------------------------------------------------ */
/* Type traits: what every part of the kernels asks about a type (the layout of OPS, tables.c) */

typedef struct {
    int block_elems, block_bytes;
    int qs_at;     /* legacy types: where the quants start in a block */
    int offset;    /* the kernels' unsigned weight u = value + offset (0: unsigned already) */
    int has_min;   /* the block subtracts min * (sum of activations) */
    int is_float;  /* F32/F16/BF16: multiplied with the f32 activations */
    int packed;    /* has the interleaved kernels: AVX2 slot-packed rows, AVX-512 v16, the R16 layout */
    int pf8;       /* has the AVX2 8-token prefill kernels */
} type_traits;

static inline const type_traits *traits(int t);

static inline int is_float_type(int t) { return traits(t)->is_float; }
static inline int type_offset(int t) { return traits(t)->offset; }
static inline int type_has_min(int t) { return traits(t)->has_min; }
/* Signed 8-bit values (offset 128: Q8_0, IQ4_NL, IQ4_XS). As value + 128 they would overflow the
 * int16 pair sums of vpmaddubsw (2 x 241 x 127 > 32767), so the AVX2 kernels multiply the signed
 * values through the sign trick (|w| x sign(q, w): pairs <= 2 x 127 x 127) and get offset-free
 * sums; vpdpbusd (AVX-512) has no int16 stage and takes value + 128 with the offset correction. */
static inline int type_s8(int t) { return traits(t)->offset == 128; }
/* Types whose kernels add a super-block's 8 block sums up in int32, each times its integer block
 * scale, before one float step (Q4_K, IQ4_XS: see their files' float sequences). They need the
 * token's activations with one scale per 256 values (rq_act_span 256, ggml's Q8_K). */
static inline int type_sb_int(int t) { return t == RQ_Q4_K || t == RQ_IQ4_XS; }
/* The signed types of 32-value blocks (Q8_0, IQ4_NL): their kernels join a block's two exact half
 * sums in int32 and take one float step per block (legacy.c's slot sequence, the halves joined). */
static inline int type_s8_block(int t) { return type_s8(t) && !type_sb_int(t); }

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
static inline uint16_t load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* ------------------------------------------------------------------------------------------ */
/* Shared block formats                                                                        */

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

/* Q4_K/Q5_K 12-byte scales -> 8 scales (u0,u1) and 8 mins (u2,u3) as bytes, in registers
 * (building the vector from an array in memory would stall on store forwarding). */
static inline void k4_unpack(const uint8_t *s, uint32_t *o0, uint32_t *o1, uint32_t *o2, uint32_t *o3) {
    uint32_t a0 = load_u32(s), a1 = load_u32(s + 4), a2 = load_u32(s + 8);
    *o0 = a0 & 0x3f3f3f3fu;
    *o1 = (a2 & 0x0f0f0f0fu) | (((a0 >> 6) & 0x03030303u) << 4);
    *o2 = a1 & 0x3f3f3f3fu;
    *o3 = ((a2 >> 4) & 0x0f0f0f0fu) | (((a1 >> 6) & 0x03030303u) << 4);
}

/* ------------------------------------------------------------------------------------------ */
/* Helpers of the scalar reference dot products (each type's dot_*_ref is in its file)          */

static inline int dot32_u(const uint8_t *w, const int8_t *q) {
    int s = 0;
    for (int j = 0; j < 32; j++) s += (int)w[j] * (int)q[j];
    return s;
}

/* The K types whose scales cover 16 values (Q2_K, Q3_K, Q6_K): the integer sums of super-block i's
 * unpacked values u[256] against its activations, per 16 values (half[2j], half[2j + 1]: block j). */
static inline void dot16_halves(const uint8_t *u, const rq_act *x, int i, int half[16]) {
    for (int j = 0; j < 8; j++) {
        const int8_t *xq = x->qs + 32 * (i * 8 + j);
        int i0 = 0, i1 = 0;
        for (int l = 0; l < 16; l++) { i0 += u[32 * j + l] * xq[l]; i1 += u[32 * j + 16 + l] * xq[16 + l]; }
        half[2 * j] = i0;
        half[2 * j + 1] = i1;
    }
}

/* Q3_K and Q6_K: add super-block i (values u - off, signed scales sc[16], scale d) to *s, block by block. */
static inline void dot16_signed_add(const uint8_t *u, const int8_t *sc, int off, float d, const rq_act *x, int i,
                                    float *s) {
    int half[16];
    dot16_halves(u, x, i, half);
    for (int j = 0; j < 8; j++) {
        const int blk = i * 8 + j;
        const int i0 = half[2 * j] - off * x->sum16[2 * blk], i1 = half[2 * j + 1] - off * x->sum16[2 * blk + 1];
        *s += d * x->d[blk] * (float)(sc[2 * j] * i0 + sc[2 * j + 1] * i1);
    }
}

typedef float (*dot_fn)(int n, const void *row, const rq_act *x);

/* ------------------------------------------------------------------------------------------ */
/* Kernel macros                                                                               */

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

#ifdef RQ_HAVE_X86
#define A256 __attribute__((target("avx2,fma,f16c")))   /* simd.h: A512 */
#endif
