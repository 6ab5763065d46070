/* The float kernels of the forward pass (forward.c): attention over the KV ring, e^x (the softmax's
 * and the gated activations'), the gated activations, and the stores into an f16 or f32 KV cache.
 *
 * Each SIMD kernel (AVX2, AVX-512) sits beside its scalar reference in attention.c and runs on the
 * process's one kernel path (quants.h: rq_kernel_path). exp, the gated activations and the KV stores
 * give the reference's values bit for bit on every path; attention's SIMD kernels sum in another
 * order than the reference (so within float rounding of it), and the AVX-512 kernel gives the AVX2
 * kernel's results bit for bit. tests/test_attention_kernels.py holds each kernel to its reference.
 */
#ifndef RQLLM_ATTENTION_H
#define RQLLM_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

/* The shape of one layer's attention: KV ring of `slots` positions ([slots][n_head_kv * hd]) of
 * f32, or f16 when f16 is set; window > 0: a token sees only the last `window` positions;
 * softcap > 0: scores become softcap * tanh(score / softcap) before the softmax. */
typedef struct {
    int n_head, n_head_kv, hd, slots, window, f16;
    float scale, softcap;
} rq_att_shape;

/* Per-thread scratch floats for attention over up to `capacity` positions of head size hd. */
size_t rq_att_scratch_floats(int capacity, int hd);

/* Attention of n tokens at positions pos0.. (q and out: [n][n_head * hd]) over the ring K, V, in
 * blocks of `tokens` consecutive tokens x `heads` query heads of one KV head (0: the pass's choice)
 * on n_threads threads, each with scratch_floats (rq_att_scratch_floats) of scratch. A token's
 * result does not depend on the blocks or the threads. Call from serial code. */
void rq_attend_tokens(const rq_att_shape *a, const float *q, const void *K, const void *V, float *out, int n,
                      int pos0, int tokens, int heads, int n_threads, float *scratch, size_t scratch_floats);

/* Test hook: rq_attend_tokens with its own scratch, from loose arguments (rq_att_shape's fields).
 * Returns -1 on bad arguments (the ring must hold every position a call reads). */
int rq_attention(const float *q, const void *k, const void *v, int f16, float *out, int n, int pos0, int n_head,
                 int n_head_kv, int hd, int slots, int window, float scale, float softcap, int tokens, int heads,
                 int n_threads);

/* Entries [at, at + n) of a KV array from x: f32 as is (f16 = 0), or rounded to the nearest half,
 * ties to even, as numpy and llama.cpp's f16 cache (f16 = 1). */
void rq_kv_store(void *kv, int f16, size_t at, const float *x, int n);

/* y[i] = e^x[i] as the softmax and the gated activations compute it (max error 0.81 ulp). */
void rq_exp(const float *x, float *y, int n);

/* x = cap * tanh(x / cap) on x[0..n) (Gemma 2 caps its attention scores and its logits). */
void rq_softcap(float *x, int n, float cap);

/* g[i] = act(g[i]) * up[i], act SiLU or (gelu) GELU-tanh. */
void rq_gated_act(float *g, const float *up, size_t n, int gelu);

#endif
