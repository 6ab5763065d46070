# Test hooks on the forward pass's float kernels (attention.c): each runs one kernel on a kernel path
# (None: the current one), so tests can hold every SIMD kernel to its scalar reference. Included by
# _kernels.pyx after quants.pxi (_PathGuard).
import numpy as np
cimport numpy as cnp
from libc.stdint cimport uint16_t

cnp.import_array()

cdef extern from "attention.h":
    void rq_exp(const float *x, float *y, int n) nogil
    void rq_gated_act(float *g, const float *up, size_t n, int gelu) nogil
    void rq_kv_store(void *kv, int f16, size_t at, const float *x, int n) nogil
    int rq_attention(const float *q, const void *k, const void *v, int f16, float *out, int n, int pos0, int n_head,
                     int n_head_kv, int hd, int slots, int window, float scale, float softcap, int tokens, int heads,
                     int n_threads) nogil


def exp_f32(x, path=None):
    """Test hook: e^x as the forward pass computes it (rq_exp), on `path` (None: the current one)."""
    cdef cnp.ndarray xa = np.ascontiguousarray(x, dtype=np.float32)
    cdef cnp.ndarray ya = np.empty_like(xa)
    g = _PathGuard(path)
    try:
        rq_exp(<const float *>cnp.PyArray_DATA(xa), <float *>cnp.PyArray_DATA(ya), <int>xa.size)
    finally:
        g.restore()
    return ya


def attention_f32(q, k, v, int pos0, int window=0, float scale=1.0, int tokens=0, int heads=0, int threads=1,
                  path=None, float softcap=0.0):
    """Test hook: the forward pass's attention (rq_attention) of q [n, n_head, hd] (f32) at positions
    pos0.. over the KV ring k, v [slots, n_head_kv, hd], both float16 (an f16 cache, read as halves)
    or else taken as float32; softcap > 0: scores capped to softcap * tanh(score / softcap) before
    the softmax (gemma2); returns [n, n_head, hd] (f32)."""
    cdef int f16 = np.asarray(k).dtype == np.float16 and np.asarray(v).dtype == np.float16
    kv_dtype = np.float16 if f16 else np.float32
    cdef cnp.ndarray qa = np.ascontiguousarray(q, dtype=np.float32)
    cdef cnp.ndarray ka = np.ascontiguousarray(k, dtype=kv_dtype)
    cdef cnp.ndarray va = np.ascontiguousarray(v, dtype=kv_dtype)
    if qa.ndim != 3 or ka.ndim != 3 or ka.shape[0] != va.shape[0] or ka.shape[1] != va.shape[1] or \
            ka.shape[2] != qa.shape[2] or va.shape[2] != qa.shape[2]:
        raise ValueError("q [n, n_head, hd], k and v [slots, n_head_kv, hd]")
    cdef cnp.ndarray out = np.zeros_like(qa)
    cdef int rc
    g = _PathGuard(path)
    try:
        rc = rq_attention(<const float *>cnp.PyArray_DATA(qa), <const void *>cnp.PyArray_DATA(ka),
                          <const void *>cnp.PyArray_DATA(va), f16, <float *>cnp.PyArray_DATA(out), qa.shape[0],
                          pos0, qa.shape[1], ka.shape[1], qa.shape[2], ka.shape[0], window, scale, softcap, tokens,
                          heads, threads)
    finally:
        g.restore()
    if rc != 0:
        raise ValueError("bad attention arguments")
    return out


def gated_act_f32(g, up, bint gelu, path=None):
    """Test hook: act(g) * up as the forward pass computes it (rq_gated_act), act SiLU or (gelu)
    GELU-tanh, on `path`."""
    cdef cnp.ndarray ga = np.array(g, dtype=np.float32, order="C").reshape(-1)
    cdef cnp.ndarray ua = np.ascontiguousarray(up, dtype=np.float32).reshape(-1)
    if ga.shape[0] != ua.shape[0]:
        raise ValueError("g and up must have the same length")
    g_ = _PathGuard(path)
    try:
        rq_gated_act(<float *>cnp.PyArray_DATA(ga), <const float *>cnp.PyArray_DATA(ua), <size_t>ga.shape[0], gelu)
    finally:
        g_.restore()
    return ga


def kv_store_f16(x, path=None):
    """Test hook: x as the forward pass stores it into an f16 KV cache (rq_kv_store), on `path`;
    returns the halves as float16."""
    cdef cnp.ndarray xa = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    cdef cnp.ndarray h = np.zeros(xa.shape[0], dtype=np.uint16)
    g = _PathGuard(path)
    try:
        rq_kv_store(cnp.PyArray_DATA(h), 1, 0, <const float *>cnp.PyArray_DATA(xa), <int>xa.shape[0])
    finally:
        g.restore()
    return h.view(np.float16)
