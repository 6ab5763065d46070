"""The 8B-shape benchmark model: random weights with Llama 3 8B's shapes, Q4_K_M-style types.

    python bench/shape_8b.py            # make (or find) ~/.cache/rqllm/bench-models/8b-shape-q4_k_m.gguf, print its path
    python bench/shape_8b.py --tiny -o /tmp/tiny.gguf   # the same recipe at toy size (tests)

Shapes: arch llama, 32 layers, hidden 4096, FFN 14336, 32 heads / 8 KV heads (head dim 128), rope
base 500000, RMS eps 1e-5, context 8192, untied output.  Types: Q4_K everywhere, Q6_K for
output.weight and for ffn_down / attn_v of the even layers, F32 norms (values near 1).  The
tokenizer keys are copied from SmolLM2's GGUF, so the vocabulary is 49152 (token_embd
[4096, 49152]).  About 4.5 GB: generated on demand into the cache ($RQLLM_CACHE honoured), never
committed.

Block bytes are random (timing does not depend on values) except each block's f16 super-block
scales (d, dmin), which are set to small positive values (1e-3 .. 1e-2) so that no NaN/Inf can
appear.
Tensor data is streamed: gguf's GGUFWriter writes the header and tensor table from sizes alone
(add_tensor_info), then each tensor's bytes as they are made (write_tensor_data), so only one
tensor (at most ~165 MB, output.weight) is in memory at a time.  The file is written under a
temporary name and renamed when complete, so a present file is a complete one.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType, GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import models  # noqa: E402
from engine.gguf_file import GGUFError, GGUFFile  # noqa: E402

FILENAME = "8b-shape-q4_k_m.gguf"
# Bumped whenever the recipe changes, so a cached file from an older recipe is made again.
RECIPE_VERSION = 1
RECIPE_KEY = "rqllm.bench.shape_8b.recipe"
# f16 super-block scales d: small and positive, so no NaN/Inf can appear.  Q4_K's dmin is 7.5 d
# (its 4-bit values average 7.5), so weights average about zero and activations stay moderate.
D_RANGE = (1e-3, 1.3e-3)
Q4K_DMIN_PER_D = 7.5


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

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


LLAMA3_8B = Shape(n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8)
TINY = Shape(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2)


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
    plan = [TensorPlan("token_embd.weight", (e, n_vocab), T.Q4_K)]
    for il in range(shape.n_layer):
        wide = T.Q6_K if il % 2 == 0 else T.Q4_K  # Q6_K on half of ffn_down / attn_v, as Q4_K_M does
        plan += [
            TensorPlan(f"blk.{il}.attn_norm.weight", (e,), T.F32),
            TensorPlan(f"blk.{il}.attn_q.weight", (e, shape.n_head * shape.head_dim), T.Q4_K),
            TensorPlan(f"blk.{il}.attn_k.weight", (e, kv), T.Q4_K),
            TensorPlan(f"blk.{il}.attn_v.weight", (e, kv), wide),
            TensorPlan(f"blk.{il}.attn_output.weight", (shape.n_head * shape.head_dim, e), T.Q4_K),
            TensorPlan(f"blk.{il}.ffn_norm.weight", (e,), T.F32),
            TensorPlan(f"blk.{il}.ffn_gate.weight", (e, ff), T.Q4_K),
            TensorPlan(f"blk.{il}.ffn_up.weight", (e, ff), T.Q4_K),
            TensorPlan(f"blk.{il}.ffn_down.weight", (ff, e), wide),
        ]
    plan += [TensorPlan("output_norm.weight", (e,), T.F32),
             TensorPlan("output.weight", (e, n_vocab), T.Q6_K)]
    return plan


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def tensor_bytes(plan: TensorPlan, rng: np.random.Generator) -> np.ndarray:
    """The tensor's data: random blocks with small positive f16 scales, or norms near 1."""
    if plan.type == T.F32:
        return (1.0 + 0.02 * rng.standard_normal(plan.shape[0])).astype(np.float32)
    _, size = GGML_QUANT_SIZES[plan.type]
    n_blocks = plan.nbytes // size
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    d = rng.uniform(*D_RANGE, size=n_blocks)
    if plan.type == T.Q4_K:  # block_q4_K: f16 d, f16 dmin, scales[12], qs[128]
        blocks[:, 0:2] = _f16_bytes(d)
        blocks[:, 2:4] = _f16_bytes(d * Q4K_DMIN_PER_D)
    elif plan.type == T.Q6_K:  # block_q6_K: ql[128], qh[64], int8 scales[16], f16 d
        blocks[:, 208:210] = _f16_bytes(d)
    else:
        raise ValueError(f"{plan.name}: no random-block recipe for {plan.type.name}")
    return blocks.reshape(-1)


