"""Test models for every weight type and for the qwen2 architecture, made deterministically.

    python -m tests.quant_models Q4_K Q6_K qwen2 llama-untied   # make (or find) the files, print their paths

* ``requantized(src, "Q4_K")``: a copy of a GGUF (SmolLM2) whose 2-D weight tensors are
  dequantized (gguf.quants.dequantize) and quantized again to the given type; every metadata key
  (tokenizer included) and every 1-D tensor (norms, F32) is copied as it is.  The legacy and float
  types are quantized by the gguf package; the K types (Q2_K..Q6_K, blocks of 256) and IQ4_NL /
  IQ4_XS by the numpy packers below.  A K type or IQ4_XS needs rows that are a multiple of 256,
  and SmolLM2's hidden size is 576: tensors whose rows are not (everything but ffn_down) are
  written as Q8_0 instead (IQ4_XS: as IQ4_NL), as llama.cpp's quantizer falls back to another
  type for such tensors (llama-quant.cpp, tensor_type_fallback: IQ4_XS -> IQ4_NL).
  ``untied=True`` also writes an explicit ``output.weight`` (a copy of token_embd), the
  mistral-style llama layout (llama architecture, untied output).
* ``qwen2_random()``: a small random-weight qwen2 GGUF (4 layers, hidden 256, 4 heads / 2 KV
  heads, head_dim 64, FFN 512, nonzero q/k/v biases, untied output, SmolLM2's tokenizer with
  pre-tokenizer "qwen2"); with hidden 256 every matrix can be a K type, so its layers use
  Q4_K/Q5_K/Q6_K/Q3_K/Q2_K and its attention/output Q8_0/F16.

Files are cached under ~/.cache/rqllm/test-models/ (RQLLM_CACHE overrides ~/.cache/rqllm), named
by type and a hash of the source file and of this module's code, and written to a temporary name
first.  Everything is plain numpy with fixed seeds, so the bytes are the same on every run.

The K packers follow the block layouts of llama.cpp's quantize_row_q*_K_ref (ggml-quants.c) with
plain rounding instead of its error-minimising scale search: per sub-block a scale (and for
Q2_K/Q4_K/Q5_K a min) from the block's range, the sub-block scales quantized against one fp16
super-block scale, then each value rounded against its sub-block's final scale.  The bytes are
valid blocks; tests/test_quant_coverage.py checks that gguf.quants.dequantize reads them back
close to the input.  The IQ4 packers do what llama.cpp's quantize_row_iq4_nl_impl does first,
without its scale search and importance weights: a block's scale maps its signed extreme to the
table's -127, each value takes the nearest table value, and IQ4_XS quantizes the block scales to
6 bits against one fp16 super-block scale (extreme -> -32) before the values are rounded.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

ALL_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
             "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
IQ4_TYPES = ("IQ4_NL", "IQ4_XS")
QK_K = 256
FALLBACK_TYPE = "Q8_0"  # for rows a K type cannot hold (not a multiple of 256)
FALLBACK = {"IQ4_XS": "IQ4_NL"}  # llama.cpp's for IQ4_XS; the K types: FALLBACK_TYPE

FILE_TYPE = {
    "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "BF16": LlamaFileType.MOSTLY_BF16,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": LlamaFileType.MOSTLY_Q5_0, "Q5_1": LlamaFileType.MOSTLY_Q5_1,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q2_K": LlamaFileType.MOSTLY_Q2_K,
    "Q3_K": LlamaFileType.MOSTLY_Q3_K_S, "Q4_K": LlamaFileType.MOSTLY_Q4_K_S,
    "Q5_K": LlamaFileType.MOSTLY_Q5_K_S, "Q6_K": LlamaFileType.MOSTLY_Q6_K,
    "IQ4_NL": LlamaFileType.MOSTLY_IQ4_NL, "IQ4_XS": LlamaFileType.MOSTLY_IQ4_XS,
}


def cache_dir() -> Path:
    root = os.environ.get("RQLLM_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "rqllm"
    return base / "test-models"


# ---------------------------------------------------------------------------------------------
# K-type packers: float32 rows [n, k*256] -> uint8 blocks [n, k*block_bytes]


def _fp16(x: np.ndarray) -> np.ndarray:
    """Values as their fp16 rounding (the stored super-block scales), in float32."""
    return x.astype(np.float16).astype(np.float32)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b == 0 (all-zero blocks)."""
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _signed_absmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """The value of largest magnitude, with its sign (llama.cpp's 'max' in the signed quantizers)."""
    idx = np.abs(x).argmax(axis=axis)
    return np.take_along_axis(x, np.expand_dims(idx, axis), axis=axis)


