/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). The tables over all types, after the types' files: TRAITS (what every
 * part of the kernels asks about a type), the public type table, the by-type switches of the
 * scalar paths (dequantization, reference dot products), and on x86 KERNELS (every SIMD kernel
 * of a type), checked against TRAITS in rq_kernels_init. */

/* ------------------------------------------------------------------------------------------ */
/* Type traits (the row type and its accessors: common.c)                                      */

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
    [RQ_Q5_K] = {QK_K, sizeof(blk_q5_K), 0, 0, 1, 0, 1, 1},
    [RQ_Q6_K] = {QK_K, sizeof(blk_q6_K), 0, 32, 0, 0, 1, 1},
    [RQ_IQ4_NL] = {QK, sizeof(blk_iq4_nl), 2, 128, 0, 0, 1, 0},
    [RQ_IQ4_XS] = {QK_K, sizeof(blk_iq4_xs), 0, 128, 0, 0, 1, 0},
};

/* The traits of t; an all-zero row (block_elems 0) for an unknown type. */
static inline const type_traits *traits(int t) {
    static const type_traits none = {0};
    return t >= 0 && t <= RQ_BF16 && TRAITS[t].block_elems ? &TRAITS[t] : &none;
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
    case RQ_F32: dequant_f32(row, y, n); return;
    case RQ_F16: dequant_f16(row, y, n); return;
    case RQ_BF16: dequant_bf16(row, y, n); return;
    case RQ_Q4_0: dequant_q4_0(row, y, n); return;
    case RQ_Q4_1: dequant_q4_1(row, y, n); return;
    case RQ_Q5_0: dequant_q5_0(row, y, n); return;
    case RQ_Q5_1: dequant_q5_1(row, y, n); return;
    case RQ_Q8_0: dequant_q8_0(row, y, n); return;
    case RQ_Q2_K: dequant_q2_K(row, y, n); return;
    case RQ_Q3_K: dequant_q3_K(row, y, n); return;
    case RQ_Q4_K: dequant_q4_K(row, y, n); return;
    case RQ_Q5_K: dequant_q5_K(row, y, n); return;
    case RQ_Q6_K: dequant_q6_K(row, y, n); return;
    case RQ_IQ4_NL: dequant_iq4_nl(row, y, n); return;
    case RQ_IQ4_XS: dequant_iq4_xs(row, y, n); return;
    default:
        for (int i = 0; i < n; i++) y[i] = NAN;
        return;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Scalar reference dot products (each type's dot_*_ref is in its file)                        */

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
    case RQ_IQ4_NL: return dot_iq4_nl_ref;
    case RQ_IQ4_XS: return dot_iq4_xs_ref;
    default: return NULL;
    }
}

float rq_vec_dot_ref(int t, int n, const void *row, const rq_act *x) {
    dot_fn f = ref_dot(t);
    return f ? f(n, row, x) : NAN;
}

#ifdef RQ_HAVE_X86

/* Every SIMD kernel of a type, by family; NULL where the family does not cover it (TRAITS says
 * which do: rq_kernels_init checks that the two agree). */
typedef struct {
    kern_fn k256;              /* AVX2 row x token tile (every type but the legacy ones: r256 runs all their tiles) */
    rows_fn r256;              /* AVX2 slot-packed rows (packed types) */
    pf8_unpack_fn pf8u;        /* AVX2 8-token prefill (pf8 types) */
    pf8_rows_fn pf8r;
    v16_rows_fn v16;           /* AVX-512 16-row prefill (packed types) */
    r16_groups_fn r16_512;     /* R16 layout (packed types) */
    r16_groups_fn r16_256;
} type_kernels;

#define PACKED_KERNELS(sfx) k256_##sfx, r256_##sfx
#define SLOT_KERNELS(sfx) NULL, r256_##sfx
#define LAYOUT_KERNELS(sfx) v16r_##sfx, r16g_##sfx, r16g256_##sfx
static const type_kernels KERNELS[RQ_BF16 + 1] = {
    [RQ_F32] = {k256_f32},
    [RQ_F16] = {k256_f16},
    [RQ_BF16] = {k256_bf16},
    [RQ_Q2_K] = {k256_q2_K},
    [RQ_Q3_K] = {k256_q3_K},
    [RQ_Q4_0] = {SLOT_KERNELS(q4_0), pf8u_q4_0, pf8r_q4_0, LAYOUT_KERNELS(q4_0)},
    [RQ_Q4_1] = {SLOT_KERNELS(q4_1), pf8u_q4_1, pf8r_q4_1, LAYOUT_KERNELS(q4_1)},
    [RQ_Q5_0] = {SLOT_KERNELS(q5_0), pf8u_q5_0, pf8r_q5_0, LAYOUT_KERNELS(q5_0)},
    [RQ_Q5_1] = {SLOT_KERNELS(q5_1), pf8u_q5_1, pf8r_q5_1, LAYOUT_KERNELS(q5_1)},
    [RQ_Q8_0] = {SLOT_KERNELS(q8_0), NULL, NULL, LAYOUT_KERNELS(q8_0)},
    [RQ_Q4_K] = {PACKED_KERNELS(q4_K), pf8u_q4_K, pf8r_q4_K, LAYOUT_KERNELS(q4_K)},
    [RQ_Q5_K] = {PACKED_KERNELS(q5_K), pf8u_q5_K, pf8r_q5_K, LAYOUT_KERNELS(q5_K)},
    [RQ_Q6_K] = {PACKED_KERNELS(q6_K), pf8u_q6_K, pf8r_q6_K, LAYOUT_KERNELS(q6_K)},
    /* the signed types have no pf8 kernels: see iq4_nl.c */
    [RQ_IQ4_NL] = {SLOT_KERNELS(iq4_nl), NULL, NULL, LAYOUT_KERNELS(iq4_nl)},
    [RQ_IQ4_XS] = {PACKED_KERNELS(iq4_xs), NULL, NULL, LAYOUT_KERNELS(iq4_xs)},
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
        if (!(k->k256 || k->r256) || packed != tr->packed || (k->r256 || k->v16 || k->r16_512 || k->r16_256) != tr->packed ||
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