def _tokenizer_keys(src: GGUFFile) -> Iterator[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    for key in src.metadata:
        if not key.startswith("tokenizer."):
            continue
        vtype, itype = src.metadata.value_type(key)
        value = src.metadata[key]
        if isinstance(value, np.ndarray):
            value = value.tolist()
        yield key, value, GGUFValueType(vtype), GGUFValueType(itype) if itype is not None else None


def generate(dst: str | os.PathLike[str], shape: Shape = LLAMA3_8B, *, tokenizer_src: str | os.PathLike[str] | None = None,
             seed: int = 0) -> Path:
    """Write the model to dst (via a temporary name in the same folder, renamed when complete)."""
    dst = Path(dst)
    src_path = Path(tokenizer_src) if tokenizer_src is not None else models.resolve("smollm2-135m")
    src = GGUFFile(src_path)
    try:
        n_vocab = len(src.get("tokenizer.ggml.tokens") or [])
        if not n_vocab:
            raise ValueError(f"{src_path}: no tokenizer.ggml.tokens to copy")
        writer_keys = list(_tokenizer_keys(src))
    finally:
        src.close()
    plan = tensor_plan(shape, n_vocab)

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}.partial-{os.getpid()}")
    writer = GGUFWriter(tmp, "llama")
    try:
        writer.add_name("8B-shape (random weights)")
        writer.add_file_type(LlamaFileType.MOSTLY_Q4_K_M)
        writer.add_quantization_version(2)
        writer.add_uint32(RECIPE_KEY, RECIPE_VERSION)
        writer.add_context_length(shape.n_ctx)
        writer.add_embedding_length(shape.n_embd)
        writer.add_block_count(shape.n_layer)
        writer.add_feed_forward_length(shape.n_ff)
        writer.add_head_count(shape.n_head)
        writer.add_head_count_kv(shape.n_head_kv)
        writer.add_rope_dimension_count(shape.head_dim)
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
            writer.write_tensor_data(tensor_bytes(t, rng))
        writer.close()
        os.replace(tmp, dst)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return dst


def default_path() -> Path:
    return models.cache_dir() / "bench-models" / FILENAME


def is_complete(path: Path, shape: Shape = LLAMA3_8B) -> bool:
    """The file parses, comes from this recipe and holds every tensor's bytes."""
    try:
        with GGUFFile(path) as f:
            if f.get(RECIPE_KEY) != RECIPE_VERSION or f.get("llama.block_count") != shape.n_layer:
                return False
            return all(f.tensor_data(name).size == info.nbytes for name, info in f.tensors.items())
    except (GGUFError, OSError):
        return False


def ensure(path: Path | None = None, *, log=print) -> Path:
    """The cached 8B-shape model, generated first when absent or incomplete."""
    path = path or default_path()
    if path.is_file() and is_complete(path):
        return path
    log(f"generating the 8B-shape model into {path} (~4.5 GB) ...")
    t0 = time.perf_counter()
    generate(path)
    log(f"generated {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
    return path


def main(argv: list[str] | None = None) -> int:
    import click

    @click.command()
    @click.option("--tiny", is_flag=True, help="Toy shapes (2 layers, hidden 256, FFN 512, 4/2 heads).")
    @click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
                  help="Where to write (default: the cache path; --tiny needs -o).")
    @click.option("--force", is_flag=True, help="Regenerate even when the file is there.")
    def cli(tiny: bool, output: Path | None, force: bool) -> None:
        if tiny:
            if output is None:
                raise click.UsageError("--tiny needs -o PATH")
            generate(output, TINY)
            click.echo(output)
            return
        path = output or default_path()
        if force:
            path.unlink(missing_ok=True)
        click.echo(ensure(path, log=lambda m: click.echo(m, err=True)))

    cli.main(args=argv, standalone_mode=True)
    return 0


if __name__ == "__main__":
    main()
