/* The transformer forward pass. Read rq_forward() top to bottom; helpers come first. */
#define _GNU_SOURCE   /* sincosf */
#include "forward.h"
#include "attention.h"
#include "experts.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define ALIGN 64

#include <stddef.h>

#define RQ_CONFIG_FIELD_ENTRY(type, name) {#name, (int)offsetof(rq_config, name), (type)0.5 != 0},
const rq_config_field rq_config_fields[] = {RQ_CONFIG_FIELDS(RQ_CONFIG_FIELD_ENTRY)};
const int rq_config_n_fields = sizeof(rq_config_fields) / sizeof(rq_config_fields[0]);

#define RQ_LAYER_FIELD_ENTRY(name) {#name, (int)offsetof(rq_layer_weights, name)},
const rq_layer_field rq_layer_fields[] = {RQ_LAYER_FIELDS(RQ_LAYER_FIELD_ENTRY)};
const int rq_layer_n_fields = sizeof(rq_layer_fields) / sizeof(rq_layer_fields[0]);

struct rq_model {
    rq_config cfg;
    rq_weights w;
    rq_kv kv;
    int q_dim, kv_dim, max_cols, n_threads, max_threads;   /* threads now, and the most (scratch sized for) */

    /* scratch for one pass of up to max_ubatch tokens */
    float *x;       /* residual stream      [U][n_embd]  */
    float *xb;      /* normed input / sublayer output [U][max(n_embd, q_dim)] */
    float *q;       /* [U][q_dim] */
    float *k, *v;   /* [U][kv_dim] */
    float *att_out; /* [U][q_dim] */
    float *hb, *hb2;/* [U][n_ff] */
    float *att_scratch;        /* [threads][att_scratch_floats]: attention blocks' scores and q */
    size_t att_scratch_floats;
    const float *rope_freq[2];  /* per rotated pair (rq_config's): [0] global, [1] local layers */
    float *rope_cs[2];     /* this pass's (cos, sin) per token and pair, [U][head_dim/2][2], per table */
    rq_act *acts;   /* [U], each over max_cols */
    int8_t *act_qs;
    float *act_d;
    int32_t *act_sum16;

    rq_experts *experts;   /* a mixture-of-experts FFN's scratch, or NULL */

    float *record;  /* test hook: residual after each layer */
    int record_max;
};

static void *alloc_aligned(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, ALIGN, bytes ? bytes : ALIGN) != 0) return NULL;
    memset(p, 0, bytes);
    return p;
}

/* ---------------------------------------------------------------- small float ops */

/* out = x / sqrt(mean(x^2) + eps) * weight. Compiled once for the portable target, as every plain float
 * op here. It had per-CPU clones (target_clones), chosen by the CPU rather than the kernel path: on an
 * AVX-512 CPU every path ran the avx512f clone, whose sum of squares GCC contracts into FMAs (the avx2
 * clone's it does not) and which the SIMDe test build (-O1) compiled differently from the product
 * (-O3); that build's logits then differed from the avx2 path's on a Xeon. */
static void rmsnorm(float *out, const float *x, const float *weight, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float scale = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * scale * weight[i];
}

static void add_inplace(float *y, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += x[i];
}

/* (cos, sin) of pair i's angle pos * freq[i] for one position, times mscale: cs[2i], cs[2i+1]. */
static void rope_angles(float *cs, const float *freq, int half, int pos, float mscale) {
    for (int i = 0; i < half; i++) {
        sincosf((float)pos * freq[i], &cs[2 * i + 1], &cs[2 * i]);
        cs[2 * i] *= mscale;
        cs[2 * i + 1] *= mscale;
    }
}

/* Rotate the first n_rot dimensions of each head of vec (n_heads x head_dim) by the angles cs of
 * its position (rope_angles). neox = 0: pairs (2i, 2i+1) (llama); neox = 1: pairs (i, i + n_rot/2). */