def _pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block -> the 12 bytes get_scale_min_k4 reads."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty(sc.shape[:-1] + (12,), np.uint8)
    out[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)
    return out


def _affine_k(xb: np.ndarray, nmax: int, scale_bits: int):
    """Q2_K/Q4_K/Q5_K: sub-blocks xb [nb, n_sub, sub] -> (d, dmin [nb,1], ls, lm [nb,n_sub], L).

    value = d*ls * L - dmin*lm with L in 0..nmax; min = min(x, 0) as in make_qkx2_quants."""
    lo = np.minimum(xb.min(axis=-1), 0.0)
    hi = xb.max(axis=-1)
    scale = (hi - lo) / np.float32(nmax)
    the_min = -lo  # >= 0
    smax = np.float32((1 << scale_bits) - 1)
    d = _fp16(scale.max(axis=-1, keepdims=True) / smax)
    dmin = _fp16(the_min.max(axis=-1, keepdims=True) / smax)
    ls = np.clip(np.rint(_div(scale, d)), 0, smax)
    lm = np.clip(np.rint(_div(the_min, dmin)), 0, smax)
    step = (d * ls)[..., None]
    offset = (dmin * lm)[..., None]
    L = np.clip(np.rint(_div(xb + offset, step)), 0, nmax).astype(np.uint8)
    return d, dmin, ls.astype(np.uint8), lm.astype(np.uint8), L


def _symmetric_k(xb: np.ndarray, nmax: int, scale_max: int):
    """Q3_K/Q6_K: sub-blocks [nb, n_sub, sub] -> (d [nb,1], signed scales [nb,n_sub], L signed).

    A sub-block's scale maps its signed extreme to -nmax (make_qx_quants/make_q3_quants); the
    scales are quantized the same way against d (extreme -> -scale_max)."""
    mx = _signed_absmax(xb)[..., 0]
    scale = mx / np.float32(-nmax)
    smx = _signed_absmax(scale)
    d = _fp16(smx / np.float32(-scale_max))
    ls = np.clip(np.rint(_div(scale, d)), -scale_max, scale_max - 1)
    step = (d * ls)[..., None]
    L = np.clip(np.rint(_div(xb, step)), -nmax, nmax - 1)
    return d, ls.astype(np.int8), L.astype(np.int8)


def pack_q2_k(x: np.ndarray) -> np.ndarray:
    nb = x.size // QK_K
    d, dmin, ls, lm, L = _affine_k(x.reshape(nb, 16, 16).astype(np.float32), 3, 4)
    scales = ls | (lm << 4)
    q = L.reshape(nb, 2, 4, 32)
    qs = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return np.concatenate([scales, qs.reshape(nb, 64), d.astype(np.float16).view(np.uint8),
                           dmin.astype(np.float16).view(np.uint8)], axis=1)


def pack_q3_k(x: np.ndarray) -> np.ndarray:
    nb = x.size // QK_K
    d, ls, L = _symmetric_k(x.reshape(nb, 16, 16).astype(np.float32), 4, 32)
    Lu = (L.astype(np.int16) + 4).astype(np.uint8).reshape(nb, 8, 32)  # 0..7; element = 32*b + l
    hi = Lu >> 2
    hmask = np.zeros((nb, 32), np.uint8)
    for b in range(8):
        hmask |= hi[:, b] << b
    q = (Lu & 3).reshape(nb, 2, 4, 32)
    qs = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    s = (ls.astype(np.int16) + 32).astype(np.uint8)  # 16 six-bit scales
    low, high = s & 0x0F, s >> 4
    packed = np.empty((nb, 12), np.uint8)
    packed[:, 0:8] = low[:, 0:8] | (low[:, 8:16] << 4)
    packed[:, 8:12] = high[:, 0:4] | (high[:, 4:8] << 2) | (high[:, 8:12] << 4) | (high[:, 12:16] << 6)
    return np.concatenate([hmask, qs.reshape(nb, 64), packed, d.astype(np.float16).view(np.uint8)], axis=1)


