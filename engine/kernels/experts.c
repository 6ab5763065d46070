/* A mixture-of-experts feed-forward layer: route, group by expert, multiply, combine (experts.h). */
#include "experts.h"
#include "attention.h"   /* rq_exp */

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

struct rq_experts {
    int n_embd, n_expert, n_used, n_ff, max_tokens;
    float *logits;     /* [T][n_expert] router logits, then probabilities */
    int *chosen;       /* [T][n_used] expert ids, largest probability first */
    float *weight;     /* [T][n_used] */
    int *count, *first;/* per expert: its pairs, and where they start in pair order ([n_expert + 1]) */
    int *pair_token;   /* [T * n_used] the token of each pair, pairs grouped by expert */
    int *slot_pair;    /* [T][n_used] the pair of each (token, slot) */
    rq_act *routed;    /* [T * n_used] each pair's token's activations (borrowed buffers) */
    float *gate, *up;  /* [T * n_used][n_ff] */
    rq_act *inner;     /* [T * n_used] the activated products, quantized for down */
    int8_t *inner_qs;
    float *inner_d;
    int32_t *inner_sum16;
    float *down;       /* [T * n_used][n_embd] */
    rq_matmul_op *ops; /* [2 * n_expert] */
};

static void *zalloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) return NULL;
    memset(p, 0, bytes);
    return p;
}

void rq_experts_free(rq_experts *e) {
    if (!e) return;
    free(e->logits); free(e->chosen); free(e->weight); free(e->count); free(e->first); free(e->pair_token);
    free(e->slot_pair); free(e->routed); free(e->gate); free(e->up); free(e->inner); free(e->inner_qs);
    free(e->inner_d); free(e->inner_sum16); free(e->down); free(e->ops);
    free(e);
}

rq_experts *rq_experts_create(int n_embd, int n_expert, int n_used, int n_ff, int max_tokens) {
    if (n_embd <= 0 || n_expert <= 0 || n_used <= 0 || n_used > n_expert || n_ff <= 0 || n_ff % 32 || max_tokens <= 0)
        return NULL;
    rq_experts *e = calloc(1, sizeof(rq_experts));
    if (!e) return NULL;
    e->n_embd = n_embd, e->n_expert = n_expert, e->n_used = n_used, e->n_ff = n_ff, e->max_tokens = max_tokens;
    const size_t T = (size_t)max_tokens, P = T * (size_t)n_used;
    e->logits = zalloc(sizeof(float) * T * n_expert);
    e->chosen = zalloc(sizeof(int) * P);
    e->weight = zalloc(sizeof(float) * P);
    e->count = zalloc(sizeof(int) * (size_t)n_expert);
    e->first = zalloc(sizeof(int) * (size_t)(n_expert + 1));
    e->pair_token = zalloc(sizeof(int) * P);
    e->slot_pair = zalloc(sizeof(int) * P);
    e->routed = zalloc(sizeof(rq_act) * P);
    e->gate = zalloc(sizeof(float) * P * n_ff);
    e->up = zalloc(sizeof(float) * P * n_ff);
    e->inner = zalloc(sizeof(rq_act) * P);
    e->inner_qs = zalloc(P * n_ff);
    e->inner_d = zalloc(sizeof(float) * P * (n_ff / 32));
    e->inner_sum16 = zalloc(sizeof(int32_t) * P * (n_ff / 16));
    e->down = zalloc(sizeof(float) * P * n_embd);
    e->ops = zalloc(sizeof(rq_matmul_op) * 2 * (size_t)n_expert);
    if (!e->logits || !e->chosen || !e->weight || !e->count || !e->first || !e->pair_token || !e->slot_pair ||
        !e->routed || !e->gate || !e->up || !e->inner || !e->inner_qs || !e->inner_d || !e->inner_sum16 || !e->down ||
        !e->ops) {
        rq_experts_free(e);
        return NULL;
    }
    for (size_t p = 0; p < P; p++) {
        e->inner[p].n = n_ff;
        e->inner[p].qs = e->inner_qs + p * n_ff;
        e->inner[p].d = e->inner_d + p * (n_ff / 32);
        e->inner[p].sum16 = e->inner_sum16 + p * (n_ff / 16);
    }
    return e;
}

/* Softmax over the router's logits (in place), then the top n_used (largest first; equal
 * probabilities: the lower id first) and their weights. */
static void route_token(const rq_experts *e, float *p, int *chosen, float *weight, int norm_weights) {
    const int E = e->n_expert, K = e->n_used;
    float mx = p[0];
    for (int i = 1; i < E; i++) mx = p[i] > mx ? p[i] : mx;
    for (int i = 0; i < E; i++) p[i] -= mx;
    rq_exp(p, p, E);   /* the pass's exp: the same values on every kernel path */
    double sum = 0.0;
    for (int i = 0; i < E; i++) sum += p[i];
    const float inv = (float)(1.0 / sum);
    for (int i = 0; i < E; i++) p[i] *= inv;
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int i = 0; i < E; i++) {
            int taken = 0;
            for (int j = 0; j < k; j++) taken |= chosen[j] == i;
            if (!taken && (best < 0 || p[i] > p[best])) best = i;
        }
        chosen[k] = best;
        weight[k] = p[best];
    }
    if (norm_weights) {
        float s = 0.0f;
        for (int k = 0; k < K; k++) s += weight[k];
        if (s < 6.103515625e-5f) s = 6.103515625e-5f;
        for (int k = 0; k < K; k++) weight[k] /= s;
    }
}

