/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). The matmul drivers: token tiles shared by the threads, row chunks, the
 * OpenMP teams, the AVX-512 prefill and R16 drivers, the multi-op and reference matmuls. */

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

static int tiles_alloc(tileset *ts, const matmul_plan *p, int t, int cols, int ntok, int nthreads) {
    const int tmax = p->tmax;
    ts->rk = p->rk;
    ts->ntiles = (ntok + tmax - 1) / tmax;
    ts->tmax = tmax;
    ts->ub = p->ub;
    ts->nb = cols / QK;
    ts->full = tile_bytes(t, p->ub, ntok < tmax ? ntok : tmax, ts->nb);   /* no tile holds more tokens */
    ts->pf8_buf = NULL;
    ts->pf8_nbuf = 0;
    ts->pf8u = p->pf8u;
    ts->pf8r = p->pf8r;
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

#ifdef RQ_HAVE_X86
static int v16_alloc(v16_set *vs, const matmul_plan *p, int cols, int ntok, int nbuf) {
    const int nb = cols / QK;
    vs->fn = p->v16;
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
static int v16_matmul_rows(const matmul_plan *p, int t, const uint8_t *W, int cols, int r0, int r1,
                           const rq_act *acts, int ntok, float *out, int ldo) {
    v16_set vs;
    if (v16_alloc(&vs, p, cols, ntok, 1) != 0) return -1;
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

/* The plan has GGUF-layout tile kernels (PLAN_TILES, and PLAN_V16's fallback). */
static inline int plan_has_tiles(const matmul_plan *p) { return p->k || p->rk; }

void rq_matmul_rows(int t, const void *W, int cols, int r0, int r1,
                    const rq_act *acts, int ntok, float *out, int ldo) {
    if (r1 <= r0 || ntok <= 0) return;
    need_act_span(t, acts, ntok);
    const matmul_plan p = plan(rq_kernel_path(), t, ntok, 0);
    if (p.family == PLAN_NONE) {
        fill_nan(r0, r1, ntok, out, ldo);
        return;
    }
#ifdef RQ_HAVE_X86
    if (p.family == PLAN_V16 && v16_matmul_rows(&p, t, W, cols, r0, r1, acts, ntok, out, ldo) == 0) return;
#endif
    tileset ts;
    if (plan_has_tiles(&p) && tiles_alloc(&ts, &p, t, cols, ntok, 1) == 0) {
        for (int i = 0; i < ts.ntiles; i++) tiles_prep(&ts, t, acts, ntok, i);
        tiles_run(&ts, p.k, t, W, cols, r0, r1, out, ldo);
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
    const matmul_plan p = plan(rq_kernel_path(), t, ntok, 0);
    if (p.family == PLAN_NONE) {
#pragma omp single
        fill_nan(0, rows, ntok, out, ldo);
        return;
    }
    const int simd = plan_has_tiles(&p);
#ifdef RQ_HAVE_X86
    if (p.family == PLAN_V16) {
        v16_set *vs = NULL;
        int ok = 0;
#pragma omp single copyprivate(vs, ok)
        {
            vs = malloc(sizeof(v16_set));
            ok = vs && v16_alloc(vs, &p, cols, ntok, nth) == 0;
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
    int prefill = simd && ntok > 2 * p.tmax;
    int cr = chunk_rows(t, cols, rows, nth, prefill);
    int nch = (rows + cr - 1) / cr;
    if (!prefill) {
        /* decode-sized: each thread prepares its own (small) token tiles, no extra barrier */
        tileset ts;
        int have = simd && tiles_alloc(&ts, &p, t, cols, ntok, 1) == 0;
        if (have)
            for (int i = 0; i < ts.ntiles; i++) tiles_prep(&ts, t, acts, ntok, i);
#pragma omp for schedule(static, 1) nowait
        for (int c = 0; c < nch; c++) {
            int r0 = c * cr, r1 = r0 + cr < rows ? r0 + cr : rows;
            if (have) tiles_run(&ts, p.k, t, W, cols, r0, r1, out, ldo);
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
        ok = ts && tiles_alloc(ts, &p, t, cols, ntok, nth) == 0;
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
        tiles_run(ts, p.k, t, W, cols, r0, r1, out, ldo);
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
    need_act_span(t, acts, ntok);
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

size_t rq_r16_set_prefetch(int t, size_t bytes, int to_l2, int *was_to_l2) {
    if (t > RQ_BF16) return 0;
    const int all = t < 0, first = all ? 0 : t, last = all ? RQ_BF16 : t;
    const int shown = all ? RQ_Q4_K : t;   /* for all types, the previous setting reported is Q4_K's */
    const size_t before = r16_pf_ahead[shown];
    if (was_to_l2) *was_to_l2 = r16_pf_to_l2[shown];
    for (int i = first; i <= last; i++) {
        r16_pf_ahead[i] = bytes;
        r16_pf_to_l2[i] = to_l2 != 0;
    }
    return before;
}

/* The decode mode of a type (dispatch.c's decode_mode: how plan() routes decode-sized calls). */
int rq_set_decode_mode(int t, int mode) {
    if (mode != RQ_DECODE_R16 && mode != RQ_DECODE_R16_256 && mode != RQ_DECODE_GGUF) return -1;
    if (t > RQ_BF16) return -1;
    const int all = t < 0, first = all ? 0 : t, last = all ? RQ_BF16 : t;
    const int before = decode_mode[all ? RQ_Q4_K : t];   /* for all types, Q4_K's is reported */
    for (int i = first; i <= last; i++) decode_mode[i] = (signed char)mode;
    return before;
}

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
/* Decode-sized R16 jobs share work by bytes: thread i owns chunks [i K, (i + 1) K) of an equal split
 * of the job into nth K chunks, streams them in order (so its prefetch runs on into its next chunk),
 * then takes what is left of the other threads' chunks. A share that runs slower (a slower type in
 * a mixed job, its memory requests queued behind the other core's, the core lent to another
 * process) then holds the other thread at the region's closing barrier for at most a chunk, not for
 * the whole difference. Which thread computes a chunk does not change its results. */
#define R16_CHUNKS_PER_THREAD 8
#define R16_MAX_THREADS 64   /* threads that share one decode-sized job (its cursors live on the stack) */
typedef struct {
    int next;
    char pad[60];   /* one cursor per cache line */
} r16_cursor;

/* The next chunk for thread me of nth (cur: nth cursors, cursor i started at i K), or -1: none left. */
static int r16_take_chunk(r16_cursor *cur, int me, int nth) {
    for (int v = 0; v < nth; v++) {
        const int o = (me + v) % nth;
        if (__atomic_load_n(&cur[o].next, __ATOMIC_RELAXED) >= (o + 1) * R16_CHUNKS_PER_THREAD) continue;
        const int c = __atomic_fetch_add(&cur[o].next, 1, __ATOMIC_RELAXED);
        if (c < (o + 1) * R16_CHUNKS_PER_THREAD) return c;
    }
    return -1;
}

/* Cursors for up to nth threads (at most R16_MAX_THREADS); returns the thread count to run. */
static int r16_cursors_init(r16_cursor *cur, int nth) {
    if (nth > R16_MAX_THREADS) nth = R16_MAX_THREADS;
    for (int i = 0; i < nth; i++) cur[i].next = i * R16_CHUNKS_PER_THREAD;
    return nth;
}
#endif

#ifdef RQ_HAVE_X86
static void r16_matmul(const matmul_plan *p, int t, const uint8_t *R, int rows, int cols, const rq_act *acts,
                       int ntok, float *out, int ldo, int nthreads) {
    const int nb = cols / QK, ng = (rows + 15) / 16;
    const int expand = p->expand;
    v16_toks tk = {nb, (ntok + 7) / 8, NULL};
    tk.mem = aligned_alloc(64, (size_t)tk.ntiles * nb * V16_TILE_BLOCK_BYTES);
    int nt = 1;
#ifdef _OPENMP
    nt = nthreads > 0 ? nthreads : omp_get_max_threads();
    if (!expand && r16_bytes(t, rows, cols) < RQ_SERIAL_BYTES) nt = 1;
#endif
    if (nt > ng) nt = ng;
    size_t vb = (v16_group_bytes(nb) + 63) & ~(size_t)63;
    int gmax = (int)(V16_L2_BYTES / vb);
    gmax = gmax < 1 ? 1 : gmax > 8 ? 8 : gmax;
    uint8_t *grp = expand ? aligned_alloc(64, vb * (size_t)gmax * (size_t)nt) : NULL;
    const r16_groups_fn fn = p->r16;
    if (!tk.mem || (expand && !grp)) {   /* out of memory: NaN, as for an unsupported type */
        free(tk.mem);
        free(grp);
        fill_nan(0, rows, ntok, out, ldo);
        return;
    }
    if (nt <= 1) {
        for (int i = 0; i < tk.ntiles; i++) v16_prep_tile(t, acts, ntok, i, &tk);
        fn(R, rows, 0, ng, nb, ntok, &tk, out, ldo, grp, gmax);
    } else {
#ifdef _OPENMP
        r16_cursor cur[R16_MAX_THREADS];
        nt = r16_cursors_init(cur, nt);
#pragma omp parallel num_threads(nt)
        {
#pragma omp for schedule(static)
            for (int i = 0; i < tk.ntiles; i++) v16_prep_tile(t, acts, ntok, i, &tk);
            if (expand) {
                const int nch = (ng + gmax - 1) / gmax;
                uint8_t *mine = grp + vb * (size_t)gmax * (size_t)omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
                for (int c = 0; c < nch; c++) {
                    const int g0 = c * gmax, g1 = g0 + gmax < ng ? g0 + gmax : ng;
                    fn(R, rows, g0, g1, nb, ntok, &tk, out, ldo, mine, gmax);
                }
            } else {   /* decode-sized: chunks of equal bytes, each thread its own first (r16_take_chunk) */
                const int me = omp_get_thread_num(), nth = omp_get_num_threads(), nc = nth * R16_CHUNKS_PER_THREAD;
                for (int c; (c = r16_take_chunk(cur, me, nth)) >= 0;) {
                    const int g0 = (int)((long)ng * c / nc), g1 = (int)((long)ng * (c + 1) / nc);
                    if (g1 > g0) fn(R, rows, g0, g1, nb, ntok, &tk, out, ldo, NULL, gmax);
                }
            }
        }
#endif
    }
    free(tk.mem);
    free(grp);
}
#endif

void rq_matmul_r16(int t, const void *W, const void *R, int rows, int cols, const rq_act *acts, int ntok,
                   float *out, int ldo, int nthreads) {
    rq_kernels_init();
    need_act_span(t, acts, ntok);
#ifdef RQ_HAVE_X86
    if (R && rows > 0 && ntok > 0) {
        const matmul_plan p = plan(rq_kernel_path(), t, ntok, 1);
        if (p.family == PLAN_R16) {
            r16_matmul(&p, t, R, rows, cols, acts, ntok, out, ldo, nthreads);
            return;
        }
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

int rq_r16_multi_share(size_t lo, size_t hi, size_t base, size_t gb, int ng, int *g0, int *g1) {
    const size_t end = base + gb * (size_t)ng;
    *g0 = *g1 = 0;
    if (hi <= base || lo >= end) return 0;   /* (hi - base would wrap below: a share before the op did all of it) */
    *g0 = lo <= base ? 0 : (int)((lo - base + gb - 1) / gb);
    *g1 = hi >= end ? ng : (int)((hi - base + gb - 1) / gb);
    return *g1 > *g0;
}

/* An op's activations and token count: its own, or the call's. */
static inline const rq_act *op_acts(const rq_matmul_op *op, const rq_act *acts) { return op->acts ? op->acts : acts; }
static inline int op_ntok(const rq_matmul_op *op, int ntok) { return op->acts ? op->ntok : ntok; }

/* An op's plan on the path (on its R16 copies when it has them). */
static inline matmul_plan op_plan(int path, const rq_matmul_op *op, int ntok) {
    return plan(path, op->type, op_ntok(op, ntok), op->r16 != NULL);
}

/* Whether ops[i] is the gate of a gated pair that can be run: an up follows with its rows and tokens. */
static inline int gated_pair(const rq_matmul_op *ops, int nops, int i, int ntok) {
    return ops[i].gated && i + 1 < nops && ops[i + 1].rows == ops[i].rows && op_ntok(&ops[i + 1], ntok) == op_ntok(&ops[i], ntok);
}

/* A gated pair's rows [r0, r1) for each of its tokens: gate's out becomes act(gate) * up. Row ranges
 * start at multiples of 16, so rq_gated_act's vectors cover the same elements as over whole rows. */
static void gate_rows(const rq_matmul_op *gate, int n, int r0, int r1) {
    const rq_matmul_op *up = gate + 1;
    for (int k = 0; k < n; k++)
        rq_gated_act(gate->out + (size_t)k * gate->ldo + r0, up->out + (size_t)k * up->ldo + r0, (size_t)(r1 - r0),
                     gate->gated == RQ_GATED_GELU);
}

/* Every gated pair's activation over all its rows, its tokens split across the threads, after the
 * routes that do not run the pairs together. */
static void gate_all(const rq_matmul_op *ops, int nops, int ntok, int nthreads) {
    int nt = 1;
#ifdef _OPENMP
    nt = nthreads > 0 ? nthreads : omp_get_max_threads();
#endif
    (void)nt;
    for (int i = 0; i < nops; i++) {
        if (!gated_pair(ops, nops, i, ntok)) continue;
        const int n = op_ntok(&ops[i], ntok);
        rq_matmul_op g = ops[i], u = ops[i + 1];
#pragma omp parallel for num_threads(nt) schedule(static) firstprivate(g, u) if (n > 1)
        for (int k = 0; k < n; k++) {
            rq_matmul_op pair[2] = {g, u};
            pair[0].out += (size_t)k * g.ldo;
            pair[1].out += (size_t)k * u.ldo;
            gate_rows(pair, 1, 0, g.rows);
        }
    }
}

#ifdef RQ_HAVE_X86
/* Whether ops a and b get the same token tile: the same tokens (their acts hold the same values, as
 * the routed copies of one token's do) and types with the same offset (the tile's nq). */
static int same_tile(const rq_matmul_op *a, const rq_matmul_op *b, const rq_act *acts, int ntok) {
    const int n = op_ntok(a, ntok);
    if (n != op_ntok(b, ntok) || type_offset(a->type) != type_offset(b->type)) return 0;
    const rq_act *x = op_acts(a, acts), *y = op_acts(b, acts);
    for (int k = 0; k < n; k++)
        if (x[k].qs != y[k].qs || x[k].d != y[k].d || x[k].sum16 != y[k].sum16) return 0;
    return 1;
}

/* Calls whose ops all have R16 copies: one parallel job over the ops' concatenated groups, in chunks
 * of equal cost (a group's bytes times its op's tokens), each thread its own chunks first, then
 * whatever is left of the others' (r16_take_chunk). q/k/v or gate/up of a decode step pay for one
 * region and one tile, not one per op; one by one, the small k and v matrices would each run on one
 * thread. The experts of a pass likewise run as one job split by (expert, rows): a prefill pass's
 * experts, some with many tokens and some with few, each once in its own region, left a thread idle at
 * every region's end. Ops of many tokens expand their groups (the plan's expand) into buffers of the
 * thread's own. Ops with equal token counts (every decode step) get chunks of equal bytes, as before
 * the costs were weighted. A dense prefill's ops (the call's tokens, more than one tile) run one by
 * one instead (r16_matmul), as they did: as one job, the 1.5B shape's prefill came out 2-12 % slower
 * in six alternating runs (Zen 3, 2 threads; not explained: its kernels' profile was the same).
 * Returns -1 when it does not apply. */
static int r16_matmul_multi(const rq_matmul_op *ops, int nops, int cols, const rq_act *acts, int ntok, int nthreads) {
    if (nops <= 0) return 0;
    const int path = rq_kernel_path(), nb = cols / QK;
    const size_t tbytes = (size_t)nb * V16_TILE_BLOCK_BYTES;
    /* each op's tiles, kernel, and the op whose tiles it reads: its own, or an earlier op's that holds the
     * same one (the k experts of a decode step read one token, and k tiles of it would fill L2). Only
     * one-tile ops share, and only the last few distinct ones are compared, so that many experts with
     * tokens of their own cost O(nops). */
    /* gcost: a group's cost; ccost: what the chunks count for it (a gated pair's gate: both ops' groups,
     * its up: none, as the gate's share runs both) */
    struct { v16_toks tk; r16_groups_fn fn; int src, tile, expand, gated; size_t gcost, ccost; } *op = malloc(sizeof(*op) * (size_t)nops);
    size_t total = 0, bytes = 0;
    int fits = op != NULL, ntiles = 0, nshared = 0, any_expand = 0, recent[4];   /* recent[n % 4]: the nth one-tile op */
    for (int i = 0; fits && i < nops; i++) {
        const matmul_plan p = op_plan(path, &ops[i], ntok);
        const int n = op_ntok(&ops[i], ntok);
        fits = p.family == PLAN_R16 && (ops[i].acts || n <= 8);
        op[i].fn = p.r16;
        op[i].expand = p.expand;
        any_expand |= p.expand;
        op[i].gcost = op[i].ccost = r16_group_bytes_t(ops[i].type, nb) * (size_t)n;
        op[i].gated = 0;
        bytes += r16_group_bytes_t(ops[i].type, nb) * (size_t)((ops[i].rows + 15) / 16);
        op[i].src = i;
        for (int r = 0; n <= 8 && r < nshared && r < 4 && op[i].src == i; r++)
            if (same_tile(&ops[i], &ops[recent[r]], acts, ntok)) op[i].src = recent[r];
        if (op[i].src == i) {
            if (n <= 8) recent[nshared++ % 4] = i;
            op[i].tile = ntiles;
            ntiles += (n + 7) / 8;
        }
    }
    for (int i = 0; fits && i < nops; i++) {
        if (gated_pair(ops, nops, i, ntok)) {
            op[i].gated = 1;
            op[i].ccost += op[i + 1].gcost;
            op[i + 1].ccost = 0;
        }
        total += op[i].ccost * (size_t)((ops[i].rows + 15) / 16);
    }
    /* the tiles to prepare, as (op, tile) pairs: one op's many tiles are shared out too */
    int *prep = fits ? malloc(sizeof(int) * 2 * (size_t)ntiles) : NULL;
    uint8_t *mem = prep ? aligned_alloc(64, tbytes * (size_t)ntiles) : NULL;
    fits = fits && mem;
    for (int i = 0; fits && i < nops; i++) {
        const int n = op_ntok(&ops[i], ntok), src = op[i].src;
        op[i].tk = (v16_toks){nb, (n + 7) / 8, mem + tbytes * (size_t)op[src].tile};
        if (src == i)
            for (int k = 0; k < op[i].tk.ntiles; k++) prep[2 * (op[i].tile + k)] = i, prep[2 * (op[i].tile + k) + 1] = k;
    }
    int nt = 1;
#ifdef _OPENMP
    nt = nthreads > 0 ? nthreads : omp_get_max_threads();
    if (!any_expand && bytes < RQ_SERIAL_BYTES) nt = 1;
#endif
    r16_cursor cur[R16_MAX_THREADS];
    nt = fits ? r16_cursors_init(cur, nt) : 1;
    /* the expanding ops' group buffers, gmax groups a thread (as r16_matmul's) */
    const size_t vb = (v16_group_bytes(nb) + 63) & ~(size_t)63;
    int gmax = (int)(V16_L2_BYTES / vb);
    gmax = gmax < 1 ? 1 : gmax > 8 ? 8 : gmax;
    uint8_t *grp = fits && any_expand ? aligned_alloc(64, vb * (size_t)gmax * (size_t)nt) : NULL;
    if (!fits || (any_expand && !grp)) {   /* an op the job does not run, or out of memory */
        free(op);
        free(prep);
        free(mem);
        free(grp);
        return -1;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
    {
        int me = 0, nth = 1;
#ifdef _OPENMP
        me = omp_get_thread_num();
        nth = omp_get_num_threads();
#pragma omp for schedule(static)
#endif
        for (int j = 0; j < ntiles; j++) {
            const rq_matmul_op *o = &ops[prep[2 * j]];
            v16_prep_tile(o->type, op_acts(o, acts), op_ntok(o, ntok), prep[2 * j + 1], &op[prep[2 * j]].tk);
        }
        uint8_t *mine = grp ? grp + vb * (size_t)gmax * (size_t)me : NULL;
        const size_t nc = (size_t)nth * R16_CHUNKS_PER_THREAD;
        for (int c; (c = r16_take_chunk(cur, me, nth)) >= 0;) {   /* chunks of equal cost, own ones first */
            const size_t lo = total * (size_t)c / nc, hi = total * ((size_t)c + 1) / nc;
            size_t base = 0;
            for (int i = 0; i < nops && base < hi; i++) {
                const int ng = (ops[i].rows + 15) / 16;
                const size_t end = base + op[i].ccost * (size_t)ng;
                int g0, g1;
                if (op[i].ccost && end > lo && rq_r16_multi_share(lo, hi, base, op[i].ccost, ng, &g0, &g1)) {
                    const int n = op_ntok(&ops[i], ntok);
                    for (int j = i; j <= i + op[i].gated; j++)   /* a gated pair: the gate's rows, then the up's */
                        op[j].fn(ops[j].r16, ops[j].rows, g0, g1, nb, n, &op[j].tk, ops[j].out, ops[j].ldo,
                                 op[j].expand ? mine : NULL, gmax);
                    if (op[i].gated)   /* fused: the activation while these rows are in cache */
                        gate_rows(&ops[i], n, 16 * g0, 16 * g1 < ops[i].rows ? 16 * g1 : ops[i].rows);
                }
                base = end;
            }
        }
    }
    free(mem);
    free(prep);
    free(grp);
    free(op);
    return 0;
}
#endif

void rq_matmul_multi(const rq_matmul_op *ops, int nops, int cols, const rq_act *acts, int ntok, int nthreads) {
    rq_kernels_init();
    for (int i = 0; i < nops; i++)
        need_act_span(ops[i].type, ops[i].acts ? ops[i].acts : acts, ops[i].acts ? ops[i].ntok : ntok);
    const int path = rq_kernel_path();
    int n16 = 0;   /* ops planned on their R16 copies */
    for (int i = 0; i < nops; i++) n16 += op_plan(path, &ops[i], ntok).family == PLAN_R16;
    if (n16 > 0 && n16 < nops) {   /* mixed: the R16 ops as one call, the GGUF-layout ones as another */
        rq_matmul_op *split = malloc(sizeof(rq_matmul_op) * (size_t)nops);
        if (split) {
            int a = 0, b = n16;
            for (int i = 0; i < nops; i++) {
                const int on16 = op_plan(path, &ops[i], ntok).family == PLAN_R16;
                split[on16 ? a++ : b++] = ops[i];
                if (!on16) split[b - 1].r16 = NULL;
                split[(on16 ? a : b) - 1].gated = 0;   /* a pair may be split: activated at the end */
            }
            rq_matmul_multi(split, n16, cols, acts, ntok, nthreads);
            rq_matmul_multi(split + n16, nops - n16, cols, acts, ntok, nthreads);
            free(split);
            gate_all(ops, nops, ntok, nthreads);
            return;
        }
    }
    if (n16 > 0) {
#ifdef RQ_HAVE_X86
        if (r16_matmul_multi(ops, nops, cols, acts, ntok, nthreads) == 0) return;
#endif
        /* many tokens (or out of memory): one by one (each splits its groups across the threads) */
        for (int i = 0; i < nops; i++)
            rq_matmul_r16(ops[i].type, ops[i].W, ops[i].r16, ops[i].rows, cols, op_acts(&ops[i], acts),
                          op_ntok(&ops[i], ntok), ops[i].out, ops[i].ldo, nthreads);
        gate_all(ops, nops, ntok, nthreads);
        return;
    }
    size_t total = 0;
    int simple = 0;
    for (int i = 0; i < nops; i++) {
        if (!rq_type_supported(ops[i].type) || op_ntok(&ops[i], ntok) > 2) simple = 1;
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
            rq_matmul(ops[i].type, ops[i].W, ops[i].rows, cols, op_acts(&ops[i], acts), op_ntok(&ops[i], ntok),
                      ops[i].out, ops[i].ldo, nthreads);
        gate_all(ops, nops, ntok, nthreads);
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
            if (r1 > r0)
                rq_matmul_rows(ops[i].type, ops[i].W, cols, r0, r1, op_acts(&ops[i], acts), op_ntok(&ops[i], ntok),
                               ops[i].out, ops[i].ldo);
            base += rb * (size_t)ops[i].rows;
        }
    }
    gate_all(ops, nops, ntok, nthreads);
#endif
}

void rq_matmul_team(int t, const void *W, int rows, int cols,
                    const rq_act *acts, int ntok, float *out, int ldo) {
    rq_kernels_init();
    if (rows <= 0 || ntok <= 0) return;
    need_act_span(t, acts, ntok);
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
