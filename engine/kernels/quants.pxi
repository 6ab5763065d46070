# numpy-friendly wrappers around the quantized kernels (quants.h), mainly for tests and benchmarks.
# Included by _kernels.pyx.
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int8_t, int32_t, uint8_t, uint16_t
from libc.stdlib cimport malloc, free
from cython.parallel cimport parallel

cnp.import_array()

cdef extern from "quants.h":
    ctypedef struct rq_act:
        int n
        int span
        int8_t *qs
        float *d
        int32_t *sum16
        const float *f

    int RQ_PATH_SCALAR, RQ_PATH_AVX2, RQ_PATH_AVX512

    void rq_kernels_init() nogil
    int rq_kernel_path() nogil
    int rq_set_kernel_path(int path) nogil
    int rq_cpu_supports_path(int path) nogil
    int rq_avxvnni() nogil
    int rq_set_avxvnni(int on) nogil
    const char *rq_matmul_route(int path, int t, int ntok, int r16) nogil
    int rq_type_supported(int t) nogil
    int rq_block_elems(int t) nogil
    int rq_block_bytes(int t) nogil
    size_t rq_row_bytes(int t, int n) nogil
    void rq_dequant_row(int t, const void *row, float *out, int n) nogil
    void rq_quantize_act(const float *x, int n, rq_act *act) nogil
    void rq_quantize_act_span(const float *x, int n, int span, rq_act *act) nogil
    int rq_act_span(int t) nogil
    float rq_vec_dot_ref(int t, int n, const void *row, const rq_act *x) nogil
    float rq_vec_dot(int t, int n, const void *row, const rq_act *x) nogil
    void rq_matmul_rows(int t, const void *W, int cols, int r0, int r1,
                        const rq_act *acts, int ntok, float *out, int ldo) nogil
    void rq_matmul(int t, const void *W, int rows, int cols,
                   const rq_act *acts, int ntok, float *out, int ldo, int nthreads) nogil
    void rq_matmul_team(int t, const void *W, int rows, int cols,
                        const rq_act *acts, int ntok, float *out, int ldo) nogil
    ctypedef struct rq_matmul_op:
        int type
        const void *W
        int rows
        float *out
        int ldo
        const void *r16
        const rq_act *acts
        int ntok
        int gated
    int RQ_GATED_SILU, RQ_GATED_GELU
    void rq_matmul_multi(const rq_matmul_op *ops, int nops, int cols, const rq_act *acts, int ntok,
                         int nthreads) nogil
    void rq_matmul_ref(int t, const void *W, int rows, int cols,
                       const rq_act *acts, int ntok, float *out, int ldo) nogil
    int rq_r16_supported(int t) nogil
    int rq_r16_layout_version() nogil
    size_t rq_r16_set_prefetch(int t, size_t nbytes, int to_l2, int *was_to_l2) nogil
    int rq_set_decode_mode(int t, int mode) nogil
    int rq_r16_usable() nogil
    size_t rq_r16_bytes(int t, int rows, int cols) nogil
    int rq_r16_multi_share(size_t lo, size_t hi, size_t base, size_t gb, int ng, int *g0, int *g1) nogil
    void rq_r16_repack(int t, const void *W, int rows, int cols, void *R, int g0, int g1, int nthreads) nogil
    void rq_matmul_r16(int t, const void *W, const void *R, int rows, int cols, const rq_act *acts, int ntok,
                       float *out, int ldo, int nthreads) nogil
    float rq_f16_to_f32(uint16_t h) nogil
    uint16_t rq_f32_to_f16(float f) nogil
    float rq_bf16_to_f32(uint16_t h) nogil

PATH_SCALAR = RQ_PATH_SCALAR
PATH_AVX2 = RQ_PATH_AVX2
PATH_AVX512 = RQ_PATH_AVX512
_PATH_NAMES = {"scalar": RQ_PATH_SCALAR, "avx2": RQ_PATH_AVX2, "avx512": RQ_PATH_AVX512}
_ALL_TYPES = (0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23, 30)


def path_id(path):
    """'scalar' | 'avx2' | 'avx512' | int -> int path id."""
    if isinstance(path, str):
        try:
            return _PATH_NAMES[path]
        except KeyError:
            raise ValueError(f"unknown kernel path {path!r}") from None
    return int(path)


