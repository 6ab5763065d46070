# Python handle on the compiled forward pass (forward.c). Included by _kernels.pyx after
# quants.pxi (whose declarations of quants.h it uses).
#
# Weights are passed as raw addresses into the mapped GGUF file and KV memory as numpy arrays;
# this object keeps references to both so they outlive the C model.
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, uintptr_t
from libc.stdlib cimport calloc, free

cnp.import_array()

cdef extern from "forward.h":
    # The scalar fields of rq_config and the tensors of rq_layer_weights are declared once, in
    # forward.h; this module fills them by name through the field tables (_fill_config, _fill_layer).
    ctypedef struct rq_config:
        int n_layer, n_embd, n_vocab
        const float *rope_freq
        const float *rope_freq_local
    ctypedef struct rq_config_field:
        const char *name
        int offset
        int is_float
    const rq_config_field rq_config_fields[]
    const int rq_config_n_fields
    ctypedef struct rq_tensor:
        int type
        const void *data
        int rows, cols
        const void *r16
    ctypedef struct rq_layer_weights:
        pass
    ctypedef struct rq_layer_field:
        const char *name
        int offset
    const rq_layer_field rq_layer_fields[]
    const int rq_layer_n_fields
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


def config_fields() -> tuple:
    """The names of the compiled forward pass's scalar config fields (forward.h's RQ_CONFIG_FIELDS)."""
    return tuple(rq_config_fields[i].name.decode() for i in range(rq_config_n_fields))


def layer_fields() -> tuple:
    """The names of the per-layer tensors the compiled forward pass reads (RQ_LAYER_FIELDS)."""
    return tuple(rq_layer_fields[i].name.decode() for i in range(rq_layer_n_fields))


cdef void _fill_config(rq_config *cfg, dict config) except *:
    """Every scalar field of cfg from config[name]; a name on either side only is an error."""
    cdef char *base = <char *>cfg
    cdef int i
    names = config_fields()
    missing = [n for n in names if n not in config]
    extra = sorted(set(config) - set(names))
    if missing or extra:
        raise ValueError(f"config fields missing: {missing}; unknown to the compiled forward pass: {extra}")
    for i in range(rq_config_n_fields):
        value = config[names[i]]
        if rq_config_fields[i].is_float:
            (<float *>(base + rq_config_fields[i].offset))[0] = value
        else:
            (<int *>(base + rq_config_fields[i].offset))[0] = value


cdef void _fill_layer(rq_layer_weights *layer, dict specs) except *:
    """The tensors of one layer from specs[name]; a name the compiled pass lacks is an error
    (a tensor the pass would silently not use)."""
    cdef char *base = <char *>layer
    cdef int i
    names = layer_fields()
    extra = sorted(set(specs) - set(names))
    if extra:
        raise ValueError(f"layer tensors unknown to the compiled forward pass: {extra}")
    for i in range(rq_layer_n_fields):
        (<rq_tensor *>(base + rq_layer_fields[i].offset))[0] = _tensor(specs.get(names[i]))


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

    def __cinit__(self, dict config, object rope_freq, object rope_freq_local, dict globals_, list layers,
                  list k_cache, list v_cache, int capacity, object owner):
        """config: every scalar field of forward.h's rq_config by name; rope_freq(_local): float32
        arrays of n_rot/2 pair frequencies (engine/rope.py), kept alive with the model."""
        cdef rq_config cfg
        cdef rq_weights w
        cdef rq_kv kv
        cdef int il, n_layer = config["n_layer"]
        cdef cnp.ndarray arr
        cdef cnp.ndarray freq = np.ascontiguousarray(rope_freq, dtype=np.float32)
        cdef cnp.ndarray freq_local = np.ascontiguousarray(rope_freq_local, dtype=np.float32)
        if len(layers) != n_layer or len(k_cache) != n_layer or len(v_cache) != n_layer:
            raise ValueError("layers and KV arrays must have one entry per layer")
        if freq.ndim != 1 or freq_local.shape[0] != freq.shape[0] or 2 * freq.shape[0] != config["n_rot"]:
            raise ValueError("rope_freq and rope_freq_local must hold n_rot / 2 floats each")
        _fill_config(&cfg, config)
        cfg.rope_freq = <const float *>cnp.PyArray_DATA(freq)
        cfg.rope_freq_local = <const float *>cnp.PyArray_DATA(freq_local)

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
            _fill_layer(&self.layers[il], layers[il])
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
            raise MemoryError("could not create the forward pass (its scratch buffers, or a bad n_rot)")
        self.n_vocab = cfg.n_vocab
        self.n_embd = cfg.n_embd
        self.n_layer = n_layer
        self.capacity = capacity
        # The mapped file and the KV arrays must live as long as the C model reads them.
        self.keepalive = (owner, k_cache, v_cache, freq, freq_local)

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