/* Expert x's slice of a stacked tensor: its rows in the GGUF layout and in the R16 copy (NULL when
 * its rows do not start a 16-row group). */
static rq_matmul_op expert_op(const rq_tensor *W, int rows_per_expert, int x, float *out, int ldo, const rq_act *acts,
                              int ntok) {
    const size_t rb = rq_row_bytes(W->type, W->cols), first_row = (size_t)x * rows_per_expert;
    rq_matmul_op op = {W->type, (const uint8_t *)W->data + first_row * rb, rows_per_expert, out, ldo, NULL, acts, ntok};
    if (W->r16 && rows_per_expert % 16 == 0)
        op.r16 = (const uint8_t *)W->r16 + first_row / 16 * rq_r16_bytes(W->type, 16, W->cols);
    return op;
}

int rq_experts_ffn(rq_experts *e, const rq_tensor *router, const rq_tensor *gate, const rq_tensor *up,
                   const rq_tensor *down, int norm_weights, int gelu, const rq_act *acts, int n, float *out, int ldo,
                   int nthreads) {
    const int E = e->n_expert, K = e->n_used, F = e->n_ff, D = e->n_embd;
    if (n <= 0 || n > e->max_tokens || router->rows != E || router->cols != D || gate->rows != E * F ||
        gate->cols != D || up->rows != E * F || up->cols != D || down->rows != E * D || down->cols != F)
        return -1;

    /* route */
    rq_matmul_r16(router->type, router->data, router->r16, E, D, acts, n, e->logits, E, nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n > 1)
    for (int t = 0; t < n; t++)
        route_token(e, e->logits + (size_t)t * E, e->chosen + (size_t)t * K, e->weight + (size_t)t * K, norm_weights);

    /* group the (token, slot) pairs by expert */
    memset(e->count, 0, sizeof(int) * (size_t)E);
    for (int p = 0; p < n * K; p++) e->count[e->chosen[p]]++;
    e->first[0] = 0;
    for (int x = 0; x < E; x++) e->first[x + 1] = e->first[x] + e->count[x];
    memset(e->count, 0, sizeof(int) * (size_t)E);
    for (int t = 0; t < n; t++)
        for (int k = 0; k < K; k++) {
            const int x = e->chosen[t * K + k], p = e->first[x] + e->count[x]++;
            e->pair_token[p] = t;
            e->slot_pair[t * K + k] = p;
            e->routed[p] = acts[t];
        }
    const int P = n * K;

    /* gate and up of every used expert, over its tokens, as one job */
    int nops = 0;
    for (int x = 0; x < E; x++) {
        const int c = e->count[x], p0 = e->first[x];
        if (!c) continue;
        e->ops[nops] = expert_op(gate, F, x, e->gate + (size_t)p0 * F, F, e->routed + p0, c);
        e->ops[nops++].gated = gelu ? RQ_GATED_GELU : RQ_GATED_SILU;
        e->ops[nops++] = expert_op(up, F, x, e->up + (size_t)p0 * F, F, e->routed + p0, c);
    }
    /* one job split by (expert, rows); each expert's gate and up rows of a share run together and are
     * activated while in cache (ik_llama.cpp's fused MoE op): e->gate gets act(gate) * up */
    rq_matmul_multi(e->ops, nops, D, NULL, 0, nthreads);

#pragma omp parallel for num_threads(nthreads) schedule(static) if (n > 1)   /* decode: too little for a region */
    for (int p = 0; p < P; p++) rq_quantize_act_span(e->gate + (size_t)p * F, F, rq_act_span(down->type), &e->inner[p]);

    /* down of every used expert */
    nops = 0;
    for (int x = 0; x < E; x++) {
        const int c = e->count[x], p0 = e->first[x];
        if (c) e->ops[nops++] = expert_op(down, D, x, e->down + (size_t)p0 * D, D, e->inner + p0, c);
    }
    rq_matmul_multi(e->ops, nops, F, NULL, 0, nthreads);

    /* combine: weight times output, added in slot order (llama.cpp: ggml_mul, then ggml_add from slot 0) */
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n > 1)
    for (int t = 0; t < n; t++) {
        float *o = out + (size_t)t * ldo;
        for (int k = 0; k < K; k++) {
            const float w = e->weight[t * K + k], *y = e->down + (size_t)e->slot_pair[t * K + k] * D;
            if (k == 0)
                for (int i = 0; i < D; i++) o[i] = y[i] * w;
            else
                for (int i = 0; i < D; i++) o[i] += y[i] * w;
        }
    }
    return 0;
}
