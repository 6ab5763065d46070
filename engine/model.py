"""A model: its config (from GGUF metadata), its weights (tensors mapped in place) and the
compiled forward pass over them, with a KV cache sized from a byte budget.

    model = Model.load("model.gguf", threads=2, kv_budget="256MiB")
    logits = model.forward(token_ids, pos0)     # logits of the last token, float32 [n_vocab]
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from engine.cpus import choose_threads
from engine.gguf_constants import GGMLQuantizationType
from engine.gguf_file import GGUFError, GGUFFile
from engine import decode_tuning
from engine import repack as repack_cache
from engine.kv_cache import KVCache, parse_bytes
from engine.repack import RepackedWeights
from engine.thread_governor import ThreadGovernor
from engine.defaults import DEFAULT_KV_BUDGET
from engine.registry import ModelError  # noqa: F401 - raised here, imported from here by callers
from engine import rope
from engine.rope import SCALING_TYPES, RopeScaling

# Types the compiled kernels read (engine/kernels/quants.h).
SUPPORTED_TYPES = tuple(
    GGMLQuantizationType[n]
    for n in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "IQ4_NL", "IQ4_XS")
)
MAX_UBATCH = 128  # tokens per compiled pass: larger prompts are run in passes of this size
# A mixture of experts' pass: its tokens are shared out among the experts, so a pass of 128 tokens gives
# each of Qwen3-30B-A3B's 128 experts (top 8) about 8, too few for the prefill tile kernels (they
# expand an expert's weights once per pass and reuse them for every token it got). 512, llama.cpp's
# default ubatch, gives them about 32. Only for models without sliding windows, whose ring sizes
# (kv_layout) and speculative rounds are planned on MAX_UBATCH.
MOE_UBATCH = 512


def default_threads() -> int:
    """RQLLM_THREADS, else the CPUs this process may use (affinity mask and cgroup quota: engine.cpus)."""
    return choose_threads().threads


# ---------------------------------------------------------------------------------------------
# What we run: every architecture is a row of switches of the one forward pass
# (engine/kernels/forward.c), with its rules from llama.cpp's src/models/<arch>.cpp.

@dataclass(frozen=True)
class Arch:
    rope_neox: bool  # RoPE rotates pairs (i, i + n_rot/2); else adjacent pairs (llama's NORM mode)
    required: tuple[str, ...] = ()  # layer tensors (LAYER_TENSORS fields) it needs beyond COMMON_TENSORS
    optional: tuple[str, ...] = ()  # layer tensors it may have
    keys: tuple[str, ...] = ()  # metadata keys ("{arch}." + key) it reads beyond COMMON_KEYS
    ffn_gelu: bool = False  # GELU-tanh gate; else SiLU
    embd_scale: bool = False  # embeddings times sqrt(n_embd)
    swa_pattern: int = 0  # with a sliding window, layer il slides when il % swa_pattern < swa_pattern - 1
    local_rope_base: float | None = None  # sliding layers' fixed RoPE base; None: rope.freq_base_swa or freq_base
    fused: bool = False  # q|k|v in attn_qkv and gate|up in ffn_up (phi3)
    tied_output_only: bool = False  # logits always from token_embd (llama.cpp never reads output.weight)
    experts: str = "never"  # a mixture-of-experts FFN: "never", "always", or "when expert_count > 0"
    expert_norm: bool = False  # the chosen experts' weights renormalised to sum 1 (build_moe_ffn's norm_w)
    qk_norm_full: bool = False  # attn_q_norm / attn_k_norm over all heads at once, before the head split


COMMON_TENSORS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")  # dense FFN
COMMON_KEYS = (
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.attn_factor",
)
GEMMA_NORMS = ("post_attn_norm", "post_ffw_norm")
DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_down")
EXPERT_FFN = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
EXPERT_KEYS = ("expert_count", "expert_used_count")
ARCHS: dict[str, Arch] = {
    "llama": Arch(rope_neox=False, optional=("bq", "bk", "bv"), keys=EXPERT_KEYS,  # Llama 1-3, Mistral, SmolLM,
                  experts="when expert_count > 0", expert_norm=True),  # Mixtral (src/models/llama.cpp: norm_w true)
    "qwen2": Arch(rope_neox=True, required=("bq", "bk", "bv")),
    "qwen3": Arch(rope_neox=True, required=("attn_q_norm", "attn_k_norm")),
    "gemma2": Arch(rope_neox=True, required=GEMMA_NORMS, ffn_gelu=True, embd_scale=True, swa_pattern=2,
                   keys=("attention.sliding_window", "rope.freq_base_swa", "attn_logit_softcapping",
                         "final_logit_softcapping"), tied_output_only=True),
    "gemma3": Arch(rope_neox=True, required=("attn_q_norm", "attn_k_norm", *GEMMA_NORMS), ffn_gelu=True,
                   embd_scale=True, swa_pattern=6, local_rope_base=10000.0, keys=("attention.sliding_window",)),
    # attention.sliding_window: llama.cpp warns and runs phi3 with full attention (its PR 13676); so do we
    "phi3": Arch(rope_neox=True, fused=True, keys=("attention.sliding_window",)),
    # src/models/qwen3moe.cpp: qwen3's attention; build_moe_ffn with norm_w true, softmax gating
    "qwen3moe": Arch(rope_neox=True, required=("attn_q_norm", "attn_k_norm"),
                     keys=(*EXPERT_KEYS, "expert_feed_forward_length"), experts="always", expert_norm=True),
    # src/models/olmoe.cpp: q/k norms over the whole projection; norm_w false
    "olmoe": Arch(rope_neox=True, required=("attn_q_norm", "attn_k_norm"), keys=EXPERT_KEYS, experts="always",
                  qk_norm_full=True),
}
SUPPORTED_ARCHS = tuple(ARCHS)

# Metadata keys and tensors that a file may carry and that change nothing we compute, each with why.
# Anything else that we do not read is refused: a silently ignored key or tensor is a wrong answer.
HARMLESS_KEYS = {
    "rope.scaling.finetuned": "a note on how the model was trained",
    "expert_count": "0 is a dense model (checked; read where the architecture has experts)",
    "expert_used_count": "0 is a dense model (checked; read where the architecture has experts)",
}
HARMLESS_TENSORS = {
    "attn_rot_embd": "old converters' copy of base^(-2i/n_rot), which the engine computes",
}


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
    n_rot: int
    rope_base: float
    rope_base_local: float
    rope_neox: bool
    rope_scaling: RopeScaling
    sliding_window: int
    swa_pattern: int
    embd_scale: float
    attn_scale: float
    attn_softcap: float
    final_softcap: float
    ffn_gelu: bool
    qk_norm_full: bool = False
    n_expert: int = 0  # > 0: a mixture-of-experts FFN (engine/kernels/experts.h)
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_norm: bool = False

    @property
    def ubatch(self) -> int:
        """Most tokens per compiled pass (MAX_UBATCH, or MOE_UBATCH for a mixture of experts)."""
        return MOE_UBATCH if self.n_expert > 0 and self.sliding_window == 0 else MAX_UBATCH

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def spec(self) -> Arch:
        return ARCHS[self.arch]

    def layer_is_local(self, il: int) -> bool:
        return self.sliding_window > 0 and self.swa_pattern > 0 and il % self.swa_pattern < self.swa_pattern - 1

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Config:
        arch = gguf.arch
        spec = ARCHS.get(arch)
        if spec is None:
            raise ModelError(f"{gguf.path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        _refuse_unread_keys(gguf, arch, spec)

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
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise ModelError(f"{gguf.path}: metadata key {arch}.attention.value_length = "
                             f"{key('attention.value_length')} differs from key_length {head_dim}: not implemented")
        n_expert, n_expert_used = int(key("expert_count", 0)), int(key("expert_used_count", 0))
        moe = spec.experts == "always" or spec.experts != "never" and n_expert > 0
        if not moe and (n_expert or n_expert_used):
            raise ModelError(f"{gguf.path}: metadata key {arch}.expert_count = {n_expert}: {arch} has no "
                             f"mixture-of-experts form")
        if moe and not 0 < n_expert_used <= n_expert < 1 << 16:
            raise ModelError(f"{gguf.path}: metadata keys {arch}.expert_count = {n_expert} and "
                             f"{arch}.expert_used_count = {n_expert_used}: need 0 < used <= count")
        n_ff = int(key("feed_forward_length"))
        # llama.cpp: expert_feed_forward_length, else feed_forward_length (qwen3moe: n_ff / n_used)
        n_ff_exp = int(key("expert_feed_forward_length", 0)) if moe else 0
        if moe and not n_ff_exp:
            n_ff_exp = n_ff // n_expert_used if arch == "qwen3moe" else n_ff
        embd = gguf.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelError(f"{gguf.path}: tensor token_embd.weight is missing")
        n_layer = int(key("block_count"))
        n_ctx_train = int(key("context_length", 4096))
        rope_base = float(key("rope.freq_base", 10000.0, float))
        window = int(key("attention.sliding_window", 0)) if spec.swa_pattern else 0
        softcaps = "attn_logit_softcapping" in spec.keys
        attn_scale = 1.0 / math.sqrt(head_dim)
        if arch == "gemma2" and n_layer == 46 or arch == "gemma3" and n_layer == 62:
            attn_scale = 1.0 / math.sqrt(n_embd / n_head)  # the 27Bs' query_pre_attn_scalar (llama.cpp)
        cfg = cls(
            arch=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_ff=n_ff,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_vocab=int(key("vocab_size", embd.shape[1] if len(embd.shape) > 1 else 0)),
            n_ctx_train=n_ctx_train,
            norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5, float)),
            n_rot=int(key("rope.dimension_count", head_dim)),
            rope_base=rope_base,
            rope_base_local=spec.local_rope_base or float(key("rope.freq_base_swa", rope_base, float)),
            rope_neox=spec.rope_neox,
            rope_scaling=_rope_scaling(gguf, arch, key, n_ctx_train),
            sliding_window=window,
            swa_pattern=spec.swa_pattern if window else 0,
            embd_scale=math.sqrt(n_embd) if spec.embd_scale else 1.0,
            attn_scale=attn_scale,
            attn_softcap=float(key("attn_logit_softcapping", 0.0, float)) if softcaps else 0.0,
            final_softcap=float(key("final_logit_softcapping", 0.0, float)) if softcaps else 0.0,
            ffn_gelu=spec.ffn_gelu,
            qk_norm_full=spec.qk_norm_full,
            n_expert=n_expert if moe else 0,
            n_expert_used=n_expert_used if moe else 0,
            n_ff_exp=n_ff_exp,
            expert_norm=spec.expert_norm and moe,
        )
        cfg._validate(gguf)
        return cfg

    def _validate(self, gguf: GGUFFile) -> None:
        for name in ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "n_vocab", "n_rot"):
            value = getattr(self, name)
            if not 0 < value < 1 << 24:
                raise ModelError(f"{gguf.path}: {name} = {value} is out of range")
        if self.n_head % self.n_head_kv:
            raise ModelError(f"{gguf.path}: head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        if self.head_dim % 2:
            raise ModelError(f"{gguf.path}: head dimension {self.head_dim} must be even for RoPE")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise ModelError(f"{gguf.path}: rope.dimension_count {self.n_rot} must be even and at most the head "
                             f"dimension {self.head_dim}")
        if self.n_expert and not 0 < self.n_ff_exp < 1 << 24:
            raise ModelError(f"{gguf.path}: the experts' feed_forward_length {self.n_ff_exp} is out of range")
        for name in ("attn_softcap", "final_softcap"):
            if not 0 <= getattr(self, name) < 1e30:
                raise ModelError(f"{gguf.path}: {name} = {getattr(self, name)} is out of range")


def _tensor_kind(name: str) -> str:
    """A tensor's name without its block prefix and weight/bias suffix: "blk.3.attn_rot_embd" -> "attn_rot_embd"."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2:
        parts = parts[2:]
    if len(parts) > 1 and parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    return ".".join(parts)