def _pack_q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    nb = x.size // QK_K
    d, dmin, ls, lm, L = _affine_k(x.reshape(nb, 8, 32).astype(np.float32), (1 << bits) - 1, 6)
    q = L.reshape(nb, 4, 2, 32) & 0x0F  # 64-chunk c: low nibbles = sub-block 2c, high = 2c+1
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
    parts = [d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8),
             _pack_scale_min_k4(ls, lm)]
    if bits == 5:
        hi = (L >> 4).reshape(nb, 8, 32)  # element = 32*b + l
        qh = np.zeros((nb, 32), np.uint8)
        for b in range(8):
            qh |= hi[:, b] << b
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def pack_q4_k(x: np.ndarray) -> np.ndarray:
    return _pack_q45_k(x, 4)


def pack_q5_k(x: np.ndarray) -> np.ndarray:
    return _pack_q45_k(x, 5)


def pack_q6_k(x: np.ndarray) -> np.ndarray:
    nb = x.size // QK_K
    d, ls, L = _symmetric_k(x.reshape(nb, 16, 16).astype(np.float32), 32, 128)
    Lu = (L.astype(np.int16) + 32).astype(np.uint8)  # 0..63
    low = (Lu & 0x0F).reshape(nb, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
    high = (Lu >> 4).reshape(nb, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(nb, 64)
    return np.concatenate([ql, qh, ls.view(np.uint8), d.astype(np.float16).view(np.uint8)], axis=1)


# ---------------------------------------------------------------------------------------------
# IQ4 packers: float32 rows [n, k*32] (IQ4_XS: [n, k*256]) -> uint8 blocks

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
_IQ4_MIDPOINTS = (KVALUES_IQ4NL[1:] + KVALUES_IQ4NL[:-1]) / 2


def _iq4_indices(v: np.ndarray) -> np.ndarray:
    """The index of the table value nearest to each v (a tie takes the lower one)."""
    return np.searchsorted(_IQ4_MIDPOINTS, v).astype(np.uint8)


def _iq4_nibbles(L: np.ndarray) -> np.ndarray:
    """Indices [..., 32] -> the 16 bytes of a block: element j in the low nibble of byte j, j + 16 in its high one."""
    return L[..., :16] | (L[..., 16:] << 4)


def _iq4_block_scales(xb: np.ndarray) -> np.ndarray:
    """Blocks [..., 32] -> the scale putting each block's signed extreme on the table's -127."""
    return _signed_absmax(xb)[..., 0] / KVALUES_IQ4NL[0]


def pack_iq4_nl(x: np.ndarray) -> np.ndarray:
    nb = x.size // 32
    xb = x.reshape(nb, 32).astype(np.float32)
    d = _fp16(_iq4_block_scales(xb))
    L = _iq4_indices(_div(xb, d[:, None]))
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(nb, 2), _iq4_nibbles(L)], axis=1)


def pack_iq4_xs(x: np.ndarray) -> np.ndarray:
    nb = x.size // QK_K
    xb = x.reshape(nb, 8, 32).astype(np.float32)
    scale = _iq4_block_scales(xb)  # [nb, 8]
    d = _fp16(_signed_absmax(scale) / np.float32(-32))  # [nb, 1]: the extreme block scale -> ls - 32 = -32
    ls = np.clip(np.rint(_div(scale, d)), -32, 31)
    L = _iq4_indices(_div(xb, (d * ls)[..., None]))
    s = (ls + 32).astype(np.uint8)  # 6 bits: low 4 in scales_l (two blocks a byte), high 2 in scales_h
    scales_l = (s[:, 0::2] & 0x0F) | ((s[:, 1::2] & 0x0F) << 4)
    scales_h = np.zeros(nb, np.uint16)
    for j in range(8):
        scales_h |= (s[:, j] >> 4).astype(np.uint16) << (2 * j)
    return np.concatenate([d.astype(np.float16).view(np.uint8), scales_h.view(np.uint8).reshape(nb, 2), scales_l,
                           _iq4_nibbles(L).reshape(nb, 128)], axis=1)


PACKERS = {"Q2_K": pack_q2_k, "Q3_K": pack_q3_k, "Q4_K": pack_q4_k, "Q5_K": pack_q5_k, "Q6_K": pack_q6_k,
           "IQ4_NL": pack_iq4_nl, "IQ4_XS": pack_iq4_xs}


