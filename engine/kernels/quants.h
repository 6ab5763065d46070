/* Quantized weight formats, the int8 activation format, and the dot/matmul kernels.
 *
 * Weight blocks are GGUF's (ggml's) on-disk layouts, read in place from the mapped file.
 * Every fast kernel (AVX-512 VNNI, AVX2) has a scalar reference twin; the path is chosen once
 * at start-up from CPU flags (RQLLM_KERNEL=scalar|avx2|avx512 forces one) and can be switched
 * at run time by tests with rq_set_kernel_path().
 *
 * Activations for quantized weights are quantized once per matmul to rq_act: int8 values in
 * blocks of 32 with one f32 scale per block and the int sum of every 16 values. One format
 * serves every weight type: per-32 scales line up with the sub-blocks of the K types, and the
 * 16-sums let kernels use unsigned x signed products (vpdpbusd) and correct for weight offsets
 * and mins afterwards. The scale may span 256 values instead (the 8 blocks of a super-block
 * share it, as in ggml's Q8_K): Q4_K's and IQ4_XS's kernels need that form (rq_act_span), so
 * that a super-block's 8 block sums add up in int32 before one float step (q4_K.c, iq4_xs.c).
 */
#ifndef RQLLM_QUANTS_H
#define RQLLM_QUANTS_H

#include <stddef.h>
#include <stdint.h>

/* Type ids are ggml's (GGMLQuantizationType), so a tensor's GGUF type maps directly. */
typedef enum {
    RQ_F32 = 0,
    RQ_F16 = 1,
    RQ_Q4_0 = 2,
    RQ_Q4_1 = 3,
    RQ_Q5_0 = 6,
    RQ_Q5_1 = 7,
    RQ_Q8_0 = 8,
    RQ_Q2_K = 10,
    RQ_Q3_K = 11,
    RQ_Q4_K = 12,
    RQ_Q5_K = 13,
    RQ_Q6_K = 14,
    RQ_IQ4_NL = 20,
    RQ_IQ4_XS = 23,
    RQ_BF16 = 30,
} rq_type;

#define RQ_ACT_BLOCK 32

/* A quantized activation vector (or ntok of them, one after another with the same n).
 * n is a multiple of 32 (of 256 when used with K-type or IQ4_XS weights).
 * x[i] ~= d[i/32] * qs[i]; sum16[j] = sum of qs[16j .. 16j+15]. With span 256, d[8s .. 8s+7] are
 * one scale, from the largest |x| of the 256 values s. */
typedef struct {
    int n;
    int span;        /* values under one scale: 32, or 256 */
    int8_t *qs;      /* n values, 64-byte aligned */
    float *d;        /* n/32 scales */
    int32_t *sum16;  /* n/16 sums */
    const float *f;  /* the original f32 values (n): used by F32/F16/BF16 weights */
} rq_act;

/* Kernel paths. */
enum { RQ_PATH_SCALAR = 0, RQ_PATH_AVX2 = 1, RQ_PATH_AVX512 = 2 };

/* Pick the best path for this CPU (honours RQLLM_KERNEL). Idempotent; called by everything below. */
void rq_kernels_init(void);
int rq_kernel_path(void);
/* Force a path; returns 0, or -1 if this CPU cannot run it. */
int rq_set_kernel_path(int path);
int rq_cpu_supports_path(int path);
/* AVX-VNNI under the AVX2 path (Q4_K and the signed types' prefill; the same results): 1 when on. On
 * by default where the CPU has it (RQLLM_AVXVNNI=0: off); rq_set_avxvnni returns -1 if the CPU lacks it. */
int rq_avxvnni(void);
int rq_set_avxvnni(int on);
/* The kernel route a matmul of ntok tokens of type t takes on a path ("r16-expanded-vnni", "r16",
 * "v16", "pf8", "tiles", "reference", "none"); r16: with R16 copies. */
const char *rq_matmul_route(int path, int t, int ntok, int r16);

/* 1 if type t is supported. */
int rq_type_supported(int t);
/* Elements per block and bytes per block of type t (1 and 4/2 for F32/F16/BF16). */
int rq_block_elems(int t);
int rq_block_bytes(int t);
/* Bytes of one row of n elements (n a multiple of the block size). */
size_t rq_row_bytes(int t, int n);

/* Reference dequantization of one row of n elements (scalar, the ground truth twin). */
void rq_dequant_row(int t, const void *row, float *out, int n);

/* Quantize n floats into act (buffers preallocated by the caller: qs n, d n/32, sum16 n/16).
 * Sets act->f = x. rq_quantize_act: a scale per 32 values; _span: per `span` (32, or 256 with n a
 * multiple of 256). */
void rq_quantize_act(const float *x, int n, rq_act *act);
void rq_quantize_act_span(const float *x, int n, int span, rq_act *act);
/* The span of activation scale weight type t needs: 256 for Q4_K and IQ4_XS, else 32 (their kernels
 * take either). Activations shared by several matrices take the largest of theirs. Every matmul and
 * dot of a Q4_K or IQ4_XS matrix aborts with a message when given activations of span 32: a
 * caller's bug. */
int rq_act_span(int t);

/* Dot product of one weight row (type t, n elements) with one activation vector:
 * reference (always scalar) and dispatched (current path). */
float rq_vec_dot_ref(int t, int n, const void *row, const rq_act *x);
float rq_vec_dot(int t, int n, const void *row, const rq_act *x);

/* out[k * ldo + r] = dot(W row r, activation k) for r in [r0, r1), k in [0, ntok).
 * W: rows of `cols` elements of type t, contiguous (row r at W + r * rq_row_bytes(t, cols)).
 * acts: ntok activation vectors of length cols, each a separate rq_act.
 * Single-threaded: the caller splits rows across threads (see rq_matmul). */