def _refuse_unread_keys(gguf: GGUFFile, arch: str, spec: Arch) -> None:
    """A `{arch}.` key that we neither read nor know to be harmless may change the math: refuse."""
    known = set(COMMON_KEYS) | set(spec.keys) | set(HARMLESS_KEYS)
    prefix = f"{arch}."
    for name in gguf.metadata:
        if name.startswith(prefix) and name[len(prefix):] not in known:
            raise ModelError(f"{gguf.path}: metadata key {name} is not implemented for {arch}; refusing rather "
                             f"than computing without it")


def _rope_scaling(gguf: GGUFFile, arch: str, key, n_ctx_train: int) -> RopeScaling:
    kind = gguf.get(f"{arch}.rope.scaling.type", "none")
    has_long_factors = "rope_factors_long.weight" in gguf.tensors
    if kind == "longrope" and has_long_factors:
        kind = "none"  # LongRoPE is its factor tensors (Weights.rope_tables) and the attention factor
    if kind not in SCALING_TYPES or kind == "longrope":
        raise ModelError(f"{gguf.path}: metadata key {arch}.rope.scaling.type = {str(kind)[:40]!r} is not "
                         f"implemented; implemented: none, linear, yarn, and longrope with its factor tensors")
    factor = float(key("rope.scaling.factor", 1.0, float)) or 1.0
    if kind == "none" and factor != 1.0:
        kind = "linear"  # llama.cpp applies 1 / factor whatever the type says (src/llama-model.cpp)
    if not 0 < factor < 1e6:
        raise ModelError(f"{gguf.path}: metadata key {arch}.rope.scaling.factor = {factor} is out of range")
    scaling = RopeScaling(kind=kind, factor=factor,
                          original_ctx=int(key("rope.scaling.original_context_length", n_ctx_train)),
                          attn_factor=float(key("rope.scaling.attn_factor", 1.0, float)))
    if scaling.attn_factor != 1.0 and kind != "yarn" and not has_long_factors:
        raise ModelError(f"{gguf.path}: metadata key {arch}.rope.scaling.attn_factor = {scaling.attn_factor} is "
                         f"implemented only with YaRN or LongRoPE factors")
    if (kind == "yarn" or has_long_factors) and not 0 < scaling.original_ctx < 1 << 30:
        raise ModelError(f"{gguf.path}: metadata key {arch}.rope.scaling.original_context_length = "
                         f"{scaling.original_ctx} is out of range")
    return scaling


