/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). Dispatch: which kernels a path uses for a type (from OPS), the
 * kernel path (one process-wide state, g_path), the dispatched activation quantization and
 * single dot product. */

/* Kernels for (path, type) and the largest token tile they take; 0: use the scalar reference.
 * *k: one row against a tile, or NULL; *rk: the multi-row kernel of the slot-packed types, or
 * NULL: they pack (row, token) slots (see legacy_slots_256, krows_256), need the tile's
 * td4/nq4/ds4 arrays, and run every tile a matmul gives them (the legacy types have no *k). */
static int simd_kernels(int path, int t, kern_fn *k, rows_fn *rk, int *tmax, int *ub) {
    *k = NULL;
    *rk = NULL;
    *tmax = 1;
    *ub = 1;
#ifdef RQ_HAVE_X86
    if (path == RQ_PATH_AVX512) path = RQ_PATH_AVX2;   /* see the top of v16.c */
    if (path == RQ_PATH_AVX2) {
        *tmax = pf8_type(t, 1) ? 8 : TMAX2;   /* 8-token tiles: pf8_row_256 */
        *k = ops(t)->k256;
        *rk = slot_packed(t, *ub) ? ops(t)->r256 : NULL;
    }
#else
    (void)path; (void)t;
#endif
    return *k || *rk;
}

/* 8-token prefill kernels for (path, type) (see pf8_row_256): 0 if none. */
static int simd_pf8(int path, int t, pf8_unpack_fn *u, pf8_rows_fn *r) {
    *u = NULL;
    *r = NULL;
#ifdef RQ_HAVE_X86
    if (path == RQ_PATH_AVX512 || path == RQ_PATH_AVX2) {
        *u = ops(t)->pf8u;
        *r = ops(t)->pf8r;
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
    kern_fn k;
    rows_fn rk;
    if (path == RQ_PATH_SCALAR || !simd_kernels(path, t, &k, &rk, &tmax, &ub)) return rq_vec_dot_ref(t, n, row, x);
    int nb = n / QK;
    size_t need = tile_bytes(t, ub, 1, nb);
    _Alignas(64) uint8_t sbuf[8192];
    uint8_t *mem = need <= sizeof(sbuf) ? sbuf : aligned_alloc(64, need);
    if (!mem) return rq_vec_dot_ref(t, n, row, x);
    tile tl;
    prep_tile(t, ub, x, 1, nb, mem, &tl);
    float res = 0.0f;
    if (rk) rk(row, rq_row_bytes(t, n), 0, 1, n, &tl, &res, 1, 0);
    else k(row, n, &tl, &res);
    if (mem != sbuf) free(mem);
    return res;
}