static void rope(float *vec, int n_heads, int head_dim, int n_rot, const float *cs, int neox) {
    int half = n_rot / 2;
    for (int i = 0; i < half; i++) {
        float c = cs[2 * i], s = cs[2 * i + 1];
        for (int h = 0; h < n_heads; h++) {
            float *hv = vec + (size_t)h * head_dim;
            int a = neox ? i : 2 * i;
            int b = neox ? i + half : 2 * i + 1;
            float x0 = hv[a], x1 = hv[b];
            hv[a] = x0 * c - x1 * s;
            hv[b] = x0 * s + x1 * c;
        }
    }
}

/* ---------------------------------------------------------------- weights helpers */

static const float *f32_data(const rq_tensor *t) { return (const float *)t->data; }

/* Per-token work of a prefill pass (norms, quantizing, RoPE, activations, residual adds), split
 * across the threads: each token's result is computed exactly as alone, only elsewhere. Serial
 * for one token (decode), where a parallel region costs more than the work. */
#define FOR_TOKENS _Pragma("omp parallel for num_threads(m->n_threads) schedule(static) if (n > 1)")

/* The activation span (quants.h) the matrices about to multiply m->acts need (NULL ends the list). */
static int span_for(const rq_tensor *a, const rq_tensor *b, const rq_tensor *c) {
    int s = rq_act_span(a->type);
    if (b && rq_act_span(b->type) > s) s = rq_act_span(b->type);
    if (c && rq_act_span(c->type) > s) s = rq_act_span(c->type);
    return s;
}

static void quantize_rows(rq_model *m, const float *x, int n, int cols, int ld, int span) {
    FOR_TOKENS
    for (int t = 0; t < n; t++) {
        m->acts[t].n = cols;
        rq_quantize_act_span(x + (size_t)t * ld, cols, span, &m->acts[t]);
    }
}

/* out[t][0..rows) = W x[t] for the n activations already quantized in m->acts. */
static void matmul(rq_model *m, const rq_tensor *W, int n, float *out, int ldo) {
    rq_matmul_r16(W->type, W->data, W->r16, W->rows, W->cols, m->acts, n, out, ldo, m->n_threads);
}

static void add_bias(float *y, const rq_tensor *b, int n, int ld) {
    if (!b->data) return;
    for (int t = 0; t < n; t++) add_inplace(y + (size_t)t * ld, f32_data(b), b->cols);
}

static int layer_is_local(const rq_config *c, int il) {
    return c->sliding_window > 0 && c->swa_pattern > 0 && (il % c->swa_pattern) < c->swa_pattern - 1;
}

/* ---------------------------------------------------------------- model lifetime */