def quantize_rows(w: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [rows, n] -> uint8 [rows, row_bytes] of the given type."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    rows, n = w.shape
    if type_name in PACKERS:
        be, bb = GGML_QUANT_SIZES[T[type_name]]
        if n % be:
            raise ValueError(f"{type_name} rows must be a multiple of {be}, not {n}")
        out = np.empty((rows, n // be * bb), np.uint8)
        step = max(1, (1 << 20) // n)  # ~4 MB of float32 per chunk keeps temporaries in cache
        for r in range(0, rows, step):
            out[r:r + step] = PACKERS[type_name](w[r:r + step]).reshape(-1, out.shape[1])
        return out
    if type_name == "F32":
        return w.view(np.uint8)
    return np.ascontiguousarray(quantize(w, T[type_name])).view(np.uint8).reshape(rows, -1)


def type_for_row(type_name: str, n: int) -> str:
    """The type a tensor with rows of n values is written as (the types with blocks of 256 fall
    back to Q8_0, IQ4_XS to IQ4_NL, when n is not a multiple of 256)."""
    if type_name in PACKERS and n % GGML_QUANT_SIZES[T[type_name]][0]:
        return FALLBACK.get(type_name, FALLBACK_TYPE)
    return type_name


# ---------------------------------------------------------------------------------------------
# writing GGUF files


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter, overrides: dict) -> None:
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in overrides:
            value, vtype = overrides[name]
            writer.add_key_value(name, value, vtype)
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), vtype, sub_type=sub)
    for name, (value, vtype) in overrides.items():
        if name not in reader.fields:
            writer.add_key_value(name, value, vtype)


def _write(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add(writer: GGUFWriter, name: str, w: np.ndarray, type_name: str) -> None:
    data = quantize_rows(w, type_name)
    writer.add_tensor(name, data, raw_dtype=T[type_name])


def write_requantized(src: Path, dst: Path, type_name: str, untied: bool = False) -> dict[str, str]:
    """Write src requantized to type_name at dst; returns {tensor name: type written}."""
    if type_name not in ALL_TYPES:
        raise ValueError(f"unknown type {type_name!r}; one of {', '.join(ALL_TYPES)}")
    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(dst), arch)
    _copy_metadata(reader, writer, {"general.file_type": (int(FILE_TYPE[type_name]), GGUFValueType.UINT32)})
    written: dict[str, str] = {}
    embd = None
    for t in reader.tensors:
        if len(t.shape) == 1:  # norms and biases: as they are
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            written[t.name] = t.tensor_type.name
            continue
        n = int(t.shape[0])
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1, n)
        if t.name == "token_embd.weight":
            embd = w
        target = type_for_row(type_name, n)
        _add(writer, t.name, w, target)
        written[t.name] = target
    if untied:
        if "output.weight" in written or embd is None:
            raise ValueError(f"{src} already has output.weight or lacks token_embd.weight")
        target = type_for_row(type_name, embd.shape[1])
        _add(writer, "output.weight", embd, target)
        written["output.weight"] = target
    _write(writer)
    return written


