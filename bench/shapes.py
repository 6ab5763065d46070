"""Benchmark models with real models' shapes: random weights, Q4_K_M-style types, generated on demand.

    python -m bench.shapes 8b-shape           # make (or find) ~/.cache/rqllm/bench-models/8b-shape-q4_k_m.gguf, print its path
    python -m bench.shapes 1.5b-shape         # the same for 1.5b-shape-q4_k_m.gguf
    python -m bench.shapes 1.5b-shape --tiny -o /tmp/tiny.gguf   # that recipe at toy size (tests)
    python -m bench.shapes --list             # the names

`8b-shape` (Llama 3 8B, ~4.5 GB): arch llama, 32 layers, hidden 4096, FFN 14336, 32 heads / 8 KV
heads (head dim 128), rope base 500000, RMS eps 1e-5, context 8192, untied output.  Types: Q4_K
everywhere, Q6_K for output.weight and for ffn_down / attn_v of the even layers, F32 norms (values
near 1).  Vocabulary: SmolLM2's 49152 tokens (token_embd [4096, 49152]).  The file is the one
bench/shape_8b.py made before this module existed (same name, recipe key and bytes), so a cached
copy is still found.

`1.5b-shape` (Qwen2.5 1.5B, ~1 GB): arch qwen2, 28 layers, hidden 1536, FFN 8960, 12 heads / 2 KV
heads (head dim 128), rope base 1e6, RMS eps 1e-6, context 32768, tied output (no output.weight:
token_embd is the output), F32 biases on q, k and v (blk.N.attn_{q,k,v}.bias, values ~N(0, 0.1)).
Its f16 block scales are 10x smaller than 8b-shape's (1e-4 .. 1.3e-4, see Shape.d_scale), so
weights are about the size of trained ones and attention is soft.
Types as llama.cpp's Q4_K_M makes them (src/llama-quant.cpp, llama_tensor_get_type_impl, read in
the llama.cpp tree vendored by llama-cpp-python 0.3.36): Q4_K everywhere; Q6_K for token_embd
(the tied output gets the output's type) and for attn_v and ffn_down of the "use_more_bits"
layers, `i < n/8 || i >= 7*n/8 || (i - n/8) % 3 == 2` with C integer division (for 28 layers:
0-2, 5, 8, 11, 14, 17, 20, 23, 24-27); F32 norms.  Vocabulary: SmolLM2's tokenizer keys padded
with unused tokens (token type 5, `<|rqllm_pad_N|>`) up to Qwen2's 151936, so token_embd has the
real row count ([1536, 151936]).

`qwen3-4b-shape` (Qwen3 4B, ~2.4 GB): arch qwen3, 36 layers, hidden 2560, FFN 9728, 32 heads / 8 KV
heads of head dim 128 (`attention.key_length`: the q projection is 4096 wide, not 2560), F32 QK
norms (blk.N.attn_{q,k}_norm, {128}), rope base 1e6, RMS eps 1e-6, context 40960, tied output,
vocabulary padded to 151936; llama.cpp's Q4_K_M types as for 1.5b-shape.

`llama3.2-3b-shape` (Llama 3.2 3B, ~2.0 GB): arch llama, 28 layers, hidden 3072, FFN 8192, 24 heads /
8 KV heads (head dim 128), rope base 500000, context 131072, tied output, vocabulary padded to
128256, and the global `rope_freqs.weight` (64 F32) that Llama 3's converter writes: factor 32,
low/high frequency factors 1 / 4, original context 8192 (llama3_rope_factors); Q4_K_M types.

The tokenizer keys are copied from SmolLM2's GGUF (registry.resolve("smollm2-135m")).  Files are
generated into the cache ($RQLLM_CACHE honoured), never committed.

Block bytes are random (timing does not depend on values) except each block's f16 super-block
scales (d, dmin), which are set to small positive values (8b-shape: 1e-3 .. 1e-2) so that no
NaN/Inf can appear.
Tensor data is streamed: gguf's GGUFWriter writes the header and tensor table from sizes alone
(add_tensor_info), then each tensor's bytes as they are made (write_tensor_data), so only one
tensor (at most ~190 MB, a token_embd or output.weight) is in memory at a time.  The file is
written under a temporary name and renamed when complete, so a present file is a complete one.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType, GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES

from engine import registry
from engine.files import atomic_path, cache_dir
from engine.gguf_file import GGUFError, GGUFFile

# f16 super-block scales d: small and positive, so no NaN/Inf can appear.  Q4_K's dmin is 7.5 d
# (its 4-bit values average 7.5), so weights average about zero and activations stay moderate.
D_RANGE = (1e-3, 1.3e-3)
Q4K_DMIN_PER_D = 7.5
BIAS_STD = 0.1  # q/k/v biases: small against q and k (~1 per component at d_scale 0.1)
TOKEN_TYPE_UNUSED = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED
PAD_TOKEN = "<|rqllm_pad_{}|>"


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_ctx: int = 8192
    rope_base: float = 500000.0
    norm_eps: float = 1e-5
    arch: str = "llama"
    # Vocabulary: None keeps SmolLM2's 49152 tokens; a larger number pads with unused tokens.
    n_vocab: int | None = None
    tied_output: bool = False  # no output.weight: token_embd (then Q6_K) is the output
    qkv_bias: bool = False  # F32 blk.N.attn_{q,k,v}.bias
    # Which layers get Q6_K attn_v / ffn_down: "even" (the 8b recipe's simplification) or
    # "llama.cpp" (llama.cpp's use_more_bits rule for Q4_K_M).
    q6k_layers: str = "even"
    # Multiplies D_RANGE.  1.0 for 8b-shape (kept for its bytes): weights of std ~0.25, so q.k
    # scores spread over ~100 and attention is a hard argmax that float rounding flips (a numpy
    # reference differs from itself by ~10 % between float32 and ggml rounding on a toy model).
    # 0.1 for 1.5b-shape: weights of std ~0.03 as in trained models, soft attention.
    d_scale: float = 1.0
    key_length: int | None = None  # head dim when it is not n_embd / n_head (written as attention.key_length)
    qk_norm: bool = False  # F32 blk.N.attn_{q,k}_norm.weight {head_dim}
    llama3_rope: bool = False  # F32 rope_freqs.weight {head_dim / 2}: Llama 3's frequency factors
    n_expert: int = 0  # > 0: the FFN is a mixture of experts (F32 router, 3-D gate/up/down stacks)
    n_expert_used: int = 0
    n_ff_exp: int = 0  # an expert's width (expert_feed_forward_length)

    @property
    def head_dim(self) -> int:
        return self.key_length or self.n_embd // self.n_head


LLAMA3_8B = Shape(n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8)
TINY = Shape(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2)
_QWEN2 = dict(arch="qwen2", n_ctx=32768, rope_base=1000000.0, norm_eps=1e-6, tied_output=True, qkv_bias=True,
              q6k_layers="llama.cpp", d_scale=0.1)
QWEN25_1_5B = Shape(n_layer=28, n_embd=1536, n_ff=8960, n_head=12, n_head_kv=2, n_vocab=151936, **_QWEN2)
# Toy Qwen2: with 2 layers use_more_bits makes layer 1 Q6_K and leaves layer 0 Q4_K; the
# vocabulary is padded to fewer than 151936 tokens to keep the tests' reference pass quick.
TINY_QWEN2 = Shape(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=50000, **_QWEN2)
_QWEN3 = dict(arch="qwen3", n_ctx=40960, rope_base=1000000.0, norm_eps=1e-6, tied_output=True, qk_norm=True,
              q6k_layers="llama.cpp", d_scale=0.1, key_length=128)
QWEN3_4B = Shape(n_layer=36, n_embd=2560, n_ff=9728, n_head=32, n_head_kv=8, n_vocab=151936, **_QWEN3)
TINY_QWEN3 = Shape(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=50000, **_QWEN3)
_LLAMA32 = dict(arch="llama", n_ctx=131072, rope_base=500000.0, norm_eps=1e-5, tied_output=True, llama3_rope=True,
                q6k_layers="llama.cpp", d_scale=0.1)
LLAMA32_3B = Shape(n_layer=28, n_embd=3072, n_ff=8192, n_head=24, n_head_kv=8, n_vocab=128256, **_LLAMA32)
_QWEN3MOE = dict(arch="qwen3moe", n_ctx=40960, rope_base=1000000.0, norm_eps=1e-6, qk_norm=True,
                 q6k_layers="llama.cpp", d_scale=0.1, key_length=128)
# Qwen3-30B-A3B's layers (48 of them in the real model; 12 keep the file ~4.7 GB): 128 experts of 768, 8 per token
QWEN3_30B_A3B_12L = Shape(n_layer=12, n_embd=2048, n_ff=6144, n_head=32, n_head_kv=4, n_vocab=151936,
                          n_expert=128, n_expert_used=8, n_ff_exp=768, **_QWEN3MOE)
TINY_QWEN3MOE = Shape(n_layer=2, n_embd=256, n_ff=768, n_head=4, n_head_kv=2, n_vocab=50000, n_expert=8,
                      n_expert_used=2, n_ff_exp=256, **_QWEN3MOE)
TINY_LLAMA32 = Shape(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=50000, **_LLAMA32)


def llama3_rope_factors(head_dim: int, base: float, factor: float = 32.0, low_freq_factor: float = 1.0,
                        high_freq_factor: float = 4.0, original_ctx: int = 8192) -> np.ndarray:
    """rope_freqs.weight as Llama 3's converter computes it (convert_hf_to_gguf.py, LlamaModel):
    1 for pairs whose wavelength is under original_ctx / high_freq_factor, `factor` above
    original_ctx / low_freq_factor, a smooth blend between."""
    freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freq
    smooth = (original_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blend = 1.0 / ((1.0 - smooth) / factor + smooth)
    out = np.where(wavelen < original_ctx / high_freq_factor, 1.0,
                   np.where(wavelen > original_ctx / low_freq_factor, factor, blend))
    return out.astype(np.float32)


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's rule (src/llama-quant.cpp): which layers' attn_v / ffn_down Q4_K_M makes Q6_K."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def q6k_layer(shape: Shape, il: int) -> bool:
    if shape.q6k_layers == "even":
        return il % 2 == 0
    if shape.q6k_layers == "llama.cpp":
        return use_more_bits(il, shape.n_layer)
    raise ValueError(f"unknown q6k_layers rule {shape.q6k_layers!r}")


@dataclass(frozen=True)
class Recipe:
    """A named shape: its full and tiny shapes, its cache file name and the key marking its files."""
    name: str
    shape: Shape
    tiny: Shape
    filename: str
    recipe_key: str  # a uint32 header key holding recipe_version
    # Bumped whenever the recipe changes, so a cached file from an older recipe is made again.
    recipe_version: int
    title: str  # general.name
    approx_gb: float

    def default_path(self) -> Path:
        return cache_dir() / "bench-models" / self.filename

    def is_complete(self, path: Path, shape: Shape | None = None) -> bool:
        """The file parses, comes from this recipe (and shape) and holds every tensor's bytes."""
        shape = shape or self.shape
        try:
            with GGUFFile(path) as f:
                if (f.get(self.recipe_key) != self.recipe_version or f.arch != shape.arch
                        or f.get(f"{shape.arch}.block_count") != shape.n_layer
                        or f.get(f"{shape.arch}.embedding_length") != shape.n_embd):
                    return False
                return all(f.tensor_data(name).size == info.nbytes for name, info in f.tensors.items())
        except (GGUFError, OSError):
            return False

    def generate(self, dst: str | os.PathLike[str], *, tiny: bool = False,
                 tokenizer_src: str | os.PathLike[str] | None = None, seed: int = 0) -> Path:
        return generate(dst, self.tiny if tiny else self.shape, recipe=self, tokenizer_src=tokenizer_src, seed=seed)

    def ensure(self, path: Path | None = None, *, log=print) -> Path:
        """The cached model, generated first when absent or incomplete."""
        path = path or self.default_path()
        if path.is_file() and self.is_complete(path):
            return path
        log(f"generating the {self.name} model into {path} (~{self.approx_gb:g} GB) ...")
        t0 = time.perf_counter()
        self.generate(path)
        log(f"generated {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
        return path


SHAPES: dict[str, Recipe] = {
    "8b-shape": Recipe("8b-shape", LLAMA3_8B, TINY, "8b-shape-q4_k_m.gguf", "rqllm.bench.shape_8b.recipe", 1,
                       "8B-shape (random weights)", 4.5),
    "1.5b-shape": Recipe("1.5b-shape", QWEN25_1_5B, TINY_QWEN2, "1.5b-shape-q4_k_m.gguf",
                         "rqllm.bench.shape_1_5b.recipe", 1, "1.5B-shape (random weights)", 1.0),
    "qwen3-4b-shape": Recipe("qwen3-4b-shape", QWEN3_4B, TINY_QWEN3, "qwen3-4b-shape-q4_k_m.gguf",
                             "rqllm.bench.shape_qwen3_4b.recipe", 1, "Qwen3-4B-shape (random weights)", 2.4),
    "llama3.2-3b-shape": Recipe("llama3.2-3b-shape", LLAMA32_3B, TINY_LLAMA32, "llama3.2-3b-shape-q4_k_m.gguf",
                                "rqllm.bench.shape_llama32_3b.recipe", 1, "Llama-3.2-3B-shape (random weights)",
                                2.0),
    "moe-shape": Recipe("moe-shape", QWEN3_30B_A3B_12L, TINY_QWEN3MOE, "moe-shape-q4_k_m.gguf",
                        "rqllm.bench.shape_moe.recipe", 1, "Qwen3-30B-A3B-shape, 12 layers (random weights)", 4.7),
}


def recipe(name: str) -> Recipe:
    try:
        return SHAPES[name]
    except KeyError:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}") from None