rq_model *rq_model_create(const rq_config *cfg, const rq_weights *w, const rq_kv *kv) {
    rq_kernels_init();
    if (!cfg->rope_freq || cfg->n_rot < 2 || cfg->n_rot > cfg->head_dim || cfg->n_rot % 2) return NULL;
    rq_model *m = calloc(1, sizeof(rq_model));
    if (!m) return NULL;
    m->cfg = *cfg;
    m->w = *w;
    m->kv = *kv;
    const rq_config *c = &m->cfg;
    int U = c->max_ubatch > 0 ? c->max_ubatch : 64;
    m->cfg.max_ubatch = U;
    m->n_threads = c->n_threads > 0 ? c->n_threads : omp_get_max_threads();
    m->max_threads = m->n_threads;
    m->q_dim = c->n_head * c->head_dim;
    m->kv_dim = c->n_head_kv * c->head_dim;
    int cols = c->n_embd;
    if (m->q_dim > cols) cols = m->q_dim;
    if (c->n_ff > cols) cols = c->n_ff;
    if (c->n_expert > 0) {
        m->experts = rq_experts_create(c->n_embd, c->n_expert, c->n_expert_used, c->n_ff_exp, U);
        if (!m->experts) {
            rq_model_free(m);
            return NULL;
        }
    }
    m->max_cols = cols;

    size_t xb_dim = (size_t)(c->n_embd > m->q_dim ? c->n_embd : m->q_dim);
    m->x = alloc_aligned(sizeof(float) * U * c->n_embd);
    m->xb = alloc_aligned(sizeof(float) * U * xb_dim);
    m->q = alloc_aligned(sizeof(float) * U * m->q_dim);
    m->k = alloc_aligned(sizeof(float) * U * m->kv_dim);
    m->v = alloc_aligned(sizeof(float) * U * m->kv_dim);
    m->att_out = alloc_aligned(sizeof(float) * U * m->q_dim);
    m->hb = alloc_aligned(sizeof(float) * U * c->n_ff);
    m->hb2 = alloc_aligned(sizeof(float) * U * c->n_ff);
    m->att_scratch_floats = rq_att_scratch_floats(kv->capacity, c->head_dim);
    m->att_scratch = alloc_aligned(sizeof(float) * m->n_threads * m->att_scratch_floats);
    m->acts = calloc(U, sizeof(rq_act));
    m->act_qs = alloc_aligned((size_t)U * cols);
    m->act_d = alloc_aligned(sizeof(float) * (size_t)U * (cols / 32));
    m->act_sum16 = alloc_aligned(sizeof(int32_t) * (size_t)U * (cols / 16));
    /* The angles depend on the position and the base only: computed once per pass for all
     * layers, from frequencies computed once here (powf per token and pair cost ~1 % of prefill). */
    m->rope_freq[0] = c->rope_freq;
    m->rope_freq[1] = c->rope_freq_local ? c->rope_freq_local : c->rope_freq;
    for (int b = 0; b < 2; b++) {
        m->rope_cs[b] = alloc_aligned(sizeof(float) * U * c->head_dim);
        if (!m->rope_cs[b]) {
            rq_model_free(m);
            return NULL;
        }
    }
    if (!m->x || !m->xb || !m->q || !m->k || !m->v || !m->att_out || !m->hb || !m->hb2 ||
        !m->att_scratch || !m->acts || !m->act_qs || !m->act_d || !m->act_sum16) {
        rq_model_free(m);
        return NULL;
    }
    for (int t = 0; t < U; t++) {
        m->acts[t].qs = m->act_qs + (size_t)t * cols;
        m->acts[t].d = m->act_d + (size_t)t * (cols / 32);
        m->acts[t].sum16 = m->act_sum16 + (size_t)t * (cols / 16);
    }
    return m;
}

void rq_model_free(rq_model *m) {
    if (!m) return;
    free(m->x); free(m->xb); free(m->q); free(m->k); free(m->v); free(m->att_out);
    free(m->hb); free(m->hb2); free(m->att_scratch); free(m->acts);
    free(m->act_qs); free(m->act_d); free(m->act_sum16);
    for (int b = 0; b < 2; b++) free(m->rope_cs[b]);
    rq_experts_free(m->experts);
    free(m);
}

int rq_model_set_threads(rq_model *m, int n) {
    m->n_threads = n < 1 ? 1 : n > m->max_threads ? m->max_threads : n;
    return m->n_threads;
}

void rq_model_record_layers(rq_model *m, float *buf, int max_tokens) {
    m->record = buf;
    m->record_max = max_tokens;
}

static void record(rq_model *m, int l, int n) {
    if (!m->record || n > m->record_max) return;
    const int d = m->cfg.n_embd;
    memcpy(m->record + ((size_t)l * m->record_max) * d, m->x, sizeof(float) * n * d);
}

/* ---------------------------------------------------------------- the layer passes */

static void embed(rq_model *m, const int32_t *tokens, int n) {
    const rq_config *c = &m->cfg;
    const rq_tensor *E = &m->w.token_embd;
    size_t row_bytes = rq_row_bytes(E->type, E->cols);
    for (int t = 0; t < n; t++) {
        float *xt = m->x + (size_t)t * c->n_embd;
        rq_dequant_row(E->type, (const uint8_t *)E->data + row_bytes * tokens[t], xt, c->n_embd);
        if (c->embd_scale != 1.0f)
            for (int i = 0; i < c->n_embd; i++) xt[i] *= c->embd_scale;
    }
}

/* Self-attention for n tokens at positions pos0..: writes K,V into the cache, attends, and
 * leaves the projected output (before the residual add) in m->xb. */
