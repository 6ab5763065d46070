/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). The one op table over the types, after the types' files: a type's row is its block layout
 * (type_traits: what every part of the kernels asks about a type), its dequantization and reference
 * dot product (the scalar ground truth), and on x86 the entry point of every SIMD kernel family
 * that covers it. Adding a type is one row here (and its file). Then the public type table and the
 * scalar entry points, which read it; dispatch.c's plan() picks a row's kernels for a matmul. */

typedef void (*dequant_fn)(const void *row, float *y, int n);

typedef struct {
    type_traits layout;
    dequant_fn dequant;
    dot_fn ref_dot;
#ifdef RQ_HAVE_X86
    kern_fn k256;              /* AVX2 row x token tile (every type but the legacy ones: r256 runs all their tiles) */
    rows_fn r256;              /* AVX2 slot-packed rows (packed types) */
    pf8_unpack_fn pf8u;        /* AVX2 8-token prefill (pf8 types) */
    pf8_rows_fn pf8r;
    v16_rows_fn v16;           /* AVX-512 16-row prefill (packed types) */
    r16_groups_fn r16_512;     /* R16 layout (packed types) */
    r16_groups_fn r16_256;
    r16_groups_fn r16_vnni;    /* R16 on AVX2 with AVX-VNNI (rq_avxvnni) */
#endif
} type_ops;

/* A row: TYPE (layout: block elements, bytes, qs_at, offset, min, float; the scalar twins by suffix),
 * then the families that cover the type. A family's macro sets its flag in the layout (packed, pf8)
 * with its entry points, so the flags the kernels read and the kernels present cannot disagree. */
#ifdef RQ_HAVE_X86
#define X86_OPS(...) , __VA_ARGS__
#else
#define X86_OPS(...)
#endif
#define TYPE(sfx, elems, bytes, qs_at, offset, has_min, is_float) \
    .layout = {elems, bytes, qs_at, offset, has_min, is_float}, .dequant = dequant_##sfx, .ref_dot = dot_##sfx##_ref
#define TILE_KERNEL(sfx) X86_OPS(.k256 = k256_##sfx)
#define PACKED_KERNELS(sfx) \
    , .layout.packed = 1 X86_OPS(.r256 = r256_##sfx, .v16 = v16r_##sfx, .r16_512 = r16g_##sfx, .r16_256 = r16g256_##sfx, \
                                        .r16_vnni = r16gv_##sfx)
#define PF8_KERNELS(sfx) , .layout.pf8 = 1 X86_OPS(.pf8u = pf8u_##sfx, .pf8r = pf8r_##sfx)

static const type_ops OPS[RQ_BF16 + 1] = {
    [RQ_F32] = {TYPE(f32, 1, 4, 0, 0, 0, 1) TILE_KERNEL(f32)},
    [RQ_F16] = {TYPE(f16, 1, 2, 0, 0, 0, 1) TILE_KERNEL(f16)},
    [RQ_BF16] = {TYPE(bf16, 1, 2, 0, 0, 0, 1) TILE_KERNEL(bf16)},
    [RQ_Q4_0] = {TYPE(q4_0, QK, sizeof(blk_q4_0), 2, 8, 0, 0) PACKED_KERNELS(q4_0) PF8_KERNELS(q4_0)},
    [RQ_Q4_1] = {TYPE(q4_1, QK, sizeof(blk_q4_1), 4, 0, 1, 0) PACKED_KERNELS(q4_1) PF8_KERNELS(q4_1)},
    [RQ_Q5_0] = {TYPE(q5_0, QK, sizeof(blk_q5_0), 6, 16, 0, 0) PACKED_KERNELS(q5_0) PF8_KERNELS(q5_0)},
    [RQ_Q5_1] = {TYPE(q5_1, QK, sizeof(blk_q5_1), 8, 0, 1, 0) PACKED_KERNELS(q5_1) PF8_KERNELS(q5_1)},
    [RQ_Q8_0] = {TYPE(q8_0, QK, sizeof(blk_q8_0), 2, 128, 0, 0) PACKED_KERNELS(q8_0)},
    [RQ_Q2_K] = {TYPE(q2_K, QK_K, sizeof(blk_q2_K), 0, 0, 1, 0) TILE_KERNEL(q2_K)},
    [RQ_Q3_K] = {TYPE(q3_K, QK_K, sizeof(blk_q3_K), 0, 4, 0, 0) TILE_KERNEL(q3_K)},
    [RQ_Q4_K] = {TYPE(q4_K, QK_K, sizeof(blk_q4_K), 0, 0, 1, 0) TILE_KERNEL(q4_K) PACKED_KERNELS(q4_K) PF8_KERNELS(q4_K)},
    [RQ_Q5_K] = {TYPE(q5_K, QK_K, sizeof(blk_q5_K), 0, 0, 1, 0) TILE_KERNEL(q5_K) PACKED_KERNELS(q5_K) PF8_KERNELS(q5_K)},
    [RQ_Q6_K] = {TYPE(q6_K, QK_K, sizeof(blk_q6_K), 0, 32, 0, 0) TILE_KERNEL(q6_K) PACKED_KERNELS(q6_K) PF8_KERNELS(q6_K)},
    /* the signed types have no pf8 kernels: see iq4_nl.c */
    [RQ_IQ4_NL] = {TYPE(iq4_nl, QK, sizeof(blk_iq4_nl), 2, 128, 0, 0) PACKED_KERNELS(iq4_nl)},
    [RQ_IQ4_XS] = {TYPE(iq4_xs, QK_K, sizeof(blk_iq4_xs), 0, 128, 0, 0) TILE_KERNEL(iq4_xs) PACKED_KERNELS(iq4_xs)},
};

/* The row of t; an all-zero row (block_elems 0, no functions) for an unknown type. */
static inline const type_ops *ops(int t) {
    static const type_ops none = {{0}};
    return t >= 0 && t <= RQ_BF16 && OPS[t].layout.block_elems ? &OPS[t] : &none;
}

static inline const type_traits *traits(int t) { return &ops(t)->layout; }

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
    const dequant_fn f = ops(t)->dequant;
    if (f) {
        f(row, y, n);
        return;
    }
    for (int i = 0; i < n; i++) y[i] = NAN;
}

/* ------------------------------------------------------------------------------------------ */
/* Scalar reference dot products (each type's dot_*_ref is in its file)                        */

static dot_fn ref_dot(int t) { return ops(t)->ref_dot; }

float rq_vec_dot_ref(int t, int n, const void *row, const rq_act *x) {
    need_act_span(t, x, 1);
    dot_fn f = ref_dot(t);
    return f ? f(n, row, x) : NAN;
}
