/* Part of quants.c's single translation unit (#included there, in a fixed order; not compiled
 * alone). The R16 repacked layout: what a group of 16 rows looks like and how
 * the types' files address it (each type's unit, repacking and block loaders are in its file; the
 * drivers are in r16.c). */

/* ============================== R16: repacked weights, 16 interleaved rows ================= */
/*
 * The v16 group layout computed ahead of time and kept compact: the same bits as the GGUF rows,
 * rearranged so that one 64-byte load holds the same 4-element group of 16 rows. Kernels read it
 * directly (few tokens: decode, short passes) or expand a group once into the v16 layout (many
 * tokens); the integers and the float sequence are v16_pass's, so results equal the GGUF
 * layout's bit for bit on every path.
 * A group of 16 rows is a run of units, each one contiguous so that decode reads one stream:
 * a unit is one block (legacy types, IQ4_NL) or one super-block of 8 blocks (K types, IQ4_XS).
 * Entries marked [16] hold one value per row; j is the block within the unit:
 * (each type's unit is described in its file, beside its r16_layout_*):
 * NIB byte i = lo4(elem 4g+i) | lo4(elem 16+4g+i) << 4; HB (Q5) bit
 * 8i + 4h + g = the 5th bit of elem 16h+4g+i. (Q6_K keeps its 6-bit values in its own way: q6_K.c.)
 */
#define R16_V 4   /* layout version; bump when the layout (above or a type's r16_layout_*) changes */

static inline int r16_type(int t) { return traits(t)->packed; }

/* Where things are in a group: unit size, blocks per unit, offsets within a unit (0: absent). */
typedef struct {
    const uint8_t *g;
    size_t ub;
    int bpu;
    size_t nib, q8, hb, d, m, kd, kdm, ksc, kmn, qd, qsc;
    size_t pf_ahead;   /* decode's prefetch for this type: how far ahead, and into L2 (else L1) */
    int pf_to_l2;
} r16_ptrs;

/* Unit of block b, and b's index within it. */
static inline const uint8_t *r16_unit(const r16_ptrs *p, size_t b) { return p->g + (b / (size_t)p->bpu) * p->ub; }
static inline size_t r16_j(const r16_ptrs *p, size_t b) { return b % (size_t)p->bpu; }

/* --- repacking (scalar: runs once per model file, bound by reading the file) --- */

static void r16_w32(const uint8_t *at, int r, uint32_t v) { memcpy((uint8_t *)at + 4 * r, &v, 4); }
static void r16_w16(const uint8_t *at, int r, uint16_t v) { memcpy((uint8_t *)at + 2 * r, &v, 2); }

#ifdef RQ_HAVE_X86
/* The nibble entries of block j of a unit (NIB [j][4 g][16]) as the v16 U vectors: W[g] the low
 * nibbles (elements 4g..4g+3 of half 0), W[4 + g] the high ones (half 1), offset not removed. */
A512 AINL void r16_nib_512(const r16_ptrs *p, const uint8_t *u, size_t j, __m512i *W) {
    const __m512i m0f = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < 4; g++) {
        const __m512i v = _mm512_loadu_si512(u + p->nib + 64 * (4 * j + g));
        W[g] = _mm512_and_si512(v, m0f);
        W[4 + g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m0f);
    }
}

/* The same for rows 8q..8q+7 (o = 32 q: the low or high 32 bytes of each 64-byte entry), AVX2. */
A256 AINL void r16_nib_256(const r16_ptrs *p, const uint8_t *u, size_t j, size_t o, __m256i *W) {
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    for (int g = 0; g < 4; g++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(u + p->nib + 64 * (4 * j + g) + o));
        W[g] = _mm256_and_si256(v, m0f);
        W[4 + g] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f);
    }
}
#endif /* x86 */
