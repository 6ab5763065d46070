"""A model: its config (from GGUF metadata), its weights (tensors mapped in place) and the
compiled forward pass over them, with a KV cache sized from a byte budget.

    model = Model.load("model.gguf", threads=2, kv_budget="256MiB")
    logits = model.forward(token_ids, pos0)     # logits of the last token, float32 [n_vocab]
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine.cpus import choose_threads
from engine.gguf_constants import GGMLQuantizationType
from engine.gguf_file import GGUFError, GGUFFile
from engine import repack as repack_cache
from engine.kv_cache import KVCache, parse_bytes
from engine.repack import RepackedWeights
from engine.thread_governor import ThreadGovernor
from engine.defaults import DEFAULT_KV_BUDGET
from engine.registry import ModelError  # noqa: F401 - raised here, imported from here by callers

ARCH_IDS = {"llama": 0, "gemma3": 1, "qwen2": 2}
SUPPORTED_ARCHS = tuple(ARCH_IDS)
# Types the compiled kernels read (engine/kernels/quants.h).
SUPPORTED_TYPES = tuple(
    GGMLQuantizationType[n]
    for n in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
)
MAX_UBATCH = 128  # tokens per compiled pass: larger prompts are run in passes of this size


def default_threads() -> int:
    """RQLLM_THREADS, else the CPUs this process may use (affinity mask and cgroup quota: engine.cpus)."""
    return choose_threads().threads


@dataclass(frozen=True)
class Config:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    norm_eps: float
    rope_base: float
    rope_base_local: float
    rope_neox: bool
    sliding_window: int
    swa_pattern: int
    embd_scale: float
    attn_scale: float
    ffn_gelu: bool

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    def layer_is_local(self, il: int) -> bool:
        return self.sliding_window > 0 and self.swa_pattern > 0 and il % self.swa_pattern < self.swa_pattern - 1

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Config:
        arch = gguf.arch
        if arch not in ARCH_IDS:
            raise ModelError(f"{gguf.path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")

        def key(name: str, default=None, kind: type = int):
            value = gguf.get(f"{arch}.{name}", default)
            if value is None:
                raise ModelError(f"{gguf.path}: metadata key {arch}.{name} is missing")
            # A corrupt file can store any type under any key: only plain numbers are taken.
            if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
                raise ModelError(f"{gguf.path}: metadata key {arch}.{name} should be a{'n integer' if kind is int else ' number'}, "
                                 f"is {type(value).__name__} {str(value)[:40]}")
            return value

        n_embd = int(key("embedding_length"))
        n_head = int(key("attention.head_count"))
        n_head_kv = int(key("attention.head_count_kv", n_head))
        head_dim = int(key("attention.key_length", n_embd // max(n_head, 1)))
        for name, value in (("embedding_length", n_embd), ("attention.head_count", n_head),
                            ("attention.key_length", head_dim)):
            if not 0 < value < 1 << 24:  # checked before the square roots below
                raise ModelError(f"{gguf.path}: metadata key {arch}.{name} = {value} is out of range")
        embd = gguf.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelError(f"{gguf.path}: tensor token_embd.weight is missing")
        n_vocab = int(key("vocab_size", embd.shape[1] if len(embd.shape) > 1 else 0))
        gemma = arch == "gemma3"
        cfg = cls(
            arch=arch,
            n_layer=int(key("block_count")),
            n_embd=n_embd,
            n_ff=int(key("feed_forward_length")),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=int(key("context_length", 4096)),
            norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5, float)),
            rope_base=float(key("rope.freq_base", 10000.0, float)),
            rope_base_local=10000.0 if gemma else float(key("rope.freq_base", 10000.0, float)),
            rope_neox=arch in ("gemma3", "qwen2"),
            sliding_window=int(key("attention.sliding_window", 0)) if gemma else 0,
            swa_pattern=6 if gemma else 0,
            embd_scale=math.sqrt(n_embd) if gemma else 1.0,
            attn_scale=1.0 / math.sqrt(head_dim),
            ffn_gelu=gemma,
        )
        cfg._validate(gguf)
        return cfg

    def _validate(self, gguf: GGUFFile) -> None:
        for name in ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "n_vocab"):
            value = getattr(self, name)
            if not 0 < value < 1 << 24:
                raise ModelError(f"{gguf.path}: {name} = {value} is out of range")
        if self.n_head % self.n_head_kv:
            raise ModelError(f"{gguf.path}: head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        if self.head_dim % 2:
            raise ModelError(f"{gguf.path}: head dimension {self.head_dim} must be even for RoPE")


LAYER_TENSORS = {  # our field -> (GGUF suffix, required, shape (cols, rows) as a function of config)
    "attn_norm": ("attn_norm.weight", True, lambda c: (c.n_embd,)),
    "wq": ("attn_q.weight", True, lambda c: (c.n_embd, c.n_head * c.head_dim)),
    "wk": ("attn_k.weight", True, lambda c: (c.n_embd, c.kv_dim)),
    "wv": ("attn_v.weight", True, lambda c: (c.n_embd, c.kv_dim)),
    "wo": ("attn_output.weight", True, lambda c: (c.n_head * c.head_dim, c.n_embd)),
    "bq": ("attn_q.bias", False, lambda c: (c.n_head * c.head_dim,)),
    "bk": ("attn_k.bias", False, lambda c: (c.kv_dim,)),
    "bv": ("attn_v.bias", False, lambda c: (c.kv_dim,)),
    "attn_q_norm": ("attn_q_norm.weight", False, lambda c: (c.head_dim,)),
    "attn_k_norm": ("attn_k_norm.weight", False, lambda c: (c.head_dim,)),
    "post_attn_norm": ("post_attention_norm.weight", False, lambda c: (c.n_embd,)),
    "ffn_norm": ("ffn_norm.weight", True, lambda c: (c.n_embd,)),
    "ffn_gate": ("ffn_gate.weight", True, lambda c: (c.n_embd, c.n_ff)),
    "ffn_up": ("ffn_up.weight", True, lambda c: (c.n_embd, c.n_ff)),
    "ffn_down": ("ffn_down.weight", True, lambda c: (c.n_ff, c.n_embd)),
    "post_ffw_norm": ("post_ffw_norm.weight", False, lambda c: (c.n_embd,)),
}
# Tensors that must be present for an architecture even though other archs lack them.
ARCH_REQUIRED = {
    "gemma3": ("attn_q_norm", "attn_k_norm", "post_attn_norm", "post_ffw_norm"),
    "qwen2": ("bq", "bk", "bv"),
}
NORM_FIELDS = {"attn_norm", "attn_q_norm", "attn_k_norm", "post_attn_norm", "ffn_norm", "post_ffw_norm",
               "bq", "bk", "bv"}
# The fields the forward pass multiplies by (forward.c: matmul / rq_matmul_multi), besides "output".
MATMUL_FIELDS = ("wq", "wk", "wv", "wo", "ffn_gate", "ffn_up", "ffn_down")


class Weights:
    """Tensor specs (type, address, rows, cols[, R16 address]) pointing into the mapped file, validated."""

    def __init__(self, gguf: GGUFFile, cfg: Config):
        self.gguf = gguf
        self.cfg = cfg
        self.globals = {
            "token_embd": self._spec("token_embd.weight", (cfg.n_embd, cfg.n_vocab)),
            "output_norm": self._spec("output_norm.weight", (cfg.n_embd,), f32=True),
        }
        tied = "output.weight" not in gguf.tensors
        self.tied_output = tied
        self.output_name = "token_embd.weight" if tied else "output.weight"
        self.globals["output"] = self.globals["token_embd"] if tied else self._spec(
            "output.weight", (cfg.n_embd, cfg.n_vocab))
        self.layers: list[dict[str, tuple[int, ...]]] = []
        for il in range(cfg.n_layer):
            layer = {}
            for field, (suffix, required, shape) in LAYER_TENSORS.items():
                name = f"blk.{il}.{suffix}"
                must = required or field in ARCH_REQUIRED.get(cfg.arch, ())
                if name not in gguf.tensors:
                    if must:
                        raise ModelError(f"{gguf.path}: tensor {name} is missing (needed by {cfg.arch})")
                    continue
                layer[field] = self._spec(name, shape(cfg), f32=field in NORM_FIELDS)
            self.layers.append(layer)

    def matmul_names(self) -> list[str]:
        """GGUF names of the tensors the forward pass multiplies by, each once (a tied output is
        token_embd.weight, whose rows the embedding lookup also reads from the GGUF)."""
        names = [f"blk.{il}.{LAYER_TENSORS[f][0]}" for il, layer in enumerate(self.layers)
                 for f in MATMUL_FIELDS if f in layer]
        return list(dict.fromkeys([*names, self.output_name]))

    def use_repacked(self, addresses: dict[str, int]) -> int:
        """Give each matmul weight in `addresses` (GGUF name -> address of its R16 copy) that address
        as its spec's 5th element, which the forward pass then multiplies by; returns how many.
        token_embd's own spec keeps only the GGUF address: the lookup reads its rows there."""
        used = 0
        for il, layer in enumerate(self.layers):
            for f in MATMUL_FIELDS:
                name = f"blk.{il}.{LAYER_TENSORS[f][0]}"
                if f in layer and name in addresses:
                    layer[f] = (*layer[f][:4], addresses[name])
                    used += 1
        if self.output_name in addresses:
            self.globals["output"] = (*self.globals["output"][:4], addresses[self.output_name])
            used += 1
        return used

    def _spec(self, name: str, shape: tuple[int, ...], f32: bool = False) -> tuple[int, int, int, int]:
        info = self.gguf.tensors.get(name)
        if info is None:
            raise ModelError(f"{self.gguf.path}: tensor {name} is missing")
        if tuple(info.shape) != shape:
            raise ModelError(f"{self.gguf.path}: tensor {name} has shape {list(info.shape)}, "
                             f"the metadata implies {list(shape)}")
        if info.type not in SUPPORTED_TYPES:
            raise ModelError(f"{self.gguf.path}: tensor {name} has type {_type_name(info.type)}, not supported; "
                             f"supported: {', '.join(t.name for t in SUPPORTED_TYPES)}")
        if f32 and info.type != GGMLQuantizationType.F32:
            raise ModelError(f"{self.gguf.path}: tensor {name} should be F32, is {_type_name(info.type)}")
        if not f32 and shape[0] % 32:
            raise ModelError(f"{self.gguf.path}: tensor {name} row length {shape[0]} is not a multiple of 32")
        data = self.gguf.tensor_data(name)
        address = data.__array_interface__["data"][0]
        cols = shape[0]
        rows = shape[1] if len(shape) > 1 else 1
        return (int(info.type), address, rows, cols)