def path_name(int path):
    for k, v in _PATH_NAMES.items():
        if v == path:
            return k
    return str(path)


def kernel_path():
    """Name of the current kernel path."""
    return path_name(rq_kernel_path())


def set_path(path):
    """Force the kernel path, the one path of every kernel in this process (tests); ValueError if
    the name is unknown or this CPU cannot run it."""
    rq_kernels_init()
    cdef int p = path_id(path)
    if rq_set_kernel_path(p) != 0:
        raise ValueError(f"kernel path {path!r} is not available on this CPU")


def cpu_supports(path):
    return bool(rq_cpu_supports_path(path_id(path)))


def avxvnni():
    """Whether the AVX2 path uses its AVX-VNNI kernels (Q4_K and the signed types' prefill)."""
    return bool(rq_avxvnni())


def set_avxvnni(on):
    """Switch the AVX2 path's AVX-VNNI kernels on or off (tests, benchmarks); ValueError if this CPU
    has no AVX-VNNI. Results are the same either way."""
    if rq_set_avxvnni(1 if on else 0) != 0:
        raise ValueError("this CPU has no AVX-VNNI")


def matmul_route(int t, int ntok, bint r16=True, path=None):
    """The kernel route a matmul of ntok tokens of type t takes (on path, default the current one):
    "r16-expanded-vnni", "r16-expanded", "r16", "v16", "pf8", "tiles", "reference" or "none"."""
    rq_kernels_init()
    cdef int p = rq_kernel_path() if path is None else path_id(path)
    return rq_matmul_route(p, t, ntok, 1 if r16 else 0).decode()


def supported_types():
    return [t for t in _ALL_TYPES if rq_type_supported(t)]


def block_elems(int t):
    return rq_block_elems(t)


def block_bytes(int t):
    return rq_block_bytes(t)


def row_bytes(int t, int n):
    return rq_row_bytes(t, n)


def f16_to_f32(uint16_t h):
    return rq_f16_to_f32(h)


def f32_to_f16(float f):
    return rq_f32_to_f16(f)


def bf16_to_f32(uint16_t h):
    return rq_bf16_to_f32(h)


cdef class _PathGuard:
    """Temporarily switch the kernel path (None: leave as is)."""
    cdef int old
    cdef bint active

    def __init__(self, path):
        self.active = path is not None
        if self.active:
            self.old = rq_kernel_path()
            set_path(path)

    def restore(self):
        if self.active:
            rq_set_kernel_path(self.old)
            self.active = False


def _check_type(int t, int n):
    if not rq_type_supported(t):
        raise ValueError(f"unsupported type {t}")
    be = rq_block_elems(t)
    if n <= 0 or n % be:
        raise ValueError(f"n={n} is not a positive multiple of the block size {be}")
    if t not in (0, 1, 30) and n % 32:
        raise ValueError("n must be a multiple of 32")


def _bytes_array(w):
    a = np.ascontiguousarray(np.asarray(w).view(np.uint8).reshape(-1))
    return a