static void attention(rq_model *m, int il, int n, int pos0) {
    const rq_config *c = &m->cfg;
    const rq_layer_weights *L = &m->w.layers[il];
    const int d = c->n_embd, hd = c->head_dim, q_dim = m->q_dim, kv_dim = m->kv_dim;
    const int local = layer_is_local(c, il);
    const float *rope_cs = m->rope_cs[local];

    FOR_TOKENS
    for (int t = 0; t < n; t++)
        rmsnorm(m->xb + (size_t)t * d, m->x + (size_t)t * d, f32_data(&L->attn_norm), d, c->norm_eps);
    quantize_rows(m, m->xb, n, d, d, span_for(&L->wq, &L->wk, &L->wv));
    const rq_matmul_op qkv[3] = {{L->wq.type, L->wq.data, L->wq.rows, m->q, q_dim, L->wq.r16},
                                 {L->wk.type, L->wk.data, L->wk.rows, m->k, kv_dim, L->wk.r16},
                                 {L->wv.type, L->wv.data, L->wv.rows, m->v, kv_dim, L->wv.r16}};
    rq_matmul_multi(qkv, 3, d, m->acts, n, m->n_threads);
    add_bias(m->q, &L->bq, n, q_dim);
    add_bias(m->k, &L->bk, n, kv_dim);
    add_bias(m->v, &L->bv, n, kv_dim);

    const int slots = m->kv.slots[il];
    FOR_TOKENS
    for (int t = 0; t < n; t++) {
        float *qt = m->q + (size_t)t * q_dim, *kt = m->k + (size_t)t * kv_dim;
        const int qn = c->qk_norm_full ? q_dim : hd, kn = c->qk_norm_full ? kv_dim : hd;   /* per head or all at once */
        if (L->attn_q_norm.data)
            for (int h = 0; h < q_dim / qn; h++)
                rmsnorm(qt + h * qn, qt + h * qn, f32_data(&L->attn_q_norm), qn, c->norm_eps);
        if (L->attn_k_norm.data)
            for (int h = 0; h < kv_dim / kn; h++)
                rmsnorm(kt + h * kn, kt + h * kn, f32_data(&L->attn_k_norm), kn, c->norm_eps);
        rope(qt, c->n_head, hd, c->n_rot, rope_cs + (size_t)t * hd, c->rope_neox);
        rope(kt, c->n_head_kv, hd, c->n_rot, rope_cs + (size_t)t * hd, c->rope_neox);
        size_t slot = (size_t)((pos0 + t) % slots);
        rq_kv_store(m->kv.k[il], m->kv.f16, slot * kv_dim, kt, kv_dim);
        rq_kv_store(m->kv.v[il], m->kv.f16, slot * kv_dim, m->v + (size_t)t * kv_dim, kv_dim);
    }

    const rq_att_shape shape = {c->n_head, c->n_head_kv, hd, slots, local ? c->sliding_window : 0, m->kv.f16,
                                c->attn_scale, c->attn_softcap};
    rq_attend_tokens(&shape, m->q, m->kv.k[il], m->kv.v[il], m->att_out, n, pos0, 0, 0, m->n_threads, m->att_scratch,
                     m->att_scratch_floats);

    quantize_rows(m, m->att_out, n, q_dim, q_dim, span_for(&L->wo, NULL, NULL));
    matmul(m, &L->wo, n, m->xb, d);
    if (L->post_attn_norm.data) {
        FOR_TOKENS
        for (int t = 0; t < n; t++)
            rmsnorm(m->xb + (size_t)t * d, m->xb + (size_t)t * d, f32_data(&L->post_attn_norm), d, c->norm_eps);
    }
}