def _repacked_weights(gguf: GGUFFile, weights: Weights, repack: bool | None, threads: int,
                      progress: repack_cache.Progress | None) -> tuple[RepackedWeights | None, WeightLayout]:
    """Map (building first if needed) the repacked cache and point the matmul specs at it."""
    decision = repack_cache.decide(repack)
    if not decision.enabled:
        return None, WeightLayout(None, f"GGUF layout: {decision.reason}")
    try:
        repacked = repack_cache.load_or_build(
            gguf, weights.matmul_names(), threads=threads,
            progress=progress or repack_cache.LogProgress(gguf.path.name))
    except repack_cache.RepackError as exc:
        repack_cache.log.warning("%s; computing on the GGUF layout", exc)
        return None, WeightLayout(None, f"GGUF layout: the repacked cache could not be made ({exc})")
    if repacked is None:
        return None, WeightLayout(None, "GGUF layout: no weight matrix has a type the R16 layout covers")
    weights.use_repacked(repacked.addresses)
    gguf.advise_random_reads(except_tensors=set(weights.matmul_names()) - set(repacked.addresses))
    return repacked, WeightLayout(repacked.path, repacked.describe())


def _type_name(t: int) -> str:
    try:
        return GGMLQuantizationType(t).name
    except ValueError:
        return f"#{t}"


