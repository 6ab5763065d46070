/* A mixture-of-experts feed-forward layer (qwen3moe, Mixtral-style llama, olmoe).
 *
 * The rules are llama.cpp's build_moe_ffn (src/llama-graph.cpp), with the softmax gating those
 * architectures use: the router's logits (ffn_gate_inp x) go through a softmax over all experts;
 * the top k probabilities pick the experts (ggml_argsort_top_k: largest first); their
 * probabilities are the weights, renormalised to sum 1 when norm_weights is set (qwen3moe and
 * llama pass norm_w = true, olmoe false; the sum is clamped at 6.103515625e-5, f16's smallest
 * normal); each expert's output down_e(act(gate_e x) * up_e x) is multiplied by its weight and the
 * k products are added in the order of the top k.
 *
 * An expert tensor stacks n_expert matrices (GGUF's 3-D {cols, rows, n_expert}): expert e is rows
 * [e * rows_per_expert, (e + 1) * rows_per_expert) of an rq_tensor of n_expert * rows_per_expert
 * rows, and of its R16 copy when rows_per_expert is a multiple of 16 (whole groups).
 *
 * Only the chosen experts' rows are read. A pass groups its (token, slot) pairs by expert, as
 * llama.cpp's mul_mat_id does: each expert's matrices are multiplied once against the tokens routed
 * to it. The matmuls of all experts go to rq_matmul_multi as one job, so threads split the work by
 * (expert, rows) and a pass with few busy experts still uses every core. A token's result is the
 * same whatever else is in its pass (the kernels' float sequence does not depend on the tile).
 */
#ifndef RQLLM_EXPERTS_H
#define RQLLM_EXPERTS_H

#include "forward.h"

typedef struct rq_experts rq_experts;

/* Scratch for passes of up to max_tokens tokens; NULL on allocation failure. */
rq_experts *rq_experts_create(int n_embd, int n_expert, int n_used, int n_ff, int max_tokens);
void rq_experts_free(rq_experts *e);

/* out[t * ldo + i] (i < n_embd) = the layer's output for token t < n, whose normed input is acts[t]
 * (quantized; acts[t].f its floats, which an F32/F16 router reads). gelu: the gate's activation is
 * GELU-tanh, else SiLU. Returns 0, or -1 on bad shapes. */
int rq_experts_ffn(rq_experts *e, const rq_tensor *router, const rq_tensor *gate, const rq_tensor *up,
                   const rq_tensor *down, int norm_weights, int gelu, const rq_act *acts, int n, float *out, int ldo,
                   int nthreads);

#endif
