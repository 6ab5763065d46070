/* Quantized weight formats, int8 activations, dot products and matmuls.
 * See quants.h for the contract. Layout facts: ggml's ggml-common.h / ggml-quants.c.
 *
 * Integer model used by every path (scalar reference and SIMD alike): for activation block b
 * (32 values, scale d_b, int8 q) and the matching 32 weights with integer values w
 * (offset removed), the block contributes   scale_w * d_b * sum(w * q)   plus, for types
 * with mins,   - min_w * d_b * S_b   where S_b = sum16[2b] + sum16[2b+1].
 */
/*
 * The kernels are one translation unit: this file includes the parts below in this order, so
 * every static / always_inline helper and target attribute reaches every kernel. What is where
 * (engine/kernels/quants/):
 *   common.c       block sizes, the type_traits row and accessors, f16 / bf16, shared scale formats, macros
 *   tiles.c        token tiles for the SIMD kernels (tile, prep_tile), kernel function types
 *   simd_common.c  x86: the AVX2 building blocks the types' kernels share (KERN256, slots, rows4)
 *   act.c          activation quantization: scalar reference, AVX2, AVX-512
 *   r16_layout.c   the R16 repacked layout and its accessors
 *   float.c        F32, F16, BF16                     } each type: block struct, dequantization,
 *   iq4_nl.c       IQ4_NL (before legacy.c: it runs   } scalar reference dot product, its SIMD
 *                  legacy.c's kernels), the IQ4 table } kernels, prefill unpacking, R16 unit,
 *   legacy.c       Q4_0, Q4_1, Q5_0, Q5_1, Q8_0       } repacking and block loading
 *   q2_K_q3_K.c    Q2_K, Q3_K                         }
 *   q4_K.c         Q4_K                               }
 *   q5_K.c         Q5_K                               }
 *   q6_K.c         Q6_K                               }
 *   iq4_xs.c       IQ4_XS                             }
 *   pf8.c          x86: the AVX2 8-token prefill driver
 *   v16.c          x86: the AVX-512 VNNI prefill driver on the GGUF layout
 *   r16.c          the R16 drivers: repacking, AVX-512 and AVX2 kernels on repacked groups
 *   tables.c       OPS, one row per type: layout, dequantization, reference dot, SIMD entry points
 *   dispatch.c     kernel path selection, per-path kernel lookup, rq_quantize_act, rq_vec_dot
 *   matmul.c       matmul drivers and threading, R16 matmuls, rq_matmul_ref
 */
#include "quants.h"
#include "attention.h"   /* rq_gated_act (gated pairs of rq_matmul_multi) */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"   /* x86: <immintrin.h>, RQ_HAVE_X86, the A512 target; -DRQ_SIMDE_AVX512: SIMDe test build */

#include "quants/common.c"
#include "quants/tiles.c"
#include "quants/simd_common.c"
#include "quants/act.c"
#include "quants/r16_layout.c"
#include "quants/float.c"
#include "quants/iq4_nl.c"
#include "quants/legacy.c"
#include "quants/q2_K_q3_K.c"
#include "quants/q4_K.c"
#include "quants/q5_K.c"
#include "quants/q6_K.c"
#include "quants/iq4_xs.c"
#include "quants/pf8.c"
#include "quants/v16.c"
#include "quants/r16.c"
#include "quants/tables.c"
#include "quants/dispatch.c"
#include "quants/matmul.c"