def kv_layout(cfg: Config, kv_budget: str | int, max_context: int | None = None
              ) -> tuple[int, int, int, list[int | None], int]:
    """KVCache.from_budget's arguments for a model: (budget bytes, n_layer, kv_dim, local slots, max capacity)."""
    limit = min(cfg.n_ctx_train, max_context or cfg.n_ctx_train)
    local = [cfg.sliding_window + MAX_UBATCH - 1 if cfg.layer_is_local(il) else None for il in range(cfg.n_layer)]
    return parse_bytes(kv_budget), cfg.n_layer, cfg.kv_dim, local, limit


@dataclass(frozen=True)
class KVPlan:
    budget_bytes: int
    tokens: int  # the cache's capacity
    kv_bytes: int  # what its arrays take
    max_tokens: int  # the model's (or max_context's) context length: more is never allocated


def kv_plan(cfg: Config, kv_budget: str | int, max_context: int | None = None,
            kv_type_name: str | None = None) -> KVPlan:
    """The KV cache a Model.load of this model makes under `kv_budget`, worked out without allocating
    it: the one KV arithmetic that the memory guard and the summariser's planner ask."""
    budget, _, kv_dim, local, limit = kv_layout(cfg, kv_budget, max_context)
    tokens, kv_bytes = KVCache.plan(budget, kv_dim, local, limit, kv_type_name)
    return KVPlan(budget, tokens, kv_bytes, limit)