def recipe_for(shape: Shape) -> Recipe:
    """The recipe a shape belongs to (its full or tiny shape), else the first of the same arch."""
    for r in SHAPES.values():
        if shape in (r.shape, r.tiny):
            return r
    for r in SHAPES.values():
        if r.shape.arch == shape.arch:
            return r
    raise ValueError(f"no recipe for arch {shape.arch!r}")


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # GGUF order: row length (ne0) first
    type: T

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.type]
        n = int(np.prod(self.shape))
        return n // block * size


def tensor_plan(shape: Shape, n_vocab: int) -> list[TensorPlan]:
    """Every tensor with its shape and type, in file order (llama.cpp's order)."""
    e, kv, ff = shape.n_embd, shape.n_head_kv * shape.head_dim, shape.n_ff
    q = shape.n_head * shape.head_dim
    # A tied token_embd is also the output and gets the output's type (llama.cpp: Q6_K).
    plan = [TensorPlan("token_embd.weight", (e, n_vocab), T.Q6_K if shape.tied_output else T.Q4_K)]
    if shape.llama3_rope:
        plan.append(TensorPlan("rope_freqs.weight", (shape.head_dim // 2,), T.F32))
    for il in range(shape.n_layer):
        wide = T.Q6_K if q6k_layer(shape, il) else T.Q4_K  # Q6_K on some ffn_down / attn_v, as Q4_K_M does
        plan.append(TensorPlan(f"blk.{il}.attn_norm.weight", (e,), T.F32))
        for proj, rows, qtype in (("q", q, T.Q4_K), ("k", kv, T.Q4_K), ("v", kv, wide)):
            plan.append(TensorPlan(f"blk.{il}.attn_{proj}.weight", (e, rows), qtype))
            if shape.qkv_bias:
                plan.append(TensorPlan(f"blk.{il}.attn_{proj}.bias", (rows,), T.F32))
        if shape.qk_norm:
            plan += [TensorPlan(f"blk.{il}.attn_q_norm.weight", (shape.head_dim,), T.F32),
                     TensorPlan(f"blk.{il}.attn_k_norm.weight", (shape.head_dim,), T.F32)]
        plan += [
            TensorPlan(f"blk.{il}.attn_output.weight", (q, e), T.Q4_K),
            TensorPlan(f"blk.{il}.ffn_norm.weight", (e,), T.F32),
        ]
        if shape.n_expert:  # llama.cpp's Q4_K_M: the router stays F32, the stacks as the dense matrices
            x, fe = shape.n_expert, shape.n_ff_exp
            plan += [
                TensorPlan(f"blk.{il}.ffn_gate_inp.weight", (e, x), T.F32),
                TensorPlan(f"blk.{il}.ffn_gate_exps.weight", (e, fe, x), T.Q4_K),
                TensorPlan(f"blk.{il}.ffn_up_exps.weight", (e, fe, x), T.Q4_K),
                TensorPlan(f"blk.{il}.ffn_down_exps.weight", (fe, e, x), wide),
            ]
            continue
        plan += [
            TensorPlan(f"blk.{il}.ffn_gate.weight", (e, ff), T.Q4_K),
            TensorPlan(f"blk.{il}.ffn_up.weight", (e, ff), T.Q4_K),
            TensorPlan(f"blk.{il}.ffn_down.weight", (ff, e), wide),
        ]
    plan.append(TensorPlan("output_norm.weight", (e,), T.F32))
    if not shape.tied_output:
        plan.append(TensorPlan("output.weight", (e, n_vocab), T.Q6_K))
    return plan


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def tensor_bytes(plan: TensorPlan, rng: np.random.Generator, d_scale: float = 1.0,
                 shape: Shape | None = None) -> np.ndarray:
    """The tensor's data: random blocks with small positive f16 scales (D_RANGE times d_scale),
    norms near 1, biases near 0, Llama 3's RoPE factors."""
    if plan.name == "rope_freqs.weight":
        if shape is None:
            raise ValueError("rope_freqs.weight needs the shape (its head dim and rope base)")
        return llama3_rope_factors(shape.head_dim, shape.rope_base)
    if plan.type == T.F32:
        if plan.name.endswith("ffn_gate_inp.weight"):  # a router: logits of RMS ~1, experts chosen at random
            return (rng.standard_normal(int(np.prod(plan.shape))) / np.sqrt(plan.shape[0])).astype(np.float32)
        if plan.name.endswith(".bias"):
            return (BIAS_STD * rng.standard_normal(plan.shape[0])).astype(np.float32)
        return (1.0 + 0.02 * rng.standard_normal(plan.shape[0])).astype(np.float32)
    _, size = GGML_QUANT_SIZES[plan.type]
    n_blocks = plan.nbytes // size
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    d = rng.uniform(D_RANGE[0] * d_scale, D_RANGE[1] * d_scale, size=n_blocks)
    if plan.type == T.Q4_K:  # block_q4_K: f16 d, f16 dmin, scales[12], qs[128]
        blocks[:, 0:2] = _f16_bytes(d)
        blocks[:, 2:4] = _f16_bytes(d * Q4K_DMIN_PER_D)
    elif plan.type == T.Q6_K:  # block_q6_K: ql[128], qh[64], int8 scales[16], f16 d
        blocks[:, 208:210] = _f16_bytes(d)
    else:
        raise ValueError(f"{plan.name}: no random-block recipe for {plan.type.name}")
    return blocks.reshape(-1)


TokenizerKey = tuple[str, object, GGUFValueType, "GGUFValueType | None"]


def _tokenizer_keys(src: GGUFFile) -> Iterator[TokenizerKey]:
    for key in src.metadata:
        if not key.startswith("tokenizer."):
            continue
        vtype, itype = src.metadata.value_type(key)
        value = src.metadata[key]
        if isinstance(value, np.ndarray):
            value = value.tolist()
        yield key, value, GGUFValueType(vtype), GGUFValueType(itype) if itype is not None else None


def pad_vocabulary(keys: list[TokenizerKey], n_vocab: int) -> list[TokenizerKey]:
    """The tokenizer keys with the per-token arrays padded to n_vocab entries by unused tokens."""
    n_have = len(next(v for k, v, *_ in keys if k == "tokenizer.ggml.tokens"))
    if n_vocab < n_have:
        raise ValueError(f"cannot pad a vocabulary of {n_have} tokens down to {n_vocab}")
    extra = range(n_have, n_vocab)
    padded = []
    for key, value, vtype, itype in keys:
        if key == "tokenizer.ggml.tokens":
            value = list(value) + [PAD_TOKEN.format(i) for i in extra]
        elif key == "tokenizer.ggml.token_type":
            value = list(value) + [TOKEN_TYPE_UNUSED] * len(extra)
        elif key == "tokenizer.ggml.scores":
            value = list(value) + [0.0] * len(extra)
        padded.append((key, value, vtype, itype))
    return padded


def generate(dst: str | os.PathLike[str], shape: Shape = LLAMA3_8B, *, recipe: Recipe | None = None,
             tokenizer_src: str | os.PathLike[str] | None = None, seed: int = 0) -> Path:
    """Write the model to dst (via a temporary name in the same folder, renamed when complete)."""
    dst = Path(dst)
    recipe = recipe or recipe_for(shape)
    src_path = Path(tokenizer_src) if tokenizer_src is not None else registry.resolve("smollm2-135m")
    src = GGUFFile(src_path)
    try:
        n_vocab = len(src.get("tokenizer.ggml.tokens") or [])
        if not n_vocab:
            raise ValueError(f"{src_path}: no tokenizer.ggml.tokens to copy")
        writer_keys = list(_tokenizer_keys(src))
    finally:
        src.close()
    if shape.n_vocab is not None:
        writer_keys = pad_vocabulary(writer_keys, shape.n_vocab)
        n_vocab = shape.n_vocab
    plan = tensor_plan(shape, n_vocab)

    with atomic_path(dst, tmp=dst.with_name(f"{dst.name}.partial-{os.getpid()}")) as tmp:
        writer = GGUFWriter(tmp, shape.arch)
        try:
            writer.add_name(recipe.title)
            writer.add_file_type(LlamaFileType.MOSTLY_Q4_K_M)
            writer.add_quantization_version(2)
            writer.add_uint32(recipe.recipe_key, recipe.recipe_version)
            writer.add_context_length(shape.n_ctx)
            writer.add_embedding_length(shape.n_embd)
            writer.add_block_count(shape.n_layer)
            writer.add_feed_forward_length(shape.n_ff)
            writer.add_head_count(shape.n_head)
            writer.add_head_count_kv(shape.n_head_kv)
            if shape.arch == "llama":  # real Qwen2 files leave it out (it defaults to the head dim)
                writer.add_rope_dimension_count(shape.head_dim)
            if shape.key_length:
                writer.add_key_length(shape.key_length)
                writer.add_value_length(shape.key_length)
            if shape.n_expert:
                writer.add_expert_count(shape.n_expert)
                writer.add_expert_used_count(shape.n_expert_used)
                writer.add_expert_feed_forward_length(shape.n_ff_exp)
            writer.add_rope_freq_base(shape.rope_base)
            writer.add_layer_norm_rms_eps(shape.norm_eps)
            writer.add_vocab_size(n_vocab)
            for key, value, vtype, itype in writer_keys:
                writer.add_key_value(key, value, vtype, sub_type=itype)
            for t in plan:
                # Sizes only: the data follows tensor by tensor below.
                if t.type == T.F32:
                    writer.add_tensor_info(t.name, t.shape[::-1], np.dtype(np.float32), t.nbytes)
                else:  # given as bytes [rows, row bytes], as the quantized data is written
                    rows = int(np.prod(t.shape[1:]))
                    writer.add_tensor_info(t.name, (*t.shape[:0:-1], t.nbytes // rows), np.dtype(np.uint8), t.nbytes,
                                           raw_dtype=t.type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            rng = np.random.default_rng(seed)
            for t in plan:
                writer.write_tensor_data(tensor_bytes(t, rng, shape.d_scale, shape))
        finally:
            writer.close()
    return dst


def ensure(name: str = "8b-shape", path: Path | None = None, *, log=print) -> Path:
    """The cached model of a named shape, generated first when absent or incomplete."""
    return recipe(name).ensure(path, log=log)


def main(argv: list[str] | None = None) -> int:
    import click

    @click.command()
    @click.argument("name", required=False, type=click.Choice(list(SHAPES)))
    @click.option("--tiny", is_flag=True, help="The recipe at toy shapes (tests); needs -o.")
    @click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
                  help="Where to write (default: the cache path; --tiny needs -o).")
    @click.option("--force", is_flag=True, help="Regenerate even when the file is there.")
    @click.option("--list", "list_", is_flag=True, help="Print the shape names and their files, then exit.")
    def cli(name: str | None, tiny: bool, output: Path | None, force: bool, list_: bool) -> None:
        if list_:
            for r in SHAPES.values():
                click.echo(f"{r.name:<12} ~{r.approx_gb:g} GB  {r.default_path()}")
            return
        if name is None:
            raise click.UsageError(f"give a shape name: {', '.join(SHAPES)}")
        r = recipe(name)
        if tiny:
            if output is None:
                raise click.UsageError("--tiny needs -o PATH")
            r.generate(output, tiny=True)
            click.echo(output)
            return
        path = output or r.default_path()
        if force:
            path.unlink(missing_ok=True)
        click.echo(r.ensure(path, log=lambda m: click.echo(m, err=True)))

    cli.main(args=argv, standalone_mode=True)
    return 0


if __name__ == "__main__":
    main()