# Per-layer tensors: our field (forward.h's RQ_LAYER_FIELDS) -> (GGUF name suffix, shape (cols, rows)).
LAYER_TENSORS = {
    "attn_norm": ("attn_norm.weight", lambda c: (c.n_embd,)),
    "wq": ("attn_q.weight", lambda c: (c.n_embd, c.n_head * c.head_dim)),
    "wk": ("attn_k.weight", lambda c: (c.n_embd, c.kv_dim)),
    "wv": ("attn_v.weight", lambda c: (c.n_embd, c.kv_dim)),
    "wo": ("attn_output.weight", lambda c: (c.n_head * c.head_dim, c.n_embd)),
    "bq": ("attn_q.bias", lambda c: (c.n_head * c.head_dim,)),
    "bk": ("attn_k.bias", lambda c: (c.kv_dim,)),
    "bv": ("attn_v.bias", lambda c: (c.kv_dim,)),
    "attn_q_norm": ("attn_q_norm.weight", lambda c: (c.n_head * c.head_dim if c.qk_norm_full else c.head_dim,)),
    "attn_k_norm": ("attn_k_norm.weight", lambda c: (c.kv_dim if c.qk_norm_full else c.head_dim,)),
    "post_attn_norm": ("post_attention_norm.weight", lambda c: (c.n_embd,)),
    "ffn_norm": ("ffn_norm.weight", lambda c: (c.n_embd,)),
    "ffn_gate": ("ffn_gate.weight", lambda c: (c.n_embd, c.n_ff)),
    "ffn_up": ("ffn_up.weight", lambda c: (c.n_embd, c.n_ff)),
    "ffn_down": ("ffn_down.weight", lambda c: (c.n_ff, c.n_embd)),
    "ffn_gate_inp": ("ffn_gate_inp.weight", lambda c: (c.n_embd, c.n_expert)),
    "ffn_gate_exps": ("ffn_gate_exps.weight", lambda c: (c.n_embd, c.n_ff_exp, c.n_expert)),
    "ffn_up_exps": ("ffn_up_exps.weight", lambda c: (c.n_embd, c.n_ff_exp, c.n_expert)),
    "ffn_down_exps": ("ffn_down_exps.weight", lambda c: (c.n_ff_exp, c.n_embd, c.n_expert)),
    "post_ffw_norm": ("post_ffw_norm.weight", lambda c: (c.n_embd,)),
}
# Fused tensors (Arch.fused): GGUF suffix -> the fields its rows hold, in order, each (field, rows).
FUSED_TENSORS = {
    "attn_qkv.weight": lambda c: (("wq", c.n_head * c.head_dim), ("wk", c.kv_dim), ("wv", c.kv_dim)),
    "ffn_up.weight": lambda c: (("ffn_gate", c.n_ff), ("ffn_up", c.n_ff)),
}
NORM_FIELDS = {"attn_norm", "attn_q_norm", "attn_k_norm", "post_attn_norm", "ffn_norm", "post_ffw_norm",
               "bq", "bk", "bv"}
