# Python handle on the compiled forward pass (forward.c). Included by _kernels.pyx after
# quants.pxi (whose declarations of quants.h it uses); re-exported by engine.kernels._forward.
#
# Weights are passed as raw addresses into the mapped GGUF file and KV memory as numpy arrays;
# this object keeps references to both so they outlive the C model.
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, uintptr_t
from libc.stdlib cimport calloc, free

cnp.import_array()

cdef extern from "forward.h":
    ctypedef struct rq_config:
        int arch
        int n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, n_vocab
        float norm_eps, rope_base, rope_base_local
        int rope_neox, sliding_window, swa_pattern
        float embd_scale, attn_scale
        int ffn_gelu, max_ubatch, n_threads
    ctypedef struct rq_tensor:
        int type
        const void *data
        int rows, cols
        const void *r16
    ctypedef struct rq_layer_weights:
        rq_tensor attn_norm, wq, wk, wv, wo, bq, bk, bv, attn_q_norm, attn_k_norm, post_attn_norm
        rq_tensor ffn_norm, ffn_gate, ffn_up, ffn_down, post_ffw_norm
    ctypedef struct rq_weights:
        rq_tensor token_embd, output_norm, output
        rq_layer_weights *layers
    ctypedef struct rq_kv:
        int capacity
        const int *slots
        void **k
        void **v
        int f16
    ctypedef struct rq_model:
        pass
    rq_model *rq_model_create(const rq_config *cfg, const rq_weights *w, const rq_kv *kv)
    void rq_model_free(rq_model *m)
    int rq_forward(rq_model *m, const int32_t *tokens, int n, int pos0, float *logits, int all_logits) nogil
    int rq_model_set_threads(rq_model *m, int n)
    void rq_model_record_layers(rq_model *m, float *buf, int max_tokens)
    void rq_exp(const float *x, float *y, int n) nogil
    int rq_attention(const float *q, const void *k, const void *v, int f16, float *out, int n, int pos0, int n_head,
                     int n_head_kv, int hd, int slots, int window, float scale, int tokens, int heads,
                     int n_threads) nogil


cdef rq_tensor _tensor(object spec):
    """spec: None or (type, address, rows, cols[, address of the R16 copy or 0])."""
    cdef rq_tensor t
    t.type = 0
    t.data = NULL
    t.rows = 0
    t.cols = 0
    t.r16 = NULL
    if spec is not None:
        t.type = spec[0]
        t.data = <const void *><uintptr_t>spec[1]
        t.rows = spec[2]
        t.cols = spec[3]
        if len(spec) > 4 and spec[4]:
            t.r16 = <const void *><uintptr_t>spec[4]
    return t