void rq_matmul_rows(int t, const void *W, int cols, int r0, int r1,
                    const rq_act *acts, int ntok, float *out, int ldo);

/* Same over all rows, split across OpenMP threads (nthreads <= 0: OpenMP default).
 * Safe to call from inside an existing parallel region? No: call from serial code. */
void rq_matmul(int t, const void *W, int rows, int cols,
               const rq_act *acts, int ntok, float *out, int ldo, int nthreads);

/* rq_matmul for code that already runs an OpenMP parallel region (one region per layer or per
 * token avoids the cost of opening one per matmul): every thread of the team calls it with the
 * same arguments; rows are split across the team; it ends with a barrier, so out is complete
 * for every thread on return. Outside a parallel region it runs single-threaded. */
void rq_matmul_team(int t, const void *W, int rows, int cols,
                    const rq_act *acts, int ntok, float *out, int ldo);

/* Several matmuls over activations of cols elements, e.g. q/k/v or gate/up, or the experts of a
 * mixture-of-experts layer, as one parallel job: decode-sized calls (ntok <= 2; with R16 copies,
 * ntok <= 8) split the concatenated rows by bytes across one team, so small matrices do not each
 * pay for a region and a join; larger calls run each op through rq_matmul. Results equal
 * rq_matmul's for each op. An op multiplies the call's activations, or its own when acts is set
 * (an expert and the tokens routed to it). A gated pair (gated: gate, then up) gives gate's out
 * act(gate) * up, as rq_gated_act after both would (bit for bit); up's out is scratch then. */
typedef struct {
    int type;
    const void *W;
    int rows;
    float *out;
    int ldo;
    const void *r16;      /* the R16 copy of W, or NULL (see rq_matmul_r16) */
    const rq_act *acts;   /* NULL: the call's acts and ntok */
    int ntok;
    int gated;            /* RQ_GATED_SILU or RQ_GATED_GELU: this op is a gate and the next op its up (the same
                           * rows and tokens); out gets act(gate) * up (rq_gated_act), each range of rows as
                           * soon as both are computed where the job runs them together. 0: a plain op */
} rq_matmul_op;
enum { RQ_GATED_SILU = 1, RQ_GATED_GELU = 2 };
void rq_matmul_multi(const rq_matmul_op *ops, int nops, int cols, const rq_act *acts, int ntok, int nthreads);

/* Reference twin of rq_matmul: dequantizes rows and multiplies in f32 with the float
 * activations (acts[k].f). Slow; for tests. */
void rq_matmul_ref(int t, const void *W, int rows, int cols,
                   const rq_act *acts, int ntok, float *out, int ldo);

/* Repacked weights ("R16"): a matrix's rows in groups of 16, the same bits rearranged so that one
 * 64-byte load holds the same 4 elements of 16 rows (quants/r16_layout.c). Made once per model
 * file (engine/repack.py keeps them in a shared cache file) and used by the AVX-512 path; results
 * equal the GGUF layout's bit for bit. Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K,
 * IQ4_NL, IQ4_XS. */
int rq_r16_supported(int t);
/* Changes whenever the R16 layout does: caches of an older layout must be rebuilt. */
int rq_r16_layout_version(void);
/* The distance (bytes) at which one-token passes prefetch a repacked group of type t (t < 0: every
 * type) ahead, into L2 when to_l2 (else L1); returns the old distance (and the old to_l2 in
 * *was_to_l2 unless NULL; every type: Q4_K's). */
size_t rq_r16_set_prefetch(int t, size_t bytes, int to_l2, int *was_to_l2);
/* How decode-sized calls (ntok <= 8) of type t (t < 0: every type) with R16 copies compute: with the
 * kernel path's R16 kernels, with the AVX2 R16 kernels on the avx512 path, or on the GGUF layout (W).
 * Results are the same bit for bit. Returns the previous mode (every type: Q4_K's), or -1 for an
 * unknown mode or type. */
enum { RQ_DECODE_R16 = 0, RQ_DECODE_R16_256 = 1, RQ_DECODE_GGUF = 2 };
int rq_set_decode_mode(int t, int mode);
/* 1 if the current kernel path computes with R16 copies (else rq_matmul_r16 uses W). */
int rq_r16_usable(void);
/* Bytes of the R16 copy of a rows x cols matrix of type t (rows padded to 16); 0 if unsupported. */
size_t rq_r16_bytes(int t, int rows, int cols);
/* A thread's share of a multi-op R16 call (rq_matmul_multi, decode-sized): the groups [*g0, *g1) of
 * an op (ng groups of gb bytes from byte `base` of the ops' concatenation) whose first byte lies in
 * the thread's byte range [lo, hi); returns 0 when there are none. */
int rq_r16_multi_share(size_t lo, size_t hi, size_t base, size_t gb, int ng, int *g0, int *g1);
/* Repack 16-row groups [g0, g1) of W into R (rq_r16_bytes long), on nthreads threads. */
void rq_r16_repack(int t, const void *W, int rows, int cols, void *R, int g0, int g1, int nthreads);
/* rq_matmul with the R16 copy R of W when R is not NULL and the path uses R16; else rq_matmul on W. */
void rq_matmul_r16(int t, const void *W, const void *R, int rows, int cols, const rq_act *acts, int ntok,
                   float *out, int ldo, int nthreads);

/* f16 / bf16 <-> f32 scalar conversions. */
float rq_f16_to_f32(uint16_t h);
uint16_t rq_f32_to_f16(float f);
float rq_bf16_to_f32(uint16_t h);

#endif