# The fields the forward pass multiplies by (forward.c: matmul / rq_matmul_multi), besides "output".
MATMUL_FIELDS = ("wq", "wk", "wv", "wo", "ffn_gate", "ffn_up", "ffn_down", *EXPERT_FFN)
# Global RoPE factor tensors (engine/rope.py): Llama 3's, and Phi-3's LongRoPE pair.
ROPE_FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


class Weights:
    """Tensor specs (type, address, rows, cols[, R16 address]) pointing into the mapped file, validated.
    Every tensor of the file is used or listed in HARMLESS_TENSORS, else the model is refused."""

    def __init__(self, gguf: GGUFFile, cfg: Config):
        self.gguf = gguf
        self.cfg = cfg
        spec = cfg.spec
        used = {"token_embd.weight", "output_norm.weight"}
        self.globals = {
            "token_embd": self._spec("token_embd.weight", (cfg.n_embd, cfg.n_vocab)),
            "output_norm": self._spec("output_norm.weight", (cfg.n_embd,), f32=True),
        }
        tied = spec.tied_output_only or "output.weight" not in gguf.tensors
        self.tied_output = tied
        self.output_name = "token_embd.weight" if tied else "output.weight"
        used.add(self.output_name)
        self.globals["output"] = self.globals["token_embd"] if tied else self._spec(
            "output.weight", (cfg.n_embd, cfg.n_vocab))
        self.rope_factors = {}  # GGUF name -> float32 [n_rot/2]
        for name in ROPE_FACTOR_TENSORS:
            if name in gguf.tensors:
                self._spec(name, (cfg.n_rot // 2,), f32=True)
                self.rope_factors[name] = gguf.tensor_data(name).view("<f4").copy()
                used.add(name)
        if ("rope_factors_long.weight" in self.rope_factors) != ("rope_factors_short.weight" in self.rope_factors):
            raise ModelError(f"{gguf.path}: rope_factors_long.weight and rope_factors_short.weight come as a pair")
        # a mixture of experts has the router and the experts' stacks in place of the dense FFN
        common = tuple(f for f in COMMON_TENSORS if f not in DENSE_FFN) + EXPERT_FFN if cfg.n_expert else COMMON_TENSORS
        self.layers: list[dict[str, tuple[int, ...]]] = []
        self.sources: list[dict[str, tuple[str, int]]] = []  # per layer: field -> (GGUF name, first row)
        for il in range(cfg.n_layer):
            layer, sources = {}, {}
            if spec.fused:
                for suffix, parts in FUSED_TENSORS.items():
                    name = f"blk.{il}.{suffix}"
                    if name in gguf.tensors and (suffix != "ffn_up.weight" or f"blk.{il}.ffn_gate.weight" not in gguf.tensors):
                        row0 = 0
                        fields = parts(cfg)
                        full = self._spec(name, (cfg.n_embd, sum(rows for _, rows in fields)))
                        for field, rows in fields:
                            layer[field] = self._row_slice(full, row0, rows)
                            sources[field] = (name, row0)
                            row0 += rows
                        used.add(name)
            for field in (*common, *spec.required):  # what is missing first: it says more than what is extra
                if field not in layer and f"blk.{il}.{LAYER_TENSORS[field][0]}" not in gguf.tensors:
                    raise ModelError(f"{gguf.path}: tensor blk.{il}.{LAYER_TENSORS[field][0]} is missing "
                                     f"(needed by {cfg.arch})")
            for field, (suffix, shape) in LAYER_TENSORS.items():
                name = f"blk.{il}.{suffix}"
                if field in layer:
                    continue
                if name not in gguf.tensors:
                    if field in common or field in spec.required:
                        raise ModelError(f"{gguf.path}: tensor {name} is missing (needed by {cfg.arch})")
                    continue
                if field not in common + spec.required + spec.optional:
                    raise ModelError(f"{gguf.path}: tensor {name} is not used by the {cfg.arch} forward pass; "
                                     f"refusing rather than computing without it")
                layer[field] = self._spec(name, shape(cfg), f32=field in NORM_FIELDS)
                sources[field] = (name, 0)
                used.add(name)
            self.layers.append(layer)
            self.sources.append(sources)
        for name in gguf.tensors:
            if name not in used and _tensor_kind(name) not in HARMLESS_TENSORS:
                raise ModelError(f"{gguf.path}: tensor {name} is not used by the {cfg.arch} forward pass; "
                                 f"refusing rather than computing without it")

    def rope_tables(self, capacity: int) -> tuple[np.ndarray, np.ndarray, float]:
        """(frequencies of global layers, of sliding layers, cos/sin factor) for a cache of
        `capacity` positions: Phi-3's long factors when that exceeds the original context, as
        llama.cpp chooses by its context size (src/llama-model.cpp, get_rope_factors)."""
        cfg = self.cfg
        factors = self.rope_factors.get("rope_freqs.weight")
        if "rope_factors_long.weight" in self.rope_factors:
            long = capacity > cfg.rope_scaling.original_ctx
            factors = self.rope_factors["rope_factors_long.weight" if long else "rope_factors_short.weight"]
        if factors is not None and not (np.isfinite(factors).all() and (factors > 0).all()):
            raise ModelError(f"{self.gguf.path}: the RoPE factors must be positive and finite")
        glob = rope.frequencies(cfg.rope_base, cfg.n_rot, cfg.rope_scaling, factors)
        local = rope.frequencies(cfg.rope_base_local, cfg.n_rot, cfg.rope_scaling, factors)
        return glob, local, rope.mscale(cfg.rope_scaling)

    def matmul_names(self) -> list[str]:
        """GGUF names of the tensors the forward pass multiplies by, each once (a tied output is
        token_embd.weight, whose rows the embedding lookup also reads from the GGUF)."""
        names = [sources[f][0] for sources in self.sources for f in MATMUL_FIELDS if f in sources]
        return list(dict.fromkeys([*names, self.output_name]))

    def use_repacked(self, addresses: dict[str, int], group_bytes: dict[str, int]) -> int:
        """Give each matmul weight in `addresses` (GGUF name -> address of its R16 copy) that address
        as its spec's 5th element, which the forward pass then multiplies by; returns how many.
        A slice of a fused tensor starts whole groups further (group_bytes: bytes per group of 16
        rows); one that starts inside a group stays on the GGUF layout.
        token_embd's own spec keeps only the GGUF address: the lookup reads its rows there."""
        used = 0
        for layer, sources in zip(self.layers, self.sources):
            for f in MATMUL_FIELDS:
                if f not in sources:
                    continue
                name, row0 = sources[f]
                if name in addresses and row0 % repack_cache.GROUP_ROWS == 0:
                    at = addresses[name] + row0 // repack_cache.GROUP_ROWS * group_bytes[name]
                    layer[f] = (*layer[f][:4], at)
                    used += 1
        if self.output_name in addresses:
            self.globals["output"] = (*self.globals["output"][:4], addresses[self.output_name])
            used += 1
        return used

    def _row_slice(self, spec: tuple[int, ...], row0: int, rows: int) -> tuple[int, int, int, int]:
        """Rows row0..row0+rows of a matrix spec, which are contiguous in the GGUF layout."""
        type_, address, _, cols = spec[:4]
        from engine.kernels._kernels import row_bytes
        return (type_, address + row0 * row_bytes(type_, cols), rows, cols)

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
        rows = math.prod(shape[1:])  # an experts' stack: its matrices' rows one after another
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
    weights.use_repacked(repacked.addresses, repacked.group_bytes)
    gguf.advise_random_reads(except_tensors=set(weights.matmul_names()) - set(repacked.addresses))
    by_type: dict[int, list] = {}  # the repacked matrices of each type (views: nothing is read yet)
    for t in repacked.plan.tensors:
        by_type.setdefault(t.type, []).append((gguf.tensor_data(t.name), repacked.tensor_bytes(t.name), t.rows, t.cols))
    try:
        decode = decode_tuning.choose(by_type, threads)
    except ValueError as exc:  # a bad RQLLM_DECODE_PREFETCH or RQLLM_DECODE_KERNELS
        raise ModelError(str(exc)) from None
    return repacked, WeightLayout(repacked.path, f"{repacked.describe()}; {decode.describe()}")


def _type_name(t: int) -> str:
    try:
        return GGMLQuantizationType(t).name
    except ValueError:
        return f"#{t}"


def kv_layout(cfg: Config, kv_budget: str | int, max_context: int | None = None
              ) -> tuple[int, int, int, list[int | None], int]:
    """KVCache.from_budget's arguments for a model: (budget bytes, n_layer, kv_dim, local slots, max capacity)."""
    limit = min(cfg.n_ctx_train, max_context or cfg.n_ctx_train)
    local = [cfg.sliding_window + cfg.ubatch - 1 if cfg.layer_is_local(il) else None for il in range(cfg.n_layer)]
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
    reason: str  # the layout in words, with why (and how decode reads it, chosen at load)


class Model:
    """Config + mapped weights (+ their repacked cache) + KV cache + the compiled forward pass."""

    def __init__(self, gguf: GGUFFile, cfg: Config, weights: Weights, kv: KVCache, threads: int,
                 repacked: RepackedWeights | None = None, layout: WeightLayout | None = None):
        from engine.kernels._kernels import ForwardModel

        self.gguf = gguf
        self.cfg = cfg
        self.weights = weights
        self.kv = kv
        self.threads = threads
        self.repacked = repacked  # the mapping must live as long as the forward pass reads it
        self.layout = layout or WeightLayout(None, "GGUF layout")
        from engine.kernels._kernels import config_fields

        freq, freq_local, mscale = weights.rope_tables(kv.capacity)
        values = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
        values.update(rope_mscale=mscale, max_ubatch=cfg.ubatch, n_threads=threads)
        compiled = {name: values[name] for name in config_fields()}  # a field Python lacks: KeyError here
        self._fwd = ForwardModel(compiled, freq, freq_local, weights.globals, weights.layers, kv.k, kv.v,
                                 kv.capacity, (gguf, repacked))
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
        the logits of every token, for a prompt of at most one pass (cfg.ubatch tokens) at position 0."""
        n = len(tokens)
        if n > self.cfg.ubatch:
            raise ValueError(f"forward_layers takes at most {self.cfg.ubatch} tokens")
        buf = np.zeros((self.cfg.n_layer + 1, n, self.cfg.n_embd), dtype=np.float32)
        self._fwd.record_layers(buf, n)
        try:
            logits = self.forward_all(tokens, 0)
        finally:
            self._fwd.record_layers(None, 0)
        return buf, logits