@dataclass(frozen=True)
class WeightLayout:
    """Which layout the matmuls run on: a repacked cache (its path) or the GGUF's own, and why."""

    repacked: Path | None
    reason: str

    def describe(self) -> str:
        return self.reason


class Model:
    """Config + mapped weights (+ their repacked cache) + KV cache + the compiled forward pass."""

    def __init__(self, gguf: GGUFFile, cfg: Config, weights: Weights, kv: KVCache, threads: int,
                 repacked: RepackedWeights | None = None, layout: WeightLayout | None = None):
        from engine.kernels._forward import ForwardModel

        self.gguf = gguf
        self.cfg = cfg
        self.weights = weights
        self.kv = kv
        self.threads = threads
        self.repacked = repacked  # the mapping must live as long as the forward pass reads it
        self.layout = layout or WeightLayout(None, "GGUF layout")
        config = asdict(cfg)
        config.update(arch=ARCH_IDS[cfg.arch], rope_neox=int(cfg.rope_neox), ffn_gelu=int(cfg.ffn_gelu),
                      max_ubatch=MAX_UBATCH, n_threads=threads)
        self._fwd = ForwardModel(config, weights.globals, weights.layers, kv.k, kv.v, kv.capacity,
                                 (gguf, repacked))
        self._logits = np.zeros(cfg.n_vocab, dtype=np.float32)
        self.governor = ThreadGovernor(threads)  # one thread while the cores are shared
        self._threads_set = threads

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, threads: int | None = None,
             kv_budget: str | int = DEFAULT_KV_BUDGET, max_context: int | None = None, repack: bool | None = None,
             repack_progress: repack_cache.Progress | None = None, kv_type: str | None = None) -> Model:
        """repack: None = on when the kernel path reads R16 (RQLLM_REPACK=0 turns it off), False = off.
        The first load writes the repacked cache (engine.repack; repack_progress(done, total) bytes,
        else log lines), later ones map it. When it cannot be written (disk space, a read-only
        cache) the model runs on the GGUF layout and a warning says why. kv_type: "f16" | "f32"
        (default: RQLLM_KV_TYPE, else f16)."""
        try:
            gguf = GGUFFile(path, index_cache=True)
        except GGUFError as exc:
            raise ModelError(str(exc)) from None
        cfg = Config.from_gguf(gguf)
        weights = Weights(gguf, cfg)
        try:
            kv = KVCache.from_budget(*kv_layout(cfg, kv_budget, max_context), kv_type_name=kv_type)
        except ValueError as exc:
            raise ModelError(str(exc)) from None
        threads = threads or default_threads()
        repacked, layout = _repacked_weights(gguf, weights, repack, threads, repack_progress)
        return cls(gguf, cfg, weights, kv, threads, repacked, layout)

    @property
    def path(self) -> Path:
        return self.gguf.path

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def forward(self, tokens, pos0: int) -> np.ndarray:
        """Logits of the last of `tokens` (placed at positions pos0..). The returned array is
        reused by the next call: copy it to keep it."""
        self._run(tokens, pos0, self._logits, False)
        return self._logits

    def forward_all(self, tokens, pos0: int = 0) -> np.ndarray:
        """Logits of every token, [n, n_vocab] (a new array)."""
        out = np.zeros((len(tokens), self.cfg.n_vocab), dtype=np.float32)
        self._run(tokens, pos0, out, True)
        return out

    def _run(self, tokens, pos0: int, out: np.ndarray, all_logits: bool) -> None:
        def one_pass(threads: int) -> None:
            if threads != self._threads_set:
                self._threads_set = self._fwd.set_threads(threads)
            self._fwd.forward(tokens, pos0, out, all_logits)

        self.governor.run(one_pass)

    def forward_layers(self, tokens) -> tuple[np.ndarray, np.ndarray]:
        """Residual stream after the embedding and after every layer ([n_layer+1, n, n_embd]) and
        the logits of every token, for a prompt of at most MAX_UBATCH tokens at position 0."""
        n = len(tokens)
        if n > MAX_UBATCH:
            raise ValueError(f"forward_layers takes at most {MAX_UBATCH} tokens")
        buf = np.zeros((self.cfg.n_layer + 1, n, self.cfg.n_embd), dtype=np.float32)
        self._fwd.record_layers(buf, n)
        try:
            logits = self.forward_all(tokens, 0)
        finally:
            self._fwd.record_layers(None, 0)
        return buf, logits