cdef class Act:
    """Quantized activations for ntok vectors of length n (owns its buffers), one scale per span values
    (32, or 256: see act_span)."""
    cdef rq_act *acts
    cdef public int ntok, n, span
    cdef public object x, qs, d, sum16

    def __cinit__(self):
        self.acts = NULL

    def __init__(self, X, path=None, int span=32):
        X = np.ascontiguousarray(X, dtype=np.float32)
        if X.ndim == 1:
            X = X.reshape(1, -1)
        if X.ndim != 2:
            raise ValueError("X must be 1-D or 2-D")
        self.x = X
        self.ntok, self.n = X.shape[0], X.shape[1]
        if self.n % 32:
            raise ValueError("activation length must be a multiple of 32")
        if span not in (32, 256) or self.n % span:
            raise ValueError(f"span must be 32 or 256 and divide the activation length ({self.n}), not {span}")
        self.span = span
        # 64-byte aligned int8 storage
        raw = np.empty(self.ntok * self.n + 64, dtype=np.int8)
        off = (-raw.ctypes.data) % 64
        self.qs = raw[off:off + self.ntok * self.n].reshape(self.ntok, self.n)
        self.d = np.empty((self.ntok, self.n // 32), dtype=np.float32)
        self.sum16 = np.empty((self.ntok, self.n // 16), dtype=np.int32)
        self.acts = <rq_act *>malloc(max(1, self.ntok) * sizeof(rq_act))
        if self.acts == NULL:
            raise MemoryError()
        cdef cnp.int8_t[:, ::1] qs = self.qs
        cdef float[:, ::1] d = self.d
        cdef cnp.int32_t[:, ::1] s16 = self.sum16
        cdef float[:, ::1] xv = self.x
        cdef int k, n = self.n
        g = _PathGuard(path)
        try:
            with nogil:
                for k in range(self.ntok):
                    self.acts[k].qs = <int8_t *>&qs[k, 0]
                    self.acts[k].d = &d[k, 0]
                    self.acts[k].sum16 = <int32_t *>&s16[k, 0]
                    rq_quantize_act_span(&xv[k, 0], n, span, &self.acts[k])
        finally:
            g.restore()

    def __dealloc__(self):
        if self.acts != NULL:
            free(self.acts)


def act_span(int t):
    """The activation span (values under one scale) weight type t's kernels need: 256 or 32."""
    return rq_act_span(t)


def quantize_act(x, path=None, int span=32):
    """float32 vector (n multiple of 32, of span) -> (qs int8[n], d float32[n/32], sum16 int32[n/16])."""
    a = Act(np.asarray(x, dtype=np.float32).reshape(-1), path, span)
    return a.qs[0].copy(), a.d[0].copy(), a.sum16[0].copy()


def dequant_row(int t, w, int n):
    """Dequantize n elements of type t from raw bytes -> float32[n]."""
    _check_type(t, n)
    cdef cnp.uint8_t[::1] wb = _bytes_array(w)
    cdef Py_ssize_t need = <Py_ssize_t>rq_row_bytes(t, n)
    if wb.shape[0] < need:
        raise ValueError(f"need {need} bytes, got {wb.shape[0]}")
    out = np.empty(n, dtype=np.float32)
    cdef float[::1] ov = out
    with nogil:
        rq_dequant_row(t, &wb[0], &ov[0], n)
    return out


def _dot(int t, w, x, path, bint ref):
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    cdef int n = x.shape[0]
    _check_type(t, n)
    if t not in (0, 1, 30) and rq_block_elems(t) == 256 and n % 256:
        raise ValueError("n must be a multiple of 256 for K types")
    cdef cnp.uint8_t[::1] wb = _bytes_array(w)
    if wb.shape[0] < <Py_ssize_t>rq_row_bytes(t, n):
        raise ValueError("row too short")
    cdef Act a = Act(x, path, rq_act_span(t))
    cdef float r
    g = _PathGuard(path)
    try:
        with nogil:
            if ref:
                r = rq_vec_dot_ref(t, n, &wb[0], &a.acts[0])
            else:
                r = rq_vec_dot(t, n, &wb[0], &a.acts[0])
    finally:
        g.restore()
    return r


def vec_dot(int t, w, x, path=None):
    """Dispatched dot of one weight row (raw bytes, type t) with float32 x (quantized inside)."""
    return _dot(t, w, x, path, False)


def vec_dot_ref(int t, w, x):
    """Scalar reference twin of vec_dot."""
    return _dot(t, w, x, None, True)


def _mm_prep(int t, W, int rows, int cols, X, path=None, int span=0):
    """W's bytes and X quantized with span (0: the span t needs)."""
    _check_type(t, cols)
    wb = _bytes_array(W)
    if wb.shape[0] < rows * rq_row_bytes(t, cols):
        raise ValueError(f"W has {wb.shape[0]} bytes, need {rows * rq_row_bytes(t, cols)}")
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim == 1:
        X = X.reshape(1, -1)
    if X.shape[1] != cols:
        raise ValueError("X must be ntok x cols")
    return wb, Act(X, path, span or rq_act_span(t))


def matmul(int t, W, int rows, int cols, X, int nthreads=1, path=None, int span=0):
    """out[k, r] = dot(W row r, X[k]) via rq_matmul, X quantized with span (0: the one t needs); returns
    float32 (ntok x rows)."""
    wb, act = _mm_prep(t, W, rows, cols, X, path, span)
    cdef const cnp.uint8_t[::1] wv = wb
    cdef Act a = act
    out = np.empty((a.ntok, rows), dtype=np.float32)
    cdef float[:, ::1] ov = out
    cdef int ntok = a.ntok
    g = _PathGuard(path)
    try:
        with nogil:
            rq_matmul(t, &wv[0], rows, cols, a.acts, ntok, &ov[0, 0], rows, nthreads)
    finally:
        g.restore()
    return out


def matmul_multi(list specs, int cols, X, int nthreads=2, path=None, gated=None):
    """rq_matmul_multi over specs [(t, W, rows[, R16 copy[, own X]]), ...]: an op with its own X (ntok_i x cols)
    multiplies that (as an expert its routed tokens), the others share X; returns one (ntok x rows) array each.
    gated: {op index: "silu" | "gelu"}, each such op a gate whose up is the next op (its result: act(gate) * up)."""
    if not 0 < len(specs) <= 32:
        raise ValueError("1 to 32 ops")
    gated = gated or {}
    kinds = {"silu": RQ_GATED_SILU, "gelu": RQ_GATED_GELU}
    for i, kind in gated.items():
        if kind not in kinds or not 0 <= i < len(specs) - 1:
            raise ValueError(f"gated: op {i} {kind!r}")
    cdef rq_matmul_op ops[32]
    cdef cnp.uint8_t[::1] wv
    cdef float[:, ::1] ov
    cdef Act own
    keep, outs = [], []
    act = None
    own_acts = {}  # ops given the same X array read one quantized copy of it, as a decode step's experts do
    spans = {}  # per X array: the largest span its ops need
    for spec in specs:
        key = id(spec[4]) if len(spec) > 4 and spec[4] is not None else None
        spans[key] = max(spans.get(key, 32), rq_act_span(spec[0]))
    cdef const cnp.uint8_t[::1] rv
    for i, spec in enumerate(specs):
        t, W, rows = spec[:3]
        has_own = len(spec) > 4 and spec[4] is not None
        wb, act_i = _mm_prep(t, W, rows, cols, spec[4] if has_own else X, path, spans[id(spec[4]) if has_own else None])
        if has_own:
            act_i = own_acts.setdefault(id(spec[4]), act_i)
        if not has_own:
            act = act if act is not None else act_i
        out = np.full((act_i.ntok, rows), np.nan, dtype=np.float32)
        wv = wb
        ov = out
        ops[i].type = t
        ops[i].W = &wv[0]
        ops[i].rows = rows
        ops[i].out = &ov[0, 0]
        ops[i].ldo = rows
        ops[i].r16 = NULL
        ops[i].acts = NULL
        ops[i].ntok = 0
        ops[i].gated = kinds[gated[i]] if i in gated else 0
        if has_own:
            own = act_i
            ops[i].acts = own.acts
            ops[i].ntok = own.ntok
            keep.append(act_i)
        if len(spec) > 3 and spec[3] is not None:
            rb = _bytes_array(spec[3])
            rv = rb
            ops[i].r16 = &rv[0]
            keep.append(rb)
        keep.append(wb)
        outs.append(out)
    if act is None:  # every op has its own tokens: the call's acts are not read
        act = next(k for k in keep if isinstance(k, Act))
    cdef Act a = act
    cdef int nops = len(specs), ntok = a.ntok
    g = _PathGuard(path)
    try:
        with nogil:
            rq_matmul_multi(ops, nops, cols, a.acts, ntok, nthreads)
    finally:
        g.restore()
    return outs


def matmul_team(int t, W, int rows, int cols, X, int nthreads=2, path=None):
    """rq_matmul_team called by every thread of an OpenMP parallel region of nthreads."""
    wb, act = _mm_prep(t, W, rows, cols, X, path)
    cdef const cnp.uint8_t[::1] wv = wb
    cdef Act a = act
    out = np.full((a.ntok, rows), np.nan, dtype=np.float32)
    cdef float[:, ::1] ov = out
    cdef int ntok = a.ntok
    g = _PathGuard(path)
    try:
        with nogil, parallel(num_threads=nthreads):
            rq_matmul_team(t, &wv[0], rows, cols, a.acts, ntok, &ov[0, 0], rows)
    finally:
        g.restore()
    return out


def matmul_rows(int t, W, int rows, int cols, X, int r0, int r1, path=None):
    """rq_matmul_rows over [r0, r1); other entries of the (ntok x rows) result are NaN."""
    wb, act = _mm_prep(t, W, rows, cols, X, path)
    if not (0 <= r0 <= r1 <= rows):
        raise ValueError("bad row range")
    cdef const cnp.uint8_t[::1] wv = wb
    cdef Act a = act
    out = np.full((a.ntok, rows), np.nan, dtype=np.float32)
    cdef float[:, ::1] ov = out
    cdef int ntok = a.ntok
    g = _PathGuard(path)
    try:
        with nogil:
            rq_matmul_rows(t, &wv[0], cols, r0, r1, a.acts, ntok, &ov[0, 0], rows)
    finally:
        g.restore()
    return out


def matmul_ref(int t, W, int rows, int cols, X):
    """Reference: dequantized rows x float X (f64 accumulation)."""
    wb, act = _mm_prep(t, W, rows, cols, X)
    cdef const cnp.uint8_t[::1] wv = wb
    cdef Act a = act
    out = np.empty((a.ntok, rows), dtype=np.float32)
    cdef float[:, ::1] ov = out
    cdef int ntok = a.ntok
    with nogil:
        rq_matmul_ref(t, &wv[0], rows, cols, a.acts, ntok, &ov[0, 0], rows)
    return out


def bench_quantize(X, int reps=10, path=None, int span=32):
    """Seconds per rq_quantize_act_span pass over all rows of X (ntok x n)."""
    import time
    cdef Act a = Act(X, path, span)
    cdef float[:, ::1] xv = a.x
    cdef int k, i, n = a.n, ntok = a.ntok
    g = _PathGuard(path)
    try:
        t0 = time.perf_counter()
        with nogil:
            for i in range(reps):
                for k in range(ntok):
                    rq_quantize_act_span(&xv[k, 0], n, span, &a.acts[k])
        t1 = time.perf_counter()
    finally:
        g.restore()
    return (t1 - t0) / reps


def bench_matmul(int t, W, int rows, int cols, X, int nthreads=1, int reps=10, path=None):
    """Time rq_matmul (activations quantized once, outside the timing); returns seconds per call."""
    import time
    wb, act = _mm_prep(t, W, rows, cols, X, path)
    cdef const cnp.uint8_t[::1] wv = wb
    cdef Act a = act
    out = np.empty((a.ntok, rows), dtype=np.float32)
    cdef float[:, ::1] ov = out
    cdef int ntok = a.ntok, i
    g = _PathGuard(path)
    try:
        with nogil:
            rq_matmul(t, &wv[0], rows, cols, a.acts, ntok, &ov[0, 0], rows, nthreads)
        t0 = time.perf_counter()
        with nogil:
            for i in range(reps):
                rq_matmul(t, &wv[0], rows, cols, a.acts, ntok, &ov[0, 0], rows, nthreads)
        t1 = time.perf_counter()
    finally:
        g.restore()
    return (t1 - t0) / reps


# --------------------------------------------------------------------------------------------
# Repacked (R16) weights: see quants.h


def r16_supported(int t):
    """True if type t has an R16 layout."""
    return bool(rq_r16_supported(t))


def r16_set_prefetch(size_t nbytes, bint to_l2=False, int t=-1):
    """The distance in bytes at which one-token passes prefetch a repacked group of type t (-1: every
    type) ahead, into L2 (to_l2) or L1; returns the previous (distance, to_l2) (every type: Q4_K's).
    Results do not depend on it."""
    cdef int was = 0
    cdef size_t before = rq_r16_set_prefetch(t, nbytes, to_l2, &was)
    return before, bool(was)


DECODE_MODES = ("r16", "r16-256", "gguf")   # quants.h's RQ_DECODE_R16, RQ_DECODE_R16_256, RQ_DECODE_GGUF


def set_decode_mode(mode, int t=-1):
    """How decode-sized calls (<= 8 tokens) of type t (-1: every type) with R16 copies compute: "r16"
    (the kernel path's R16 kernels), "r16-256" (the AVX2 R16 kernels on the avx512 path) or "gguf"
    (the GGUF layout); returns the previous mode (every type: Q4_K's). Results do not depend on it."""
    if mode not in DECODE_MODES:
        raise ValueError(f"decode mode must be one of {', '.join(DECODE_MODES)}, not {mode!r}")
    before = rq_set_decode_mode(t, DECODE_MODES.index(mode))
    if before < 0:
        raise ValueError(f"unknown type {t}")
    return DECODE_MODES[before]


def r16_layout_version():
    """The R16 layout's version (a cache written with another one must be rebuilt)."""
    return rq_r16_layout_version()


def r16_kernels_available():
    """True if the current kernel path computes with R16 copies (the avx512 path)."""
    return bool(rq_r16_usable())


def r16_bytes(int t, int rows, int cols):
    """Bytes of the R16 copy of a rows x cols matrix of type t (0: no R16 layout for it)."""
    return rq_r16_bytes(t, rows, cols)


def r16_multi_share(size_t lo, size_t hi, size_t base, size_t gb, int ng):
    """rq_r16_multi_share: (g0, g1) of an op's groups in the byte range [lo, hi), or None."""
    cdef int g0, g1
    if not rq_r16_multi_share(lo, hi, base, gb, ng, &g0, &g1):
        return None
    return g0, g1


def r16_repack(int t, W, int rows, int cols, out, int g0, int g1, int nthreads=1):
    """Repack 16-row groups [g0, g1) of W (the tensor's bytes) into out (r16_bytes long, writable)."""
    _check_type(t, cols)
    cdef size_t need = rq_r16_bytes(t, rows, cols)
    if need == 0:
        raise ValueError(f"type {t} with {cols} columns has no R16 layout")
    wb = _bytes_array(W)
    if wb.shape[0] < rows * rq_row_bytes(t, cols):
        raise ValueError(f"W has {wb.shape[0]} bytes, need {rows * rq_row_bytes(t, cols)}")
    cdef const cnp.uint8_t[::1] wv = wb
    cdef cnp.uint8_t[::1] ov = out
    if ov.shape[0] < need:
        raise ValueError(f"out has {ov.shape[0]} bytes, need {need}")
    with nogil:
        rq_r16_repack(t, &wv[0], rows, cols, &ov[0], g0, g1, nthreads)


def matmul_r16(int t, W, R, int rows, int cols, X, int nthreads=1, path=None, int reps=0, bint warm_up=True):
    """rq_matmul_r16: out[k, r] with the R16 copy R of W (when the path uses it). reps > 0: return
    seconds per call instead (timing, like bench_matmul), after an untimed call unless warm_up is
    False (then the weights are read from wherever they are: memory, for a matrix last read a pass
    ago, where the untimed call would have left one that fits the last-level cache there)."""
    import time
    wb, act = _mm_prep(t, W, rows, cols, X, path)
    cdef const cnp.uint8_t[::1] wv = wb
    cdef const cnp.uint8_t[::1] rv = _bytes_array(R)
    cdef Act a = act
    out = np.empty((a.ntok, rows), dtype=np.float32)
    cdef float[:, ::1] ov = out
    cdef int ntok = a.ntok, i, n = reps if reps > 0 else 1
    g = _PathGuard(path)
    try:
        if warm_up or reps <= 0:
            with nogil:
                rq_matmul_r16(t, &wv[0], &rv[0], rows, cols, a.acts, ntok, &ov[0, 0], rows, nthreads)
        t0 = time.perf_counter()
        if reps > 0:
            with nogil:
                for i in range(n):
                    rq_matmul_r16(t, &wv[0], &rv[0], rows, cols, a.acts, ntok, &ov[0, 0], rows, nthreads)
        t1 = time.perf_counter()
    finally:
        g.restore()
    return (t1 - t0) / reps if reps > 0 else out