/* Gated feed-forward: down(act(gate x) * up x), output (before the residual add) in m->xb. */
static void feed_forward(rq_model *m, int il, int n) {
    const rq_config *c = &m->cfg;
    const rq_layer_weights *L = &m->w.layers[il];
    const int d = c->n_embd, ff = c->n_ff;

    FOR_TOKENS
    for (int t = 0; t < n; t++)
        rmsnorm(m->xb + (size_t)t * d, m->x + (size_t)t * d, f32_data(&L->ffn_norm), d, c->norm_eps);
    quantize_rows(m, m->xb, n, d, d,
                  L->ffn_gate_inp.data ? span_for(&L->ffn_gate_inp, &L->ffn_gate_exps, &L->ffn_up_exps)
                                       : span_for(&L->ffn_gate, &L->ffn_up, NULL));
    if (L->ffn_gate_inp.data) {   /* a mixture of experts (experts.h) */
        rq_experts_ffn(m->experts, &L->ffn_gate_inp, &L->ffn_gate_exps, &L->ffn_up_exps, &L->ffn_down_exps,
                       c->expert_norm, c->ffn_gelu, m->acts, n, m->xb, d, m->n_threads);
    } else {
        /* a gated pair: hb gets act(gate) * up (with R16 copies and up to 8 tokens, row range by row range) */
        const rq_matmul_op gate_up[2] = {{L->ffn_gate.type, L->ffn_gate.data, L->ffn_gate.rows, m->hb, ff, L->ffn_gate.r16,
                                          .gated = c->ffn_gelu ? RQ_GATED_GELU : RQ_GATED_SILU},
                                         {L->ffn_up.type, L->ffn_up.data, L->ffn_up.rows, m->hb2, ff, L->ffn_up.r16}};
        rq_matmul_multi(gate_up, 2, d, m->acts, n, m->n_threads);
        quantize_rows(m, m->hb, n, ff, ff, span_for(&L->ffn_down, NULL, NULL));
        matmul(m, &L->ffn_down, n, m->xb, d);
    }
    if (L->post_ffw_norm.data) {
        FOR_TOKENS
        for (int t = 0; t < n; t++)
            rmsnorm(m->xb + (size_t)t * d, m->xb + (size_t)t * d, f32_data(&L->post_ffw_norm), d, c->norm_eps);
    }
}

/* Final norm and output projection for tokens [t0, n) of the pass. */
static void logits_for(rq_model *m, int t0, int n, float *logits) {
    const rq_config *c = &m->cfg;
    const int d = c->n_embd;
    for (int t = t0; t < n; t++)
        rmsnorm(m->xb + (size_t)(t - t0) * d, m->x + (size_t)t * d, f32_data(&m->w.output_norm), d, c->norm_eps);
    quantize_rows(m, m->xb, n - t0, d, d, span_for(&m->w.output, NULL, NULL));
    matmul(m, &m->w.output, n - t0, logits, c->n_vocab);
    if (c->final_softcap > 0)
        for (int t = 0; t < n - t0; t++) rq_softcap(logits + (size_t)t * c->n_vocab, c->n_vocab, c->final_softcap);
}

/* One pass of n <= max_ubatch tokens. */
static void forward_pass(rq_model *m, const int32_t *tokens, int n, int pos0, float *logits, int all_logits) {
    const rq_config *c = &m->cfg;
    const int d = c->n_embd;

    embed(m, tokens, n);
    record(m, 0, n);
    const int hd = c->head_dim, n_bases = c->sliding_window > 0 ? 2 : 1;
    FOR_TOKENS
    for (int t = 0; t < n; t++)
        for (int b = 0; b < n_bases; b++) rope_angles(m->rope_cs[b] + (size_t)t * hd, m->rope_freq[b], c->n_rot / 2, pos0 + t,
                                                      c->rope_mscale);
    for (int il = 0; il < c->n_layer; il++) {
        attention(m, il, n, pos0);
        FOR_TOKENS
        for (int t = 0; t < n; t++) add_inplace(m->x + (size_t)t * d, m->xb + (size_t)t * d, d);
        feed_forward(m, il, n);
        FOR_TOKENS
        for (int t = 0; t < n; t++) add_inplace(m->x + (size_t)t * d, m->xb + (size_t)t * d, d);
        record(m, il + 1, n);
    }
    if (logits) logits_for(m, all_logits ? 0 : n - 1, n, logits);
}

int rq_forward(rq_model *m, const int32_t *tokens, int n, int pos0, float *logits, int all_logits) {
    if (n <= 0 || pos0 < 0 || pos0 + n > m->kv.capacity) return -1;
    const int U = m->cfg.max_ubatch;
    for (int start = 0; start < n; start += U) {
        int len = n - start < U ? n - start : U;
        int last = start + len == n;
        float *out = NULL;
        if (all_logits) out = logits + (size_t)start * m->cfg.n_vocab;
        else if (last) out = logits;
        forward_pass(m, tokens + start, len, pos0 + start, out, all_logits);
    }
    return 0;
}
