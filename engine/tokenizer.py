"""Tokenizer built from GGUF metadata, reproducing llama.cpp's token ids.

Three parts, following llama.cpp ``src/llama-vocab.cpp``:

1. Special-token partition (``tokenizer_st_partition``): control (type 3),
   unknown (2) and user-defined (4) tokens are cut out of the raw text first,
   longest token text first; control/unknown only when ``parse_special`` is true,
   user-defined always.  Hand-written (a few lines over ``str.split``) because
   HF's added-token matcher is leftmost-longest, not longest-first, and costs
   ~1 s to load with Gemma's 6,414 special tokens.
2. ``gpt2`` byte-level BPE (SmolLM2, Llama 3, Qwen2 ...): a Hugging Face
   ``tokenizers`` BPE over the GGUF merges with llama.cpp's pre-tokenizer
   regexes for the file's ``tokenizer.ggml.pre`` and the GPT-2 byte alphabet.
   The assembled HF JSON is cached next to the model (or in
   ``~/.cache/rqllm/tokenizers``), keyed by the model's size and mtime, so a
   warm start skips decoding the vocabulary and merges.
3. ``llama`` SentencePiece-with-scores (Gemma 3): llama.cpp's SPM encoder
   (spaces -> U+2581, optional prefix space, then repeatedly merge the adjacent
   pair whose concatenation is the highest-scoring vocabulary entry, leftmost on
   ties; leftover characters -> ``<0xXX>`` byte tokens).  Hand-written: HF can
   express it as BPE with merges derived from scores, but loading a 262k-entry
   vocabulary plus 515k merges takes 2-3 s here, against a 0.5 s start-up
   budget, and its tie-breaking is by merge rank, not position.

Decoding maps each id to the bytes llama.cpp's ``token_to_piece`` produces
(byte alphabet undone, U+2581 -> space, ``<0xXX>`` -> the byte, control tokens
-> their text unless skipped, unused -> nothing) and decodes the concatenation
as UTF-8, so streaming (``StreamDecoder``) is exact.
"""

from __future__ import annotations

import codecs
import heapq
import json
import os
import re
from array import array
from collections.abc import Iterable
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.files import atomic_write, cache_dir
from engine.gguf_file import GGUFError, GGUFFile

__all__ = ["Tokenizer", "StreamDecoder", "TokenizerError", "SUPPORTED_PRE"]

CACHE_VERSION = 2  # bump whenever the generated HF JSON changes (regexes, options)
SPACE = "\u2581"  # SentencePiece's escaped space

# token types (llama.cpp LLAMA_TOKEN_TYPE_*)
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6
_SPECIAL_TYPES = (TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED)


class TokenizerError(ValueError):
    """The GGUF's tokenizer cannot be built (unsupported model/pre-tokenizer, missing keys...)."""


# --------------------------------------------------------------------------- pre-tokenizers
# Regexes from llama.cpp src/llama-vocab.cpp (llm_tokenizer_bpe).  Where llama.cpp
# rewrote "(?i:...)" for std::regex we keep the original form, which Oniguruma
# (HF) supports.  llama.cpp keeps the unmatched gaps between matches as pieces,
# which is HF's "isolated" split behaviour.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> (regexes applied in sequence, ignore_merges, add_bos default)
_PRE: dict[str, tuple[list[str], bool, bool]] = {}
_PRE["default"] = ([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], False, False)
for _n in ("gpt-2", "phi-2", "mpt", "olmo", "jais"):
    _PRE[_n] = ([_GPT2], False, False)
for _n in ("smollm", "starcoder", "refact", "command-r", "codeshell"):
    _PRE[_n] = ([r"\p{N}", _GPT2], False, False)
for _n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"):
    _PRE[_n] = ([_LLAMA3], True, True)
for _n in ("dbrx", "smaug-bpe"):
    _PRE[_n] = ([_LLAMA3], False, False)