cdef class ForwardModel:
    cdef rq_model *model
    cdef rq_layer_weights *layers
    cdef int *slots
    cdef void **kptrs
    cdef void **vptrs
    cdef readonly int n_vocab, n_embd, n_layer, capacity
    cdef object keepalive
    cdef object record_buf

    def __cinit__(self, dict config, dict globals_, list layers, list k_cache, list v_cache, int capacity,
                  object owner):
        cdef rq_config cfg
        cdef rq_weights w
        cdef rq_kv kv
        cdef int il, n_layer = config["n_layer"]
        cdef cnp.ndarray arr
        if len(layers) != n_layer or len(k_cache) != n_layer or len(v_cache) != n_layer:
            raise ValueError("layers and KV arrays must have one entry per layer")
        cfg.arch = config["arch"]; cfg.n_layer = n_layer; cfg.n_embd = config["n_embd"]
        cfg.n_ff = config["n_ff"]; cfg.n_head = config["n_head"]; cfg.n_head_kv = config["n_head_kv"]
        cfg.head_dim = config["head_dim"]; cfg.n_vocab = config["n_vocab"]
        cfg.norm_eps = config["norm_eps"]; cfg.rope_base = config["rope_base"]
        cfg.rope_base_local = config["rope_base_local"]; cfg.rope_neox = config["rope_neox"]
        cfg.sliding_window = config["sliding_window"]; cfg.swa_pattern = config["swa_pattern"]
        cfg.embd_scale = config["embd_scale"]; cfg.attn_scale = config["attn_scale"]
        cfg.ffn_gelu = config["ffn_gelu"]
        cfg.max_ubatch = config["max_ubatch"]
        cfg.n_threads = config["n_threads"]

        self.layers = <rq_layer_weights *>calloc(n_layer, sizeof(rq_layer_weights))
        self.slots = <int *>calloc(n_layer, sizeof(int))
        self.kptrs = <void **>calloc(n_layer, sizeof(void *))
        self.vptrs = <void **>calloc(n_layer, sizeof(void *))
        if not self.layers or not self.slots or not self.kptrs or not self.vptrs:
            raise MemoryError()
        w.token_embd = _tensor(globals_["token_embd"])
        w.output_norm = _tensor(globals_["output_norm"])
        w.output = _tensor(globals_["output"])
        kv_dtype = np.asarray(k_cache[0]).dtype if n_layer else np.dtype(np.float32)
        if kv_dtype not in (np.float16, np.float32):
            raise ValueError(f"KV arrays must be float16 or float32, not {kv_dtype}")
        for il in range(n_layer):
            spec = layers[il]
            self.layers[il].attn_norm = _tensor(spec.get("attn_norm"))
            self.layers[il].wq = _tensor(spec.get("wq"))
            self.layers[il].wk = _tensor(spec.get("wk"))
            self.layers[il].wv = _tensor(spec.get("wv"))
            self.layers[il].wo = _tensor(spec.get("wo"))
            self.layers[il].bq = _tensor(spec.get("bq"))
            self.layers[il].bk = _tensor(spec.get("bk"))
            self.layers[il].bv = _tensor(spec.get("bv"))
            self.layers[il].attn_q_norm = _tensor(spec.get("attn_q_norm"))
            self.layers[il].attn_k_norm = _tensor(spec.get("attn_k_norm"))
            self.layers[il].post_attn_norm = _tensor(spec.get("post_attn_norm"))
            self.layers[il].ffn_norm = _tensor(spec.get("ffn_norm"))
            self.layers[il].ffn_gate = _tensor(spec.get("ffn_gate"))
            self.layers[il].ffn_up = _tensor(spec.get("ffn_up"))
            self.layers[il].ffn_down = _tensor(spec.get("ffn_down"))
            self.layers[il].post_ffw_norm = _tensor(spec.get("post_ffw_norm"))
            for cache, ptrs in ((k_cache[il], 0), (v_cache[il], 1)):
                arr = cache
                if arr.dtype != kv_dtype or not arr.flags["C_CONTIGUOUS"] or arr.ndim != 2:
                    raise ValueError("KV arrays must be C-contiguous [slots, kv_dim], all float16 or all float32")
                if ptrs == 0:
                    self.kptrs[il] = cnp.PyArray_DATA(arr)
                    self.slots[il] = arr.shape[0]
                else:
                    self.vptrs[il] = cnp.PyArray_DATA(arr)
        w.layers = self.layers
        kv.f16 = kv_dtype == np.float16
        kv.capacity = capacity
        kv.slots = self.slots
        kv.k = self.kptrs
        kv.v = self.vptrs
        self.model = rq_model_create(&cfg, &w, &kv)
        if self.model == NULL:
            raise MemoryError("could not allocate the forward pass's scratch buffers")
        self.n_vocab = cfg.n_vocab
        self.n_embd = cfg.n_embd
        self.n_layer = n_layer
        self.capacity = capacity
        # The mapped file and the KV arrays must live as long as the C model reads them.
        self.keepalive = (owner, k_cache, v_cache)

    def __dealloc__(self):
        if self.model != NULL:
            rq_model_free(self.model)
        free(self.layers)
        free(self.slots)
        free(self.kptrs)
        free(self.vptrs)

    def forward(self, tokens, int pos0, cnp.ndarray logits not None, bint all_logits=False):
        """Run tokens at positions pos0..; writes logits into the given float32 array."""
        cdef cnp.ndarray toks = np.ascontiguousarray(tokens, dtype=np.int32)
        cdef int n = toks.shape[0]
        cdef int rc
        if logits.dtype != np.float32 or not logits.flags["C_CONTIGUOUS"]:
            raise ValueError("logits must be a C-contiguous float32 array")
        if logits.size < (n if all_logits else 1) * self.n_vocab:
            raise ValueError("logits array too small")
        cdef const int32_t *tp = <const int32_t *>cnp.PyArray_DATA(toks)
        cdef float *lp = <float *>cnp.PyArray_DATA(logits)
        with nogil:
            rc = rq_forward(self.model, tp, n, pos0, lp, all_logits)
        if rc != 0:
            raise ValueError(f"positions {pos0}..{pos0 + n - 1} exceed the KV capacity of {self.capacity} tokens")

    def set_threads(self, int n):
        """Threads for the next passes (1 .. the configured count); returns the count in use."""
        return rq_model_set_threads(self.model, n)

    def record_layers(self, object buf, int max_tokens):
        """Test hook: record the residual stream after each layer into buf[(n_layer+1), max_tokens, n_embd]."""
        cdef cnp.ndarray arr
        if buf is None:
            rq_model_record_layers(self.model, NULL, 0)
            self.record_buf = None
            return
        arr = buf
        if arr.dtype != np.float32 or not arr.flags["C_CONTIGUOUS"] or arr.size < (self.n_layer + 1) * max_tokens * self.n_embd:
            raise ValueError("record buffer must be float32 [(n_layer+1), max_tokens, n_embd]")
        self.record_buf = arr
        rq_model_record_layers(self.model, <float *>cnp.PyArray_DATA(arr), max_tokens)


KERNEL_PATHS = {"scalar": 0, "avx2": 1, "avx512": 2}


def set_kernel_path(str name):
    """Force the kernel path (tests): the one path of every kernel in this process (set_path's
    twin that raises ValueError); raises if the CPU cannot run it. kernel_path() (quants.pxi)
    reads it back."""
    rq_kernels_init()
    if name not in KERNEL_PATHS or rq_set_kernel_path(KERNEL_PATHS[name]) != 0:
        raise ValueError(f"kernel path {name!r} is not available on this CPU")


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
                  path=None):
    """Test hook: the forward pass's attention (rq_attention) of q [n, n_head, hd] (f32) at positions
    pos0.. over the KV ring k, v [slots, n_head_kv, hd], both float16 (an f16 cache, read as halves)
    or else taken as float32; returns [n, n_head, hd] (f32)."""
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
                          pos0, qa.shape[1], ka.shape[1], qa.shape[2], ka.shape[0], window, scale, tokens, heads,
                          threads)
    finally:
        g.restore()
    if rc != 0:
        raise ValueError("bad attention arguments")
    return out
