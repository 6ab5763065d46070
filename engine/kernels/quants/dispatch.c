/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). Dispatch: the planner (which kernel family and entry points from OPS a matmul uses), the
 * kernel path (one process-wide state, g_path), the dispatched activation quantization and
 * single dot product. */

/* ------------------------------------------------------------------------------------------ */
/* The planner: how a matmul computes                                                          */

/* How decode-sized calls (one token tile: ntok <= 8) with R16 copies compute: chosen by timing at
 * load (engine/decode_tuning.py), since which is fastest depends on the CPU (a core that splits
 * 512-bit operations can stream faster with the AVX2 kernels) and on the thread count. Every mode
 * gives the same results bit for bit. */
static signed char decode_mode[RQ_BF16 + 1];   /* per type; 0: RQ_DECODE_R16 */

/* AVX-VNNI under the AVX2 path (the r16_vnni kernels): on where the CPU has it, unless RQLLM_AVXVNNI=0
 * (set by rq_kernels_init; tests switch it with rq_set_avxvnni). The same results either way. */
static int g_avxvnni = -1;

enum {
    PLAN_NONE,    /* the type is not supported: the drivers write NaN */
    PLAN_REF,     /* the scalar reference, row by row */
    PLAN_TILES,   /* GGUF layout, rows against token tiles: k or rk, with pf8 for tiles of T >= PF8_MIN_T */
    PLAN_V16,     /* GGUF layout, AVX-512 prefill: rows expanded 16 at a time (v16.c) */
    PLAN_R16,     /* R16 copies (r16.c): packed, or expanded when `expand` */
};

/* A matmul's plan: the kernel family and its entry points and tiling. The GGUF-layout tile kernels
 * are filled in whenever the path has them, also under PLAN_V16: they are what a driver falls back
 * to when the V16 buffers cannot be allocated. */
typedef struct {
    int family;
    kern_fn k;             /* one row against a token tile, or NULL */
    rows_fn rk;            /* slot-packed rows (see legacy_slots_256, krows_256), or NULL; needs the tile's
                            * td4/nq4/ds4 arrays, and runs every tile a matmul gives it */
    int tmax, ub;          /* the largest token tile, the tile's slot unit */
    pf8_unpack_fn pf8u;    /* 8-token prefill (see pf8_row_256), when ntok >= PF8_MIN_T, or NULL */
    pf8_rows_fn pf8r;
    v16_rows_fn v16;       /* PLAN_V16 */
    r16_groups_fn r16;     /* PLAN_R16 */
    int expand;            /* PLAN_R16: the expanding (prefill) form, which needs group buffers */
} matmul_plan;

/* The one routing between the kernel families, used by every matmul driver and the dispatched
 * dot: a call of ntok tokens of type t on a path, on R16 copies when `r16` (the caller has them).
 * - R16 copies are used on the x86 paths, except for decode-sized calls of a type whose timed
 *   decode mode is RQ_DECODE_GGUF; in RQ_DECODE_R16_256 the avx512 path decodes with the AVX2
 *   R16 kernels (same tiles, same results).
 * - On the GGUF layout the avx512 path takes V16 for calls of V16_MIN_TOK tokens or more, and the
 *   AVX2 tile kernels below that (see the top of v16.c); tiles hold up to TMAX2 tokens, 8 for the
 *   pf8 types. */
