/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). IQ4_NL: blocks of 32 4-bit indices into a table of 16 non-linear signed values
 * (kvalues_iq4nl, shared with IQ4_XS) with one f16 scale. The block is Q4_0's byte for byte: f16 d,
 * then 16 bytes whose low nibbles are elements 0-15 and high nibbles elements 16-31. Block struct,
 * the value table, dequantization, scalar reference dot product, the SIMD table lookups (IQ4_XS
 * uses them too) and the v16 prefill unpacking.
 *
 * Its SIMD kernels are legacy.c's (included after this file, branching on the type where the
 * values are looked up): one vpshufb turns 32 nibbles into 32 signed 8-bit values (the table is one
 * 16-byte shuffle), and from there a block is handled as Q8_0's is (type_s8: the sign trick on
 * AVX2, value + 128 with offset 128 for vpdpbusd), so its float sequence is the legacy types'
 * (legacy_slots_256). Its R16 unit is Q4_0's (the same bits: NIB [4 g][16] | D [16] f16), repacked by
 * r16_repack_row_legacy; the lookup happens when a block is loaded.
 *
 * No AVX2 8-token prefill kernels (pf8, as for Q8_0): their exact int16 half sums need unsigned
 * values of at most 5 bits, and signed 8-bit ones would need a vpmaddwd per vpmaddubsw (the sign
 * trick's pairs reach 2 x 127 x 127), which loses what the pf8 kernels gain over the slot kernels.
 * Prefill on AVX2 runs on the R16 copy by default (r16_groups_256); on the GGUF layout (repacking
 * off) it takes the slot kernels, 4 tokens at a time. */

typedef struct { uint16_t d; uint8_t qs[16]; } blk_iq4_nl;
_Static_assert(sizeof(blk_iq4_nl) == 18, "iq4_nl");

/* ggml's kvalues_iq4nl (ggml-common.h) */
static const int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* ------------------------------------------------------------------------------------------ */
/* Dequantization (ground truth)                                                               */

static void dequant_iq4_nl(const void *row, float *y, int n) {
    const blk_iq4_nl *b = row;
    for (int i = 0; i < n / QK; i++, y += QK) {
        float d = F16(b[i].d);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)kvalues_iq4nl[b[i].qs[j] & 0xF];
            y[j + 16] = d * (float)kvalues_iq4nl[b[i].qs[j] >> 4];
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Scalar reference dot product                                                                */

/* The signed values of 16 nibble bytes (low nibbles, then high), into v[32]. */
static inline void iq4_values(const uint8_t *qs, int8_t *v) {
    for (int j = 0; j < 16; j++) {
        v[j] = kvalues_iq4nl[qs[j] & 0xF];
        v[j + 16] = kvalues_iq4nl[qs[j] >> 4];
    }
}

static inline int dot32_s(const int8_t *w, const int8_t *q) {
    int s = 0;
    for (int j = 0; j < 32; j++) s += (int)w[j] * (int)q[j];
    return s;
}

static float dot_iq4_nl_ref(int n, const void *row, const rq_act *x) {
    const blk_iq4_nl *b = row;
    float s = 0.0f;
    int8_t v[32];
    for (int i = 0; i < n / QK; i++) {
        iq4_values(b[i].qs, v);
        s += F16(b[i].d) * x->d[i] * (float)dot32_s(v, x->qs + 32 * i);
    }
    return s;
}

#ifdef RQ_HAVE_X86

/* ------------------------------------------------------------------------------------------ */
/* Table lookups                                                                               */

/* The table in both 128-bit lanes: the signed values (biased 0: for the AVX2 sign trick) or the
 * values + 128 (biased 1: the unsigned operand of vpdpbusd, offset 128). */
A256 AINL __m256i iq4_table_256(const int biased) {
    const __m128i k = _mm_loadu_si128((const __m128i *)kvalues_iq4nl);
    return _mm256_broadcastsi128_si256(biased ? _mm_xor_si128(k, _mm_set1_epi8((char)0x80)) : k);
}

/* The 32 values of 16 nibble bytes qs (one block of 32), in element order. */
A256 AINL __m256i iq4_block_256(const uint8_t *qs, const int biased) {
    const __m128i x = _mm_loadu_si128((const __m128i *)qs);
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(0x0F));
    return _mm256_shuffle_epi8(iq4_table_256(biased), nib);
}

/* Eight vectors of nibbles (0..15 a byte, as r16_nib_256 gives them) -> their values, in place. */
A256 AINL void iq4_lookup8_256(__m256i *W, const int biased) {
    const __m256i tab = iq4_table_256(biased);
    for (int k = 0; k < 8; k++) W[k] = _mm256_shuffle_epi8(tab, W[k]);
}

/* The same on 512 bits (r16_nib_512), always as values + 128 (vpdpbusd). */
A512 AINL void iq4_lookup8_512(__m512i *W) {
    const __m128i k = _mm_loadu_si128((const __m128i *)kvalues_iq4nl);
    const __m512i tab = _mm512_broadcast_i32x4(_mm_xor_si128(k, _mm_set1_epi8((char)0x80)));
    for (int j = 0; j < 8; j++) W[j] = _mm512_shuffle_epi8(tab, W[j]);
}

/* --- Prefill (see v16.c) ---------------------------------------------------------------------- */

/* IQ4_NL rows in the prefill kernels' unpacked form (pf8.c): values + 128, the scale twice. */
A256 AINL void v16_unpack_iq4nl(const uint8_t *row, int nb, uint8_t *ur) {
    for (int b = 0; b < nb; b++) {
        const uint8_t *A = row + (size_t)b * sizeof(blk_iq4_nl);
        _mm256_storeu_si256((__m256i *)(ur + 32 * (size_t)b), iq4_block_256(A + 2, 1));
        const float d = _cvtsh_ss(load_u16(A));
        pf8_store_scales(ur, nb, b, d, d, 0.0f);
    }
}

#endif /* x86 */
