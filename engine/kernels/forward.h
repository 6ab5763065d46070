/* The transformer forward pass over weights mapped in place from a GGUF file.
 *
 * Shaped like llama2.c's run.c: a config struct, a weights struct whose tensors point into the
 * mapped file, a KV cache whose memory the caller owns (sized from a byte budget), and one
 * forward() that reads top to bottom. It runs a batch of consecutive tokens at once (prefill as
 * matrix x matrix) or a single token (decode).
 */
#ifndef RQLLM_FORWARD_H
#define RQLLM_FORWARD_H

#include <stdint.h>

#include "quants.h"

enum { RQ_ARCH_LLAMA = 0, RQ_ARCH_GEMMA3 = 1, RQ_ARCH_QWEN2 = 2 };

typedef struct {
    int arch;
    int n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, n_vocab;
    float norm_eps;
    float rope_base;        /* global layers */
    float rope_base_local;  /* sliding-window layers (gemma3) */
    int rope_neox;          /* 0: rotate adjacent pairs (llama); 1: rotate (i, i + d/2) */
    int sliding_window;     /* 0: none */
    int swa_pattern;        /* layer il is local when il % swa_pattern < swa_pattern - 1 (gemma3: 6) */
    float embd_scale;       /* gemma3: sqrt(n_embd); else 1 */
    float attn_scale;       /* scale applied to q.k */
    int ffn_gelu;           /* 1: GELU-tanh gate (gemma3); 0: SiLU (SwiGLU) */
    int max_ubatch;         /* most tokens per internal pass; longer inputs are split */
    int n_threads;
} rq_config;

/* One tensor in the mapped file: rows x cols elements of `type`, row-major (ggml's ne1 x ne0). */
typedef struct {
    int type;
    const void *data;  /* NULL when absent */
    int rows, cols;
    const void *r16;   /* the repacked (R16) copy of data, or NULL (quants.h) */
} rq_tensor;

typedef struct {
    rq_tensor attn_norm, wq, wk, wv, wo;
    rq_tensor bq, bk, bv;                     /* qwen2 biases (F32), optional */
    rq_tensor attn_q_norm, attn_k_norm;       /* gemma3 per-head norms */
    rq_tensor post_attn_norm;                 /* gemma3 */
    rq_tensor ffn_norm, ffn_gate, ffn_up, ffn_down;
    rq_tensor post_ffw_norm;                  /* gemma3 */
} rq_layer_weights;

typedef struct {
    rq_tensor token_embd;
    rq_tensor output_norm;
    rq_tensor output;  /* token_embd when the model ties its output */
    rq_layer_weights *layers;
} rq_weights;

/* The KV cache, caller-owned memory of f16 (IEEE half) or f32 entries. Layer l keeps slots[l]
 * positions in a ring: position p lives in slot p % slots[l]. Global layers get the full
 * capacity; sliding-window layers only window + max_ubatch - 1 (what one pass can still need). */
typedef struct {
    int capacity;        /* positions the cache holds (the largest usable position + 1) */
    const int *slots;    /* per layer */
    void **k, **v;       /* per layer: slots[l] x (n_head_kv * head_dim) entries */
    int f16;             /* 1: entries are uint16 halves (rounded to nearest even), 0: f32 */
} rq_kv;

typedef struct rq_model rq_model;

/* Returns NULL on allocation failure. Weights and KV memory are borrowed, not copied. */
rq_model *rq_model_create(const rq_config *cfg, const rq_weights *w, const rq_kv *kv);
void rq_model_free(rq_model *m);

/* Run tokens[0..n) at positions pos0.. (the KV cache must hold positions < pos0 already).
 * Writes logits of the last token (all_logits = 0: logits[n_vocab]) or of every token
 * (all_logits = 1: logits[n * n_vocab]). Returns 0, or -1 if pos0 + n exceeds the capacity. */
int rq_forward(rq_model *m, const int32_t *tokens, int n, int pos0, float *logits, int all_logits);

/* Threads for the following passes, 1 .. the count the model was created with (results do not
 * depend on it); returns the count now in use. */
int rq_model_set_threads(rq_model *m, int n);

/* Test hook (llm.c-style layer checks): while buf != NULL, every rq_forward call with
 * n <= max_tokens records the residual stream after the embedding (l = 0) and after each layer
 * (l = 1..n_layer) at buf[(l * max_tokens + t) * n_embd]. NULL stops recording. */
void rq_model_record_layers(rq_model *m, float *buf, int max_tokens);

/* Test hook: y[i] = e^x[i] as the softmax and the gated activations compute it, on the current
 * kernel path (the SIMD paths give the scalar one's values bit for bit). */
void rq_exp(const float *x, float *y, int n);

/* Test hook: the attention of n tokens at positions pos0.. (q, out: [n][n_head * hd]) over the KV
 * ring k, v ([slots][n_head_kv * hd] of f32, or of f16 when f16 is set; position p in slot p % slots;
 * window > 0: a token sees only
 * the last `window` positions) as the forward pass runs it, in blocks of `tokens` consecutive
 * tokens x `heads` query heads of one KV head (0: the pass's choice), on n_threads threads.
 * Returns -1 on bad arguments (the ring must hold every position a call reads). */
int rq_attention(const float *q, const void *k, const void *v, int f16, float *out, int n, int pos0, int n_head,
                 int n_head_kv, int hd, int slots, int window, float scale, int tokens, int heads, int n_threads);

#endif
