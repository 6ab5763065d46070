/* The transformer forward pass over weights mapped in place from a GGUF file.
 *
 * Shaped like llama2.c's run.c: a config struct, a weights struct whose tensors point into the
 * mapped file, a KV cache whose memory the caller owns (sized from a byte budget), and one
 * forward() that reads top to bottom. It runs a batch of consecutive tokens at once (prefill as
 * matrix x matrix) or a single token (decode).
 */
#ifndef RQLLM_FORWARD_H
#define RQLLM_FORWARD_H

#include <stddef.h>
#include <stdint.h>

#include "quants.h"

/* The configuration, declared once: each X(type, name) below becomes a field of rq_config and
 * an entry of rq_config_fields, through which Python (engine/model.py's Config, forward.pxi)
 * fills the struct by name. Architectures are not named here: each is a set of these switches.
 * Only int and float fields (pointers go apart, below). */
#define RQ_CONFIG_FIELDS(X)                                                                          \
    X(int, n_layer) X(int, n_embd) X(int, n_ff) X(int, n_head) X(int, n_head_kv) X(int, head_dim)   \
    X(int, n_vocab)                                                                                  \
    X(float, norm_eps)                                                                               \
    X(int, n_rot)           /* rotated dimensions per head (<= head_dim; the rest pass through) */   \
    X(int, rope_neox)       /* 0: rotate adjacent pairs (llama); 1: rotate (i, i + n_rot/2) */      \
    X(float, rope_mscale)   /* multiplies cos and sin (YaRN's and LongRoPE's attention factor) */    \
    X(int, sliding_window)  /* 0: none */                                                            \
    X(int, swa_pattern)     /* layer il is local when il % swa_pattern < swa_pattern - 1 */          \
    X(float, embd_scale)    /* the embedding rows are multiplied by this (gemma: sqrt(n_embd)) */    \
    X(float, attn_scale)    /* scale applied to q.k */                                               \
    X(float, attn_softcap)  /* > 0: scores become cap * tanh(score / cap) (gemma2) */                \
    X(float, final_softcap) /* > 0: the same on the logits */                                        \
    X(int, ffn_gelu)        /* 1: GELU-tanh gate (gemma); 0: SiLU (SwiGLU) */                        \
    X(int, qk_norm_full)    /* 1: attn_q_norm / attn_k_norm span all heads at once (olmoe) */        \
    X(int, n_expert)        /* > 0: the FFN is a mixture of experts (experts.h) */                   \
    X(int, n_expert_used)   /* experts per token */                                                  \
    X(int, n_ff_exp)        /* an expert's FFN width */                                              \
    X(int, expert_norm)     /* 1: the chosen experts' weights are renormalised to sum 1 */           \
    X(int, max_ubatch)      /* most tokens per internal pass; longer inputs are split */             \
    X(int, n_threads)

/* Per-layer tensors, declared once: each X(name) is an rq_tensor field of rq_layer_weights and an
 * entry of rq_layer_fields, which forward.pxi fills from engine/model.py's LAYER_TENSORS by name.
 * An absent optional tensor has data NULL. */
#define RQ_LAYER_FIELDS(X)                                                                           \
    X(attn_norm) X(wq) X(wk) X(wv) X(wo)                                                             \
    X(bq) X(bk) X(bv)                     /* q/k/v biases (F32), optional */                         \
    X(attn_q_norm) X(attn_k_norm)         /* per-head RMSNorm of q and k before RoPE */              \
    X(post_attn_norm)                     /* RMSNorm of the attention output (gemma) */              \
    X(ffn_norm) X(ffn_gate) X(ffn_up) X(ffn_down)                                                    \
    X(ffn_gate_inp)                       /* the experts' router (n_expert rows) */                  \
    X(ffn_gate_exps) X(ffn_up_exps) X(ffn_down_exps) /* n_expert stacked matrices (experts.h) */     \
    X(post_ffw_norm)                      /* RMSNorm of the FFN output (gemma) */

#define RQ_DECLARE_CONFIG_FIELD(type, name) type name;
#define RQ_DECLARE_LAYER_FIELD(name) rq_tensor name;

typedef struct {
    RQ_CONFIG_FIELDS(RQ_DECLARE_CONFIG_FIELD)
    /* RoPE frequency of each rotated pair i < n_rot/2 (the angle at position p is p * freq[i]),
     * for global layers and for sliding-window layers: base^(-2i/n_rot) with the model's
     * frequency factors and scaling already applied (engine/rope.py). Borrowed. */
    const float *rope_freq, *rope_freq_local;
} rq_config;

/* A field of rq_config as Python sees it: its name, byte offset, and whether it is a float. */
typedef struct {
    const char *name;
    int offset;
    int is_float;
} rq_config_field;
extern const rq_config_field rq_config_fields[];
extern const int rq_config_n_fields;

/* One tensor in the mapped file: rows x cols elements of `type`, row-major (ggml's ne1 x ne0). */
typedef struct {
    int type;
    const void *data;  /* NULL when absent */
    int rows, cols;
    const void *r16;   /* the repacked (R16) copy of data, or NULL (quants.h) */
} rq_tensor;

typedef struct {
    RQ_LAYER_FIELDS(RQ_DECLARE_LAYER_FIELD)
} rq_layer_weights;

/* A field of rq_layer_weights: its name and byte offset. */
typedef struct {
    const char *name;
    int offset;
} rq_layer_field;
extern const rq_layer_field rq_layer_fields[];
extern const int rq_layer_n_fields;

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

#endif
