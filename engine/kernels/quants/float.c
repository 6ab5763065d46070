/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). The float weight types F32, F16 and BF16: multiplied with the f32
 * activations (rq_act.f), not the int8 ones. Dequantization, scalar reference dot products, the
 * AVX2 row kernel. */

/* ------------------------------------------------------------------------------------------ */
/* Dequantization (ground truth)                                                               */

static void dequant_f32(const void *row, float *y, int n) {
    memcpy(y, row, (size_t)n * 4);
}
static void dequant_f16(const void *row, float *y, int n) {
    const uint16_t *h = row;
    for (int i = 0; i < n; i++) y[i] = F16(h[i]);
}
static void dequant_bf16(const void *row, float *y, int n) {
    const uint16_t *h = row;
    for (int i = 0; i < n; i++) y[i] = rq_bf16_to_f32(h[i]);
}

/* ------------------------------------------------------------------------------------------ */
/* Scalar reference dot products                                                               */

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

#ifdef RQ_HAVE_X86

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

KERN256(k256_f32, float_row_256, RQ_F32, row, n, tv, res)
KERN256(k256_f16, float_row_256, RQ_F16, row, n, tv, res)
KERN256(k256_bf16, float_row_256, RQ_BF16, row, n, tv, res)

#endif /* x86 */