static matmul_plan plan(int path, int t, int ntok, int r16) {
    matmul_plan p = {.family = rq_type_supported(t) ? PLAN_REF : PLAN_NONE, .tmax = 1, .ub = 1};
    if (p.family == PLAN_NONE || path == RQ_PATH_SCALAR) return p;
#ifdef RQ_HAVE_X86
    const int decode = ntok <= 8, mode = decode ? decode_mode[t] : RQ_DECODE_R16;
    if (r16 && r16_type(t) && mode != RQ_DECODE_GGUF) {
        const int kpath = mode == RQ_DECODE_R16_256 ? RQ_PATH_AVX2 : path;
        p.r16 = kpath == RQ_PATH_AVX512                                          ? ops(t)->r16_512
                : __atomic_load_n(&g_avxvnni, __ATOMIC_RELAXED) > 0 && ops(t)->r16_vnni ? ops(t)->r16_vnni
                                                                                   : ops(t)->r16_256;
        if (p.r16) {
            p.family = PLAN_R16;
            p.expand = ntok >= (kpath == RQ_PATH_AVX512 ? R16_EXPAND_MIN_TOK : R16_EXPAND_MIN_TOK_256);
            return p;
        }
    }
    p.tmax = pf8_type(t, 1) ? 8 : TMAX2;
    p.k = ops(t)->k256;
    p.rk = slot_packed(t, p.ub) ? ops(t)->r256 : NULL;
    if (p.k || p.rk) p.family = PLAN_TILES;
    if (p.family == PLAN_TILES && p.tmax >= PF8_MIN_T && ntok >= PF8_MIN_T && ops(t)->pf8r) {
        p.pf8u = ops(t)->pf8u;
        p.pf8r = ops(t)->pf8r;
    }
    if (path == RQ_PATH_AVX512 && v16_type(t) && ntok >= V16_MIN_TOK && ops(t)->v16) {
        p.v16 = ops(t)->v16;
        p.family = PLAN_V16;
    }
#else
    (void)ntok; (void)r16;
#endif
    return p;
}

/* The route plan() gives a call, named (tests, and for reading what a matmul runs). */
const char *rq_matmul_route(int path, int t, int ntok, int r16) {
    const matmul_plan p = plan(path, t, ntok, r16);
    switch (p.family) {
    case PLAN_R16:
#ifdef RQ_HAVE_X86
        /* the VNNI groups' packed route is the plain AVX2 one: only their expanded tiles differ */
        if (p.expand && p.r16 == ops(t)->r16_vnni) return "r16-expanded-vnni";
#endif
        return p.expand ? "r16-expanded" : "r16";
    case PLAN_V16: return "v16";
    case PLAN_TILES: return p.pf8r ? "pf8" : "tiles";
    case PLAN_REF: return "reference";
    default: return "none";
    }
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
    const char *vnni = getenv("RQLLM_AVXVNNI");
    int expected = -1;
    __atomic_compare_exchange_n(&g_avxvnni, &expected, rq_cpu_has_avxvnni() && !(vnni && !strcmp(vnni, "0")), 0,
                                __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    expected = -1;
    __atomic_compare_exchange_n(&g_path, &expected, p, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

int rq_avxvnni(void) {
    rq_kernels_init();
    return __atomic_load_n(&g_avxvnni, __ATOMIC_ACQUIRE);
}

int rq_set_avxvnni(int on) {
    rq_kernels_init();
    if (on && !rq_cpu_has_avxvnni()) return -1;
    __atomic_store_n(&g_avxvnni, on ? 1 : 0, __ATOMIC_RELEASE);
    return 0;
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

void rq_quantize_act_span(const float *x, int n, int span, rq_act *a) {
    span = span == 256 && n % 256 == 0 ? 256 : 32;
#ifdef RQ_HAVE_X86
    int path = rq_kernel_path();
    if (path == RQ_PATH_AVX512) { quantize_act_512(x, n, span, a); return; }
    if (path == RQ_PATH_AVX2) { quantize_act_256(x, n, span, a); return; }
#endif
    quantize_act_ref(x, n, span, a);
}

void rq_quantize_act(const float *x, int n, rq_act *a) { rq_quantize_act_span(x, n, 32, a); }

int rq_act_span(int t) { return type_sb_int(t) ? 256 : 32; }

float rq_vec_dot(int t, int n, const void *row, const rq_act *x) {
    need_act_span(t, x, 1);
    const matmul_plan p = plan(rq_kernel_path(), t, 1, 0);
    if (p.family != PLAN_TILES) return rq_vec_dot_ref(t, n, row, x);
    int nb = n / QK;
    size_t need = tile_bytes(t, p.ub, 1, nb);
    _Alignas(64) uint8_t sbuf[8192];
    uint8_t *mem = need <= sizeof(sbuf) ? sbuf : aligned_alloc(64, need);
    if (!mem) return rq_vec_dot_ref(t, n, row, x);
    tile tl;
    prep_tile(t, p.ub, x, 1, nb, mem, &tl);
    float res = 0.0f;
    if (p.rk) p.rk(row, rq_row_bytes(t, n), 0, 1, n, &tl, &res, 1, 0);
    else p.k(row, n, &tl, &res);
    if (mem != sbuf) free(mem);
    return res;
}