for _n in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"):
    _PRE[_n] = ([_QWEN2], False, False)
SUPPORTED_PRE = tuple(sorted(_PRE))

# Token texts llama.cpp (llama_vocab::impl::load) treats as end-of-generation; it
# also forces them to control type.
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
)
# FIM tokens found by text when the GGUF does not name them: forced to control;
# pad/repo/file-separator ones also end generation.  (key suffix, texts, is_eog)
_FIM = (
    ("fim_pre", ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>", "\u2581<PRE>",
                 "<|code_prefix|>", "<|prefix|>"), False),
    ("fim_suf", ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>", "\u2581<SUF>",
                 "<|code_suffix|>", "<|suffix|>"), False),
    ("fim_mid", ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>", "\u2581<MID>",
                 "<|code_middle|>", "<|middle|>"), False),
    ("fim_pad", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"), True),
    ("fim_rep", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"), True),
    ("fim_sep", ("<|file_sep|>",), True),
)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode alphabet -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


# --------------------------------------------------------------------------- special tokens
class _Specials:
    """llama.cpp's special-token partition, with a cheap pre-scan for which specials occur."""

    def __init__(self, items: list[tuple[int, str, int]]):
        # items: (id, text, type); llama.cpp order: longest text first (ties: lower id here)
        items = [it for it in items if it[1]]
        items.sort(key=lambda it: (-len(it[1]), it[0]))
        self._order = {text: k for k, (_, text, _) in enumerate(items)}
        self._items = items
        self._by_text = {text: (tid, ttype) for tid, text, ttype in items}
        # index: first two characters (or the whole 1-char text) -> the lengths present
        self._lens: dict[str, set[int]] = {}
        for _, text, _ in items:
            self._lens.setdefault(text[:2], set()).add(len(text))
        self._first = frozenset(text[0] for _, text, _ in items)
        self._lens_sorted = {k: sorted(v, reverse=True) for k, v in self._lens.items()}

    def __len__(self) -> int:
        return len(self._items)

    def _present(self, text: str, parse_special: bool) -> list[tuple[int, str]]:
        found: set[str] = set()
        lens = self._lens_sorted
        by_text = self._by_text
        first = self._first
        for p, c in enumerate(text):
            if c not in first:
                continue
            for key in (text[p : p + 2], c) if len(text) > p + 1 else (c,):
                for n in lens.get(key, ()):
                    s = text[p : p + n]
                    if len(s) == n and s in by_text:
                        found.add(s)
        out = []
        for s in sorted(found, key=self._order.__getitem__):
            tid, ttype = by_text[s]
            if parse_special or ttype == TT_USER_DEFINED:
                out.append((tid, s))
        return out

    def partition(self, text: str, parse_special: bool) -> list[str | int]:
        if not self._items or not text:
            return [text] if text else []
        frags: list[str | int] = [text]
        for tid, s in self._present(text, parse_special):
            new: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or s not in f:
                    new.append(f)
                    continue
                parts = f.split(s)
                for k, part in enumerate(parts):
                    if k:
                        new.append(tid)
                    if part:
                        new.append(part)
            frags = new
        return frags


# --------------------------------------------------------------------------- gpt2 / byte-level BPE
def _gpt2_json(g: GGUFFile, tokens: list[str], pre: str) -> str:
    regexes, ignore_merges, _ = _PRE[pre]
    merges_raw = g.get("tokenizer.ggml.merges")
    if not isinstance(merges_raw, list):
        raise TokenizerError(f"{g.path}: gpt2 tokenizer without tokenizer.ggml.merges")
    vocab = dict(zip(tokens, range(len(tokens))))
    merges = []
    for m in merges_raw:
        p = m.find(" ", 1)  # llama.cpp splits at the first space after position 0
        if p > 0:
            a, b = m[:p], m[p + 1 :]
            if a in vocab and b in vocab and a + b in vocab:
                merges.append([a, b])
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],  # specials are partitioned out before HF sees the text
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in regexes
            ]
            + [{"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}],
        },
        "post_processor": None,
        "decoder": None,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return json.dumps(spec, ensure_ascii=False)


def _cache_paths(path: Path) -> list[Path]:
    st = path.stat()
    name = f"{path.name}.tokenizer-v{CACHE_VERSION}-hf{tokenizers.__version__}-{st.st_size}-{st.st_mtime_ns}.json"
    home = Path(os.environ.get("RQLLM_TOKENIZER_CACHE") or cache_dir() / "tokenizers")
    return [path.parent / name, home / name]


def _write_atomic(p: Path, text: str) -> bool:
    """Whether the cache entry was written (a cache that cannot be written is only slower)."""
    try:
        with atomic_write(p, "w", permissions=0o644) as f:  # other users' workers may share the cache
            f.write(text)
        return True
    except OSError:
        return False


def _load_gpt2(g: GGUFFile, pre: str, use_cache: bool) -> tuple[HFTokenizer, bool]:
    """(HF tokenizer, whether it came from the cache)."""
    candidates = _cache_paths(g.path) if use_cache else []
    for p in candidates:
        if p.is_file():
            try:
                return HFTokenizer.from_file(str(p)), True
            except Exception:  # unreadable/corrupt cache entry: rebuild
                pass
    spec = _gpt2_json(g, _tokens(g), pre)
    try:
        hf = HFTokenizer.from_str(spec)
    except Exception as e:
        raise TokenizerError(f"{g.path}: building the BPE tokenizer failed: {e}") from e
    for p in candidates:
        if _write_atomic(p, spec):
            for old in p.parent.glob(f"{g.path.name}.tokenizer-v*.json"):  # entries for older versions of the file
                if old != p:
                    try:
                        old.unlink()
                    except OSError:
                        pass
            break
    return hf, False


# --------------------------------------------------------------------------- SentencePiece (llama)
_SPANNING_RE = re.compile("[^\x00\u2581]\u2581")
_WORD_SPLIT_RE = re.compile("(?<=[^\u2581])(?=\u2581)")

class _SPM:
    """llama.cpp's SPM encoder (llm_tokenizer_spm_session) over a scored vocabulary."""

    def __init__(self, tokens: list[str], scores: np.ndarray, unk_id: int | None):
        self.vocab = dict(zip(tokens, range(len(tokens))))
        # float32 array, not a list: 1 MB instead of 8 MB of float objects per worker for 262k entries;
        # indexing gives the same Python floats
        self.scores = array("f", np.ascontiguousarray(scores, dtype=np.float32).tobytes())
        self._cache: dict[str, list[int]] = {}
        get = self.vocab.get
        self.byte_ids = []
        for b in range(256):
            i = get(f"<0x{b:02X}>")
            if i is None:
                i = get(chr(b)) if b < 128 else None
            self.byte_ids.append(i if i is not None else unk_id)

    # Speed-up (exact): a merge can only join a non-space character to a following
    # U+2581 if some vocabulary entry contains that pair.  When none of those few
    # entries occurs in the text, words are encoded independently and cached.
    _MAX_SPANNING = 64
    _CACHE_MAX = 1 << 16

    @cached_property
    def _spanning(self) -> list[str] | None:
        joined = "\x00".join(self.vocab)  # one C-speed regex pass instead of a loop over the vocabulary
        entries = set()
        for m in _SPANNING_RE.finditer(joined):
            start = joined.rfind("\x00", 0, m.start()) + 1
            end = joined.find("\x00", m.end())
            entries.add(joined[start : end if end >= 0 else len(joined)])
            if len(entries) > self._MAX_SPANNING:
                return None
        return sorted(entries)

    def encode(self, text: str, out: list[int]) -> None:
        spanning = self._spanning
        if len(text) > 24 and spanning is not None and not any(t in text for t in spanning):
            cache = self._cache
            for word in _WORD_SPLIT_RE.split(text):
                ids = cache.get(word)
                if ids is None:
                    ids = []
                    self._encode(word, ids)
                    if len(cache) >= self._CACHE_MAX:
                        cache.clear()
                    cache[word] = ids
                out.extend(ids)
        else:
            self._encode(text, out)

    def _encode(self, text: str, out: list[int]) -> None:
        n = len(text)
        if n == 0:
            return
        get = self.vocab.get
        scores = self.scores
        sym = list(text)  # current symbol text at each start position ('' once absorbed)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []
        push = heapq.heappush
        pop = heapq.heappop

        for i in range(n - 1):
            t = get(sym[i] + sym[i + 1])
            if t is not None:
                heap.append((-scores[t], i, i + 1, 2))
        heapq.heapify(heap)

        while heap:
            _, left, right, size = pop(heap)
            a = sym[left]
            b = sym[right]
            if not a or not b or len(a) + len(b) != size:
                continue  # outdated: one side was merged since
            sym[left] = a + b
            sym[right] = ""
            r2 = nxt[right]
            nxt[left] = r2
            if r2 >= 0:
                prv[r2] = left
            l0 = prv[left]
            if l0 >= 0:
                s = sym[l0] + sym[left]
                t = get(s)
                if t is not None:
                    push(heap, (-scores[t], l0, left, len(s)))
            if r2 >= 0:
                s = sym[left] + sym[r2]
                t = get(s)
                if t is not None:
                    push(heap, (-scores[t], left, r2, len(s)))

        byte_ids = self.byte_ids
        i = 0
        while i != -1:
            s = sym[i]
            t = get(s)
            if t is not None:
                out.append(t)
            else:  # a character with no token: its UTF-8 bytes as <0xXX> tokens
                for b in s.encode("utf-8"):
                    if byte_ids[b] is not None:
                        out.append(byte_ids[b])
            i = nxt[i]


# --------------------------------------------------------------------------- public API
def _eog_ids(g: GGUFFile, lookup, types: np.ndarray, tid) -> set[int]:
    """llama.cpp's end-of-generation set (text heuristics included); updates ``types`` in place."""
    eog: set[int] = set()
    for key, texts, is_eog in _FIM:
        i = tid(f"tokenizer.ggml.{key}_token_id", None)
        if i is None:
            for text in texts:
                i = lookup(text)
                if i is not None:
                    if types[i] != TT_CONTROL:
                        types[i] = TT_CONTROL
                    break
        if i is not None and is_eog:
            eog.add(i)
    for text in _EOG_TEXTS:
        i = lookup(text)
        if i is not None:
            eog.add(i)
            types[i] = TT_CONTROL
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always rendered
        i = lookup(text)
        if i is not None:
            types[i] = TT_USER_DEFINED
    texts = {lookup(t): t for t in ("<|return|>", "<|call|>", "<|calls|>", "<|flush|>", "<|end|>", "<|tool_response>", "</s>")}
    present = {t for i, t in texts.items() if i is not None and i in eog}
    end_id, s_id = lookup("<|end|>"), lookup("</s>")
    if "<|end|>" in present and ({"<|return|>", "<|call|>"} <= present or
                                 ({"<|flush|>"} <= present and present & {"<|call|>", "<|calls|>"})):
        eog.discard(end_id)
        types[end_id] = TT_USER_DEFINED
    if "<|tool_response>" in present and "</s>" in present:
        eog.discard(s_id)
        types[s_id] = TT_NORMAL
    return eog


def _tokens(g: GGUFFile) -> list[str]:
    tokens = g.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise TokenizerError(f"{g.path}: no tokenizer.ggml.tokens array")
    if "" in tokens:
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp does
    return tokens


class Tokenizer:
    """Encode/decode exactly as llama.cpp does for a GGUF's vocabulary.  Build with ``from_gguf``."""

    def __init__(self) -> None:  # use from_gguf
        self._pieces: dict[int, bytes] = {}

    @classmethod
    def from_gguf(cls, gguf: GGUFFile | str | os.PathLike, *, use_cache: bool = True) -> Tokenizer:
        g = gguf if isinstance(gguf, GGUFFile) else GGUFFile(gguf, index_cache=use_cache)
        try:
            return cls._build(g, use_cache)
        except GGUFError as e:
            raise TokenizerError(str(e)) from e
        finally:
            if g is not gguf:
                g.close()

    @classmethod
    def _build(cls, g: GGUFFile, use_cache: bool) -> Tokenizer:
        self = cls()
        self.name = g.path.name
        model = g.get("tokenizer.ggml.model")
        if not isinstance(model, str):
            raise TokenizerError(f"{g.path}: tokenizer.ggml.model should be a string, is {type(model).__name__}")
        self.model = model
        spm = model == "llama"
        if model == "gpt2":
            pre = g.get("tokenizer.ggml.pre") or "default"
            if pre not in _PRE:
                raise TokenizerError(
                    f"{g.path}: unsupported pre-tokenizer {pre!r} (supported: {', '.join(SUPPORTED_PRE)})"
                )
            self.pre = pre
            self._hf, self.from_cache = _load_gpt2(g, pre, use_cache)
            n = self._hf.get_vocab_size(with_added_tokens=False)
            self._text = self._hf.id_to_token
            lookup = self._hf.token_to_id
            self._spm = None
            add_bos_default = _PRE[pre][2]
        elif spm:
            self.pre = "spm"
            tokens = _tokens(g)
            n = len(tokens)
            scores = g.get("tokenizer.ggml.scores")
            if not isinstance(scores, np.ndarray) or len(scores) < n:
                scores = np.zeros(n, dtype=np.float32)
            unk = g.get("tokenizer.ggml.unknown_token_id", 0)
            self._spm = _SPM(tokens, np.asarray(scores[:n], dtype=np.float32),
                             unk if isinstance(unk, int) and 0 <= unk < n else None)
            self._hf = None
            self.from_cache = False
            self._text = tokens.__getitem__
            lookup = self._spm.vocab.get
            add_bos_default = True
        else:
            raise TokenizerError(f"{g.path}: unsupported tokenizer model {model!r} (supported: gpt2, llama)")

        self.vocab_size = n
        tt = g.get("tokenizer.ggml.token_type")
        types = (np.array(tt[:n], dtype=np.int32) if isinstance(tt, np.ndarray) and len(tt) >= n
                 else np.full(n, TT_NORMAL, dtype=np.int32))

        def tid(key: str, default: int | None) -> int | None:
            v = g.get(key, default)
            return int(v) if isinstance(v, (int, np.integer)) and 0 <= int(v) < n else default

        self.bos_id = tid("tokenizer.ggml.bos_token_id", 1 if spm else None)
        self.eos_id = tid("tokenizer.ggml.eos_token_id", 2 if spm else None)
        self.add_bos = bool(g.get("tokenizer.ggml.add_bos_token", add_bos_default))
        self.add_eos = bool(g.get("tokenizer.ggml.add_eos_token", False))
        # llama.cpp reads the flag for every model type: SPM encoding prepends a space to
        # each raw fragment, and detokenizing drops one leading space from the first token
        space_prefix = bool(g.get("tokenizer.ggml.add_space_prefix", spm))
        self.add_space_prefix = space_prefix if spm else False
        self._strip_first_space = space_prefix
        eog = _eog_ids(g, lookup, types, tid)
        for i in (self.eos_id, tid("tokenizer.ggml.eot_token_id", None), tid("tokenizer.ggml.eom_token_id", None)):
            if i is not None:
                eog.add(i)
        self.eos_ids = frozenset(eog)
        self._types = types
        special_ids = np.flatnonzero(np.isin(types, _SPECIAL_TYPES))
        text = self._text
        self._specials = _Specials([(i, text(i), t) for i, t in zip(special_ids.tolist(), types[special_ids].tolist())])
        return self

    # ----------------------------------------------------------------- encoding
    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True,
               add_eos: bool | None = None) -> list[int]:
        """Token ids for ``text``.  ``add_bos=None`` follows the GGUF's ``add_bos_token``;
        ``parse_special`` makes control tokens written in the text (``<|im_start|>``) single ids."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text is not valid Unicode: {e.reason} at index {e.start}") from None
        out: list[int] = []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            out.append(self.bos_id)
        for frag in self._specials.partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
            elif self._spm is not None:
                if self.add_space_prefix:
                    frag = " " + frag  # llama.cpp: every raw fragment follows start or a special token
                self._spm.encode(frag.replace(" ", SPACE), out)
            else:
                out.extend(self._hf.encode(frag, add_special_tokens=False).ids)
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    # ----------------------------------------------------------------- vocabulary
    def _check(self, token_id: int) -> int:
        i = int(token_id)
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
        return i

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored in the GGUF (e.g. 'Ġthe', '▁the', '<0x0A>', '<|im_end|>')."""
        return self._text(self._check(token_id))

    def token_to_id(self, text: str) -> int | None:
        """Id of the vocabulary entry ``text`` (exact, as stored), or None."""
        return self._spm.vocab.get(text) if self._spm is not None else self._hf.token_to_id(text)

    def token_type(self, token_id: int) -> int:
        return int(self._types[self._check(token_id)])

    def is_special(self, token_id: int) -> bool:
        """Control or unknown token: rendered only when asked (``decode(skip_special=True)`` drops it)."""
        return int(self._types[self._check(token_id)]) in (TT_CONTROL, TT_UNKNOWN)

    # ----------------------------------------------------------------- decoding
    def token_bytes(self, token_id: int) -> bytes:
        """What the token contributes to decoded text (llama.cpp ``token_to_piece``, special=True)."""
        i = self._check(token_id)
        p = self._pieces.get(i)
        if p is None:
            p = self._pieces[i] = self._piece(i)
        return p

    def _piece(self, i: int) -> bytes:
        t = int(self._types[i])
        text = self._text(i)
        if t in _SPECIAL_TYPES:
            return text.encode("utf-8")
        if t == TT_BYTE and len(text) == 6 and text.startswith("<0x"):
            return bytes([int(text[3:5], 16)])
        if t == TT_NORMAL:
            if self._spm is not None:
                return text.replace(SPACE, " ").encode("utf-8")
            dec = _byte_decoder()
            try:
                return bytes([dec[c] for c in text])
            except KeyError:  # not in the byte alphabet (llama.cpp prints [UNK_BYTE_..]); keep the text
                return text.encode("utf-8")
        return b""  # unused / undefined types render as nothing in llama.cpp

    def _render(self, token_id: int, skip_special: bool, first: bool) -> bytes:
        if skip_special and self.is_special(token_id):
            return b""
        p = self.token_bytes(token_id)
        if first and self._strip_first_space and p.startswith(b" "):
            p = p[1:]  # llama.cpp's detokenize drops the prefix space the encoder added
        return p

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 from partial byte tokens becomes U+FFFD)."""
        parts = [self._render(i, skip_special, k == 0) for k, i in enumerate(ids)]
        return b"".join(parts).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_id}, eos={self.eos_id})")


class StreamDecoder:
    """Incremental decoding: ``push(id)`` returns newly complete text, never half a UTF-8 character.

    ``"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def push(self, token_id: int) -> str:
        p = self._tok._render(token_id, self._skip, self._first)
        self._first = False
        return self._dec.decode(p)

    def flush(self) -> str:
        """Emit what is still buffered (an incomplete character becomes U+FFFD) and start over."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        self._first = True
        return out