def write_qwen2_random(dst: Path, tokenizer_src: Path, seed: int = 7) -> dict[str, str]:
    """A small random-weight qwen2 model (see the module docstring) at dst."""
    n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff = 4, 256, 4, 2, 64, 512
    rng = np.random.default_rng(seed)
    reader = GGUFReader(str(tokenizer_src))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    vocab = len(tokens.data)
    writer = GGUFWriter(str(dst), "qwen2")
    writer.add_name("rqllm random qwen2 test model")
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(int(LlamaFileType.MOSTLY_Q4_K_M))
    for name, f in reader.fields.items():  # the tokenizer, pre-tokenizer set to qwen2
        if not name.startswith("tokenizer.") or name == "tokenizer.chat_template":
            continue
        if name == "tokenizer.ggml.pre":
            writer.add_key_value(name, "qwen2", GGUFValueType.STRING)
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), vtype, sub_type=sub)

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(gain / np.sqrt(cols)))

    def vec(n: int, mean: float, spread: float) -> np.ndarray:
        return (mean + spread * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    written: dict[str, str] = {}

    def add(name: str, w: np.ndarray, type_name: str) -> None:
        if w.ndim == 1:
            writer.add_tensor(name, w.astype(np.float32))
            written[name] = "F32"
        else:
            _add(writer, name, w, type_name)
            written[name] = type_name

    # token embeddings of unit-ish scale; untied output scaled so logits spread over a few units
    add("token_embd.weight", rng.standard_normal((vocab, n_embd), dtype=np.float32), "F16")
    add("output_norm.weight", vec(n_embd, 1.0, 0.1), "F32")
    add("output.weight", mat(vocab, n_embd, 4.0), "Q6_K")
    ffn_types = ("Q4_K", "Q5_K", "Q3_K", "Q2_K")
    attn_types = ("Q8_0", "Q6_K", "F16", "Q4_K")
    for il in range(n_layer):
        p = f"blk.{il}."
        at, ft = attn_types[il], ffn_types[il]
        add(p + "attn_norm.weight", vec(n_embd, 1.0, 0.1), "F32")
        add(p + "attn_q.weight", mat(n_head * head_dim, n_embd, 2.0), at)
        add(p + "attn_q.bias", vec(n_head * head_dim, 0.0, 0.5), "F32")
        add(p + "attn_k.weight", mat(n_head_kv * head_dim, n_embd, 2.0), at)
        add(p + "attn_k.bias", vec(n_head_kv * head_dim, 0.0, 0.5), "F32")
        add(p + "attn_v.weight", mat(n_head_kv * head_dim, n_embd), at)
        add(p + "attn_v.bias", vec(n_head_kv * head_dim, 0.0, 0.2), "F32")
        add(p + "attn_output.weight", mat(n_embd, n_head * head_dim, 0.5), at)
        add(p + "ffn_norm.weight", vec(n_embd, 1.0, 0.1), "F32")
        add(p + "ffn_gate.weight", mat(n_ff, n_embd, 1.5), ft)
        add(p + "ffn_up.weight", mat(n_ff, n_embd, 1.5), ft)
        add(p + "ffn_down.weight", mat(n_embd, n_ff, 0.5), ffn_types[(il + 1) % n_layer])
    _write(writer)
    return written


# ---------------------------------------------------------------------------------------------
# the cache


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    return _sha256(Path(path))


_CODE_END = "# ---- end of what makes the bytes"


def _key(src: Path, *parts: str) -> str:
    # the code that decides the bytes: after the module docstring, before the test helpers
    text = Path(__file__).read_text(encoding="utf-8")
    code = text[text.index('\n"""\n') + 5: text.index("\n" + _CODE_END)].encode()
    h = hashlib.sha256()
    for piece in (_sha256(src).encode(), code, *(p.encode() for p in parts)):
        h.update(hashlib.sha256(piece).digest())
    return h.hexdigest()[:12]


def _cached(name: str, make) -> Path:
    """cache_dir()/name, made by make(tmp) when missing; the earlier versions of the same model
    (same name, another key: the source or this code changed) are deleted then, so the cache holds
    one file per model, not one per change (CI's disk filled up with them)."""
    out = cache_dir() / name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        make(tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    _remove_earlier_versions(out)
    return out


def _remove_earlier_versions(out: Path) -> None:
    """Files named as `out` but for its 12-hex-digit key, and the sidecars the engine wrote beside
    them (the tokenizer's cache: <file>.tokenizer-*.json)."""
    stem, key = out.name.removesuffix(".gguf").rsplit("-", 1)
    pattern = re.compile(re.escape(stem) + r"-[0-9a-f]{%d}\.gguf(\..*)?" % len(key))
    for other in out.parent.iterdir():
        if not other.name.startswith(out.name) and pattern.fullmatch(other.name):
            other.unlink(missing_ok=True)


def requantized(src: str | os.PathLike, type_name: str, untied: bool = False) -> Path:
    """The cached requantized copy of src (made when missing)."""
    src = Path(src)
    variant = "untied" if untied else "tied"
    name = f"{src.stem.split('.')[0]}-{type_name}{'-untied' if untied else ''}-{_key(src, type_name, variant)}.gguf"
    return _cached(name, lambda tmp: write_requantized(src, tmp, type_name, untied))


def qwen2_random(tokenizer_src: str | os.PathLike) -> Path:
    """The cached random-weight qwen2 model (tokenizer copied from tokenizer_src)."""
    src = Path(tokenizer_src)
    return _cached(f"qwen2-random-{_key(src, 'qwen2')}.gguf", lambda tmp: write_qwen2_random(tmp, src))


# ---- end of what makes the bytes
# ---------------------------------------------------------------------------------------------
# test helpers: llama.cpp's coverage fixtures (tests/tools/requant_llamacpp_fixtures.py)

FIXTURES = Path(__file__).parent / "fixtures"
NEAR_TIE = 0.5  # logit gap under which llama.cpp disagrees with itself (batched vs one at a time)


COVERAGE_NAMES = list(ALL_TYPES) + ["qwen2", "llama-untied"]


def coverage_model(name: str, smollm2: str | os.PathLike) -> Path:
    """The model file for a coverage name: a weight type (SmolLM2 requantized), "qwen2" (random
    weights) or "llama-untied" (SmolLM2 in Q8_0 with an explicit output.weight)."""
    if name == "qwen2":
        return qwen2_random(smollm2)
    if name == "llama-untied":
        return requantized(smollm2, "Q8_0", untied=True)
    if name not in ALL_TYPES:
        raise ValueError(f"unknown coverage model {name!r}; one of {', '.join(COVERAGE_NAMES)}")
    return requantized(smollm2, name)


def coverage_fixture(name: str, model_file: Path) -> dict:
    """llama.cpp's answers on the coverage model `name`; skips when they were made from other bytes."""
    import json

    import pytest

    path = FIXTURES / f"llamacpp_coverage_{name}.json"
    if not path.exists():
        pytest.skip(f"{path.name} missing (tests/tools/requant_llamacpp_fixtures.py {name} writes it)")
    fx = json.loads(path.read_text(encoding="utf-8"))
    sha = file_sha256(model_file)
    if sha != fx["sha256"]:
        pytest.skip(f"{model_file.name} (sha256 {sha[:12]}) is not the file {path.name} was made from "
                    f"({fx['sha256'][:12]}): the model maker's output changed; rerun "
                    f"tests/tools/requant_llamacpp_fixtures.py {name}")
    return fx


def smollm2_text_ids(n: int = 32) -> list[int]:
    """The first n ids of a plain-text paragraph in SmolLM2's vocabulary (llama.cpp's tokenization,
    tests/fixtures/llamacpp_logits_smollm2-135m.json)."""
    import json

    fx = json.loads((FIXTURES / "llamacpp_logits_smollm2-135m.json").read_text(encoding="utf-8"))
    return fx["ids"][:n]


def teacher_forced_agreement(forward_all, cases: list[dict], reference_all=None) -> dict:
    """Our choice at every step of llama.cpp's greedy runs, each step fed llama.cpp's prefix.

    forward_all(ids) -> logits [len(ids), vocab].  Returns counts and the misses at steps where
    llama.cpp was decided (margin >= NEAR_TIE) and at the first step of a run.

    reference_all (same signature; an independent float32 model: tests/reference.py), when given,
    is asked about decided misses only: a miss where the reference does not take llama.cpp's token
    either is listed under "reference_disagrees" instead of "decided_misses" (llama.cpp's margin
    there comes from its own rounding, not from the weights: measured with IQ4_XS, whose Q8_K
    activations are rounded per 256 values)."""
    import numpy as _np

    steps = agree = 0
    decided_misses, first_misses, reference_disagrees = [], [], []
    for case in cases:
        prompt, theirs = case["prompt_ids"], case["greedy_ids"]
        ours = _np.asarray(forward_all(prompt + theirs[:-1])).argmax(-1)[len(prompt) - 1:]
        ref = None
        for i, (a, b) in enumerate(zip(ours, theirs)):
            steps += 1
            agree += int(a == b)
            if a != b and case["margins"][i] >= NEAR_TIE:
                if reference_all is not None and ref is None:
                    ref = _np.asarray(reference_all(prompt + theirs[:-1])).argmax(-1)[len(prompt) - 1:]
                if ref is not None and ref[i] != b:
                    reference_disagrees.append((case["name"], i, case["margins"][i]))
                else:
                    decided_misses.append((case["name"], i, case["margins"][i]))
        if ours[0] != theirs[0]:
            first_misses.append((case["name"], case["margins"][0]))
    return {"steps": steps, "agree": agree, "decided_misses": decided_misses, "first_misses": first_misses,
            "reference_disagrees": reference_disagrees}


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from engine.registry import resolve

    smollm2 = resolve("smollm2-135m")
    for what in argv or COVERAGE_NAMES:
        path = coverage_model(what, smollm2)
        print(f"{what}\t{path}\t{path.stat().st_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
