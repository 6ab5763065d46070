/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). Activation quantization: f32 activations -> int8 blocks of 32 with scale d (one per
 * block, or one per 8 blocks: the span) and the two 16-element sums (rq_act), scalar reference
 * and the AVX2 / AVX-512 versions (the same results, bit for bit; rq_quantize_act_span in
 * dispatch.c picks one). */

/* Q4_K's and IQ4_XS's kernels sum a super-block's blocks in int32 before applying the token's scale
 * (type_sb_int): they need one scale per 256 values (rq_act_span). A caller that quantized for
 * another type is a bug. */
static void need_act_span(int t, const rq_act *acts, int ntok) {
    if (!type_sb_int(t)) return;
    for (int k = 0; k < ntok; k++)
        if (acts[k].span != 256) {
            fprintf(stderr, "rqllm kernels: a %s matmul was given activations with one scale per %d values; "
                            "it needs one per 256 (rq_act_span)\n", t == RQ_Q4_K ? "Q4_K" : "IQ4_XS", acts[k].span);
            abort();
        }
}

static void quantize_act_ref(const float *x, int n, int span, rq_act *a) {
    a->n = n;
    a->span = span;
    a->f = x;
    for (int c = 0; c < n; c += span) {
        float amax = 0.0f;
        for (int j = 0; j < span; j++) {
            float v = fabsf(x[c + j]);
            amax = v > amax ? v : amax;
        }
        float d = amax / 127.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        int use_div = isinf(id);   /* subnormal d: 1/d overflows, divide instead */
        for (int b = c / 32; b < (c + span) / 32; b++) {
            const float *xb = x + 32 * b;
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
}

#ifdef RQ_HAVE_X86

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

A512 static void quantize_act_512(const float *x, int n, int span, rq_act *a) {
    a->n = n;
    a->span = span;
    a->f = x;
    for (int c = 0; c < n; c += span) {
        __m512 m = _mm512_setzero_ps();
        for (int j = 0; j < span; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + c + j)));
        float amax = _mm512_reduce_max_ps(m);
        float d = amax / 127.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        __m512 vid = _mm512_set1_ps(id), vd = _mm512_set1_ps(d);
        int use_div = isinf(id);
        for (int b = c / 32; b < (c + span) / 32; b++) {
            __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
            a->d[b] = d;
            __m512i q0 = round_away_512(use_div ? _mm512_div_ps(x0, vd) : _mm512_mul_ps(x0, vid));
            __m512i q1 = round_away_512(use_div ? _mm512_div_ps(x1, vd) : _mm512_mul_ps(x1, vid));
            a->sum16[2 * b] = _mm512_reduce_add_epi32(q0);
            a->sum16[2 * b + 1] = _mm512_reduce_add_epi32(q1);
            _mm_storeu_si128((__m128i *)(a->qs + 32 * b), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(a->qs + 32 * b + 16), _mm512_cvtepi32_epi8(q1));
        }
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

A256 static void quantize_act_256(const float *x, int n, int span, rq_act *a) {
    a->n = n;
    a->span = span;
    a->f = x;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int c = 0; c < n; c += span) {
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < span; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + c + j), absmask));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float d = amax / 127.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        __m256 vid = _mm256_set1_ps(id), vd = _mm256_set1_ps(d);
        int use_div = isinf(id);
        for (int b = c / 32; b < (c + span) / 32; b++) {
            a->d[b] = d;
            __m256i r[4];
            for (int k = 0; k < 4; k++) {
                const __m256 v = _mm256_loadu_ps(x + 32 * b + 8 * k);
                r[k] = round_away_256(use_div ? _mm256_div_ps(v, vd) : _mm256_mul_ps(v, vid));
            }
            a->sum16[2 * b] = hsum_epi32_256(_mm256_add_epi32(r[0], r[1]));
            a->sum16[2 * b + 1] = hsum_epi32_256(_mm256_add_epi32(r[2], r[3]));
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(a->qs + 32 * b), p);
        }
    }
}

#endif /* x86 */
