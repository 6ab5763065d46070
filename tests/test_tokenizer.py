"""engine.tokenizer: ids identical to llama.cpp's, exact (streaming) decode, special tokens."""

from __future__ import annotations

import json
import random
import time
from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.gguf_file import GGUFFile
from engine.tokenizer import SUPPORTED_PRE, StreamDecoder, Tokenizer, TokenizerError
from tests.test_gguf_file import model_path

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = ("smollm2-135m", "gemma3-270m")

# category of each fixture text (tests/tools/make_llamacpp_fixtures.py writes the texts)
CATEGORIES = {
    "Hello world": "plain English",
    "The quick brown fox jumps over the lazy dog.": "plain English",
    "It's a beautiful day, isn't it? I'd say we'll go.": "plain English",
    " leading space": "leading spaces",
    "   three leading spaces": "leading spaces",
    "trailing space ": "leading spaces",
    "a  b   c    d": "whitespace",
    "tab\tseparated\tvalues\t\tend": "whitespace",
    "line one\nline two\n\nline four\r\nwindows": "whitespace",
    "\n\n\nstarts with newlines": "whitespace",
    "mixed \t \n whitespace\t\n": "whitespace",
    "1234567890": "digits/dates",
    "On 2024-03-15 at 13:45, the price was $1,234.56 (up 7.5%).": "digits/dates",
    "3.14159 2.71828 1e-10 0x1F": "digits/dates",
    "def add(a, b):\n    return a + b\n": "code",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }": "code",
    '{"key": [1, 2, 3], "nested": {"ok": true}}': "code",
    '<div class="x">&amp;</div>': "code",
    "Café crème brûlée, naïve façade, Zürich, São Paulo.": "accented Latin",
    "Ça va? Él está aquí. Ångström.": "accented Latin",
    "日本語のテキストです。": "CJK",
    "中文分词测试：你好，世界！": "CJK",
    "한국어 문장입니다.": "CJK",
    "Привет, мир! Как дела?": "other scripts",
    "مرحبا بالعالم": "other scripts",
    "I love pizza 🍕🍕 and 🚀!": "emoji",
    "👨\u200d👩\u200d👧\u200d👦 family, 🏳️\u200d🌈 flag": "emoji",
    "!!!??? ... --- ___ ~~~": "punctuation",
    "": "empty",
}


def _category(text: str) -> str:
    if text in CATEGORIES:
        return CATEGORIES[text]
    return "special tokens" if "<" in text and ">" in text else "other"


@pytest.fixture(scope="module")
def smollm2(request) -> Tokenizer:
    return Tokenizer.from_gguf(model_path(request, "smollm2_path"))


@pytest.fixture(scope="module")
def gemma3(request) -> Tokenizer:
    return Tokenizer.from_gguf(model_path(request, "gemma3_path"))


TOKENIZER_FIXTURE = {"smollm2-135m": "smollm2", "gemma3-270m": "gemma3"}


@pytest.fixture(params=MODELS)
def tok_and_name(request) -> tuple[Tokenizer, str]:
    return request.getfixturevalue(TOKENIZER_FIXTURE[request.param]), request.param


def _fixture(name: str) -> dict:
    p = FIXTURES / f"llamacpp_tokens_{name}.json"
    if not p.exists():
        pytest.skip(f"{p} is missing: generate it with tests/tools/make_llamacpp_fixtures.py (needs llama-cpp-python)")
    return json.loads(p.read_text())


# --------------------------------------------------------------------------- llama.cpp fixtures
def test_ids_match_llamacpp_fixtures(tok_and_name):
    tok, name = tok_and_name
    fx = _fixture(name)
    per_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    mismatches = []
    for case in fx["cases"]:
        ours = tok.encode(case["text"], add_bos=False, parse_special=True)
        cat = _category(case["text"])
        per_cat[cat][1] += 1
        if ours == case["ids"]:
            per_cat[cat][0] += 1
        else:
            mismatches.append((case["text"], ours, case["ids"]))
    summary = ", ".join(f"{c} {ok}/{n}" for c, (ok, n) in sorted(per_cat.items()))
    print(f"\n{name}: agreement with llama.cpp per category: {summary}")
    assert not mismatches, f"{len(mismatches)} texts differ from llama.cpp: {mismatches[:3]}"


def test_fixture_special_and_bos_behaviour(tok_and_name):
    tok, name = tok_and_name
    fx = _fixture(name)
    ex = fx["special_false_example"]
    assert tok.encode(ex["text"], add_bos=False, parse_special=False) == ex["ids"]
    ex = fx["add_bos_example"]
    assert tok.add_bos == fx["gguf_add_bos_token"]
    # llama.cpp adds BOS only when the GGUF asks for it; encode() with the default does the same
    expected = ex["add_bos_true"] if fx["gguf_add_bos_token"] else ex["add_bos_false"]
    assert tok.encode(ex["text"]) == expected
    assert tok.encode(ex["text"], add_bos=False) == ex["add_bos_false"]
    assert tok.bos_id == fx["bos_id"] and tok.eos_id == fx["eos_id"]


def test_fixture_texts_round_trip(tok_and_name):
    tok, name = tok_and_name
    for case in _fixture(name)["cases"]:
        assert tok.decode(case["ids"]) == case["text"]


def test_greedy_fixture_prompts_and_texts(tok_and_name):
    """The greedy-generation fixtures: prompt ids (BOS per the GGUF) and llama.cpp's text of the generated ids."""
    tok, name = tok_and_name
    p = FIXTURES / f"llamacpp_greedy_{name}.json"
    if not p.exists():
        pytest.skip(f"{p} is missing: generate it with tests/tools/make_llamacpp_fixtures.py")
    for case in json.loads(p.read_text())["cases"]:
        assert tok.encode(case["prompt"]) == case["prompt_ids"], case["name"]
        assert tok.decode(case["greedy_ids"], skip_special=True) == case["greedy_text"], case["name"]
        assert "".join(_stream(tok, case["greedy_ids"], True)) == case["greedy_text"]


# --------------------------------------------------------------------------- hand-checked ids
def test_smollm2_hand_checked(smollm2: Tokenizer):
    t = smollm2
    assert (t.vocab_size, t.bos_id, t.eos_id, t.add_bos) == (49152, 1, 2, False)
    assert t.encode("Hello world") == [19556, 905]
    assert [t.token_text(i) for i in t.encode("Hello world")] == ["Hello", "Ġworld"]
    # smollm pre-tokenizer: every digit on its own
    assert [t.token_text(i) for i in t.encode(" 2024")] == ["Ġ", "2", "0", "2", "4"]
    # control tokens are single ids when parsed, plain text otherwise
    assert t.encode("<|im_start|>user\n") == [1, 4093, 198]
    assert 1 not in t.encode("<|im_start|>user\n", parse_special=False)
    # byte-level: an emoji is its four UTF-8 bytes spread over byte-alphabet tokens
    ids = t.encode("🙂")
    assert b"".join(t.token_bytes(i) for i in ids) == "🙂".encode()
    assert t.eos_ids == {0, 2, 4}  # <|endoftext|>, <|im_end|>, <reponame> (llama.cpp's FIM-repo heuristic)
    assert t.is_special(1) and not t.is_special(19556)


def test_gemma3_hand_checked(gemma3: Tokenizer):
    t = gemma3
    assert (t.vocab_size, t.bos_id, t.eos_id, t.add_bos) == (262144, 2, 1, True)
    assert t.encode("Hello world") == [2, 9259, 1902]
    assert [t.token_text(i) for i in t.encode("Hello world", add_bos=False)] == ["Hello", "▁world"]
    assert t.encode("<start_of_turn>user\n", add_bos=False) == [105, 2364, 107]
    # user-defined whitespace tokens are matched whole in the raw text
    assert [t.token_text(i) for i in t.encode("a  b", add_bos=False)] == ["a", "  ", "b"]
    assert [t.token_text(i) for i in t.encode("\n\n", add_bos=False)] == ["\n\n"]
    # no prefix space (add_space_prefix is false)
    assert t.token_text(t.encode("Hello", add_bos=False)[0]) == "Hello"
    # byte fallback: characters missing from the vocabulary become <0xXX> tokens of their UTF-8 bytes
    for ch in ("\U0010fffd", "𝔘"):
        ids = t.encode(ch, add_bos=False)
        assert [t.token_text(i) for i in ids] == [f"<0x{b:02X}>" for b in ch.encode()]
        assert t.decode(ids) == ch
    assert t.eos_ids == {1, 106, 212}  # <eos>, <end_of_turn>, </s> (llama.cpp's EOG text list)
    assert t.token_text(106) == "<end_of_turn>"


@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog. " * 20,
    "<i>a</i> </b> word " * 10,  # '</b>' etc. are user-defined tokens, cut out first
    "<x> </y> word " * 10,  # contains '>▁</', Gemma's one entry spanning a word boundary: no per-word split
    "naïve café 日本語 🙂 x" * 10,
])
def test_spm_word_cache_is_exact(gemma3: Tokenizer, text):
    """Per-word encoding with a cache (the SPM speed-up) gives the same ids as one pass over the text."""
    whole: list[int] = []
    for frag in gemma3._specials.partition(text, True):  # (user-defined tokens such as '</b>' are cut out first)
        if isinstance(frag, int):
            whole.append(frag)
        else:
            gemma3._spm._encode(frag.replace(" ", "\u2581"), whole)
    assert gemma3.encode(text, add_bos=False) == whole
    assert gemma3.encode(text, add_bos=False) == whole  # again, from the cache


def test_skip_special_decode(smollm2: Tokenizer, gemma3: Tokenizer):
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>")
    assert smollm2.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert smollm2.decode(ids, skip_special=True) == "user\nhi"
    ids = gemma3.encode("<start_of_turn>user\nhi  there<end_of_turn>")
    assert gemma3.decode(ids) == "<bos><start_of_turn>user\nhi  there<end_of_turn>"
    # user-defined tokens ("  ") are text, kept when skipping specials
    assert gemma3.decode(ids, skip_special=True) == "user\nhi  there"


def test_bad_input(smollm2: Tokenizer):
    with pytest.raises(TypeError):
        smollm2.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not valid Unicode"):
        smollm2.encode("a\ud800b")
    with pytest.raises(ValueError, match="out of range"):
        smollm2.decode([smollm2.vocab_size])
    assert smollm2.encode("") == []


# --------------------------------------------------------------------------- streaming
def _stream(tok: Tokenizer, ids: list[int], skip_special: bool = False) -> list[str]:
    sd = tok.stream_decoder(skip_special=skip_special)
    return [sd.push(i) for i in ids] + [sd.flush()]


@pytest.mark.parametrize("text", ["I love pizza 🍕🍕 and 🚀!", "日本語のテキストです。", "👨\u200d👩\u200d👧 ok", "naïve 𝔘\U0010fffd end"])
def test_stream_decode_multibyte(tok_and_name, text):
    tok, name = tok_and_name
    ids = tok.encode(text, add_bos=False)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == text == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # never half a character
    # characters really were split across tokens (byte-level BPE always, Gemma via byte fallback), and came out whole
    split_somewhere = any(len(tok.token_bytes(i)) and not _is_utf8(tok.token_bytes(i)) for i in ids)
    assert split_somewhere or (name == "gemma3-270m" and "𝔘" not in text)


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_stream_decoder_emits_character_when_complete(smollm2: Tokenizer):
    ids = smollm2.encode("🙂")
    assert len(ids) >= 2
    sd = StreamDecoder(smollm2)
    outs = [sd.push(i) for i in ids]
    assert outs[:-1] == [""] * (len(ids) - 1) and outs[-1] == "🙂"
    assert sd.flush() == ""


def test_stream_flush_of_truncated_character(gemma3: Tokenizer):
    ids = gemma3.encode("𝔘", add_bos=False)[:2]  # half of a 4-byte character
    pieces = _stream(gemma3, ids)
    assert "".join(pieces) == gemma3.decode(ids) == "\ufffd"


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_stream_equals_decode_random_ids(smollm2: Tokenizer, gemma3: Tokenizer, data):
    tok = data.draw(st.sampled_from([smollm2, gemma3]))
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    skip = data.draw(st.booleans())
    assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special=skip)


# --------------------------------------------------------------------------- llama.cpp directly (optional)
def _llama(path: Path):
    try:
        import llama_cpp
    except ImportError:
        pytest.skip("llama-cpp-python is not installed")
    except (OSError, RuntimeError) as e:  # installed without its library (e.g. LLAMA_CPP_LIB_PATH unset)
        pytest.skip(f"llama-cpp-python cannot load llama.cpp: {e}")
    return llama_cpp, llama_cpp.Llama(str(path), vocab_only=True, verbose=False)


def _random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = list("abcXYZ0189 \t\n\r.,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`") + list("éçñüößÅæœ日本語中文한국어Пمر") + [
        "🙂", "🍕", "\u200d", "\u00a0", "\u3000", "…", "’", "½"]
    words = [" the", "'s", "'ll", "  ", "\n\n", "\t", "<|im_start|>", "<|im_end|>", "<start_of_turn>",
             "<end_of_turn>", "<bos>", "</s>", "<unused5>", "<0x41>", "[multimodal]", "    ", "2024-01-02", "\r\n"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.4:
                parts.append(rng.choice(words))
            else:
                parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))))
        out.append("".join(parts))
    return out


@pytest.mark.llamacpp
@pytest.mark.parametrize("fixture_name", ["smollm2_path", "gemma3_path"])
def test_random_texts_match_llamacpp(request, fixture_name):
    path = model_path(request, fixture_name)
    llama_cpp, ref = _llama(path)
    tok = Tokenizer.from_gguf(path)
    vocab = llama_cpp.llama_model_get_vocab(ref.model)
    bad = []
    for text in _random_texts(11, 300):
        for special in (True, False):
            ours = tok.encode(text, add_bos=False, parse_special=special)
            theirs = ref.tokenize(text.encode(), add_bos=False, special=special)
            if ours != theirs:
                bad.append((text, special, ours, theirs))
        # decoding: llama.cpp's per-token pieces, concatenated
        ids = ref.tokenize(text.encode(), add_bos=False, special=True)
        pieces = b"".join(_piece(llama_cpp, vocab, i) for i in ids)
        assert tok.decode(ids) == pieces.decode("utf-8", errors="replace")
    assert not bad, f"{len(bad)} of 600 encodings differ, e.g. {bad[:2]}"
    eog = {i for i in range(tok.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert tok.eos_ids == eog


def _piece(llama_cpp, vocab, token_id: int) -> bytes:
    import ctypes

    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token_id, buf, len(buf), 0, True)
    assert n >= 0
    return buf.raw[:n]


# --------------------------------------------------------------------------- start-up time
def test_build_time(request, tmp_path, monkeypatch):
    times = {}
    for name in ("smollm2_path", "gemma3_path"):
        path = model_path(request, name)
        Tokenizer.from_gguf(path)  # warm page cache / tokenizer cache
        t = time.perf_counter()
        tok = Tokenizer.from_gguf(path)
        times[path.name] = time.perf_counter() - t
        assert tok.vocab_size > 0
    print("\ntokenizer build times:", {k: f"{v:.3f}s" for k, v in times.items()})
    assert all(v < 5.0 for v in times.values()), times  # sanity bound on a loaded 2-core box, not a benchmark


# --------------------------------------------------------------------------- synthetic vocabularies
def _write_gguf(path: Path, model: str, tokens: list[str], types: list[int], scores=None, merges=None, pre=None,
                extra=None) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for k, v in (extra or {}).items():
        w.add_key_value(k, v[0], v[1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_spm_merge_order_hand_checked(tmp_path):
    """Highest-scoring pair merges first; on equal scores the leftmost pair wins (llama.cpp's SPM)."""
    base = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["a", "b", "c", "ab", "bc", "cab", "▁", "▁a", "x", "xx"]
    tokens = base + words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    score = {"a": -1.0, "b": -1.0, "c": -1.0, "ab": -5.0, "bc": -2.0, "cab": -9.0, "▁": -1.0, "▁a": -3.0,
             "x": -1.0, "xx": -4.0}
    scores = [0.0] * len(base) + [score[w] for w in words]
    p = _write_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores,
                    extra={"tokenizer.ggml.add_space_prefix": (False, gguf.GGUFValueType.BOOL)})
    tok = Tokenizer.from_gguf(p)
    ids = {t: i for i, t in enumerate(tokens)}

    def enc(s):
        return [tok.token_text(i) for i in tok.encode(s, add_bos=False)]

    assert enc("abc") == ["a", "bc"]  # bc (-2) beats ab (-5); then a+bc is not in the vocabulary
    assert enc("ab") == ["ab"]
    assert enc("cab") == ["cab"]  # c+ab after ab
    assert enc("xxx") == ["xx", "x"]  # equal scores: leftmost pair first
    assert enc(" a") == ["▁a"]
    assert enc("q") == ["<0x71>"]  # byte fallback
    assert tok.encode("ab") == [ids["<s>"], ids["ab"]]  # SPM default: add BOS
    assert tok.decode(tok.encode(" a b", add_bos=False)) == " a b"


def test_spm_add_space_prefix(tmp_path):
    tokens = ["<unk>", "<s>", "</s>", "▁", "h", "i", "▁h", "▁hi", "hi"]
    types = [2, 3, 3, 1, 1, 1, 1, 1, 1]
    scores = [0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -2.0, -1.5, -3.0]
    p = _write_gguf(tmp_path / "spm2.gguf", "llama", tokens, types, scores,
                    extra={"tokenizer.ggml.add_space_prefix": (True, gguf.GGUFValueType.BOOL)})
    tok = Tokenizer.from_gguf(p)
    ids = tok.encode("hi</s>hi", add_bos=False)
    assert [tok.token_text(i) for i in ids] == ["▁hi", "</s>", "▁hi"]  # prefix after every special token
    assert tok.decode(ids) == "hi</s> hi"  # only the very first prefix space is removed
    assert "".join(_stream(tok, ids)) == tok.decode(ids)


def test_gpt2_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RQLLM_TOKENIZER_CACHE", str(tmp_path / "cache"))
    byte_chars = [chr(c) for c in range(0x21, 0x7F)]  # printable ASCII is its own byte-alphabet symbol
    tokens = ["<|endoftext|>"] + byte_chars + ["Ġ", "he", "hel", "hell", "hello", "Ġhello"]
    types = [3] + [1] * (len(tokens) - 1)
    merges = ["h e", "he l", "hel l", "hell o", "Ġ hello"]
    p = _write_gguf(tmp_path / "bpe.gguf", "gpt2", tokens, types, merges=merges, pre="gpt-2")
    t1 = Tokenizer.from_gguf(p)
    assert not t1.from_cache
    assert [t1.token_text(i) for i in t1.encode("hello hello<|endoftext|>")] == ["hello", "Ġhello", "<|endoftext|>"]
    t2 = Tokenizer.from_gguf(p)
    assert t2.from_cache and t2.encode("hello hello") == t1.encode("hello hello")
    # a corrupt cache entry is rebuilt
    for f in list(tmp_path.glob("bpe.gguf.tokenizer-*.json")) + list((tmp_path / "cache").glob("*.json")):
        f.write_text("{not json")
    t3 = Tokenizer.from_gguf(p)
    assert not t3.from_cache and t3.encode("hello") == t1.encode("hello")
    # a changed model file gets a new entry; the stale one is removed
    import os

    os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))
    assert not Tokenizer.from_gguf(p).from_cache
    assert len(list(tmp_path.glob("bpe.gguf.tokenizer-*.json"))) == 1


@pytest.mark.parametrize("pre", SUPPORTED_PRE)
def test_every_supported_pre_tokenizer_builds(tmp_path, monkeypatch, pre):
    monkeypatch.setenv("RQLLM_TOKENIZER_CACHE", str(tmp_path / "cache"))
    chars = [chr(c) for c in range(0x21, 0x7F)] + ["Ġ", "Ċ"]
    tokens = ["<|endoftext|>"] + chars + ["12", "34", "123"]
    merges = ["1 2", "3 4", "12 3"]
    p = _write_gguf(tmp_path / f"{pre}.gguf", "gpt2", tokens, [3] + [1] * (len(tokens) - 1), merges=merges, pre=pre)
    tok = Tokenizer.from_gguf(p, use_cache=False)
    got = [tok.token_text(i) for i in tok.encode("1234 x!\n", add_bos=False)]
    digits = {"llama3": ["123", "4"], "qwen2": ["1", "2", "3", "4"], "smollm": ["1", "2", "3", "4"], "gpt-2": ["12", "34"]}
    if pre in digits:  # \p{N}{1,3} groups / single digits / whole numbers, then the merges
        assert got[:len(digits[pre])] == digits[pre], got
    assert tok.decode(tok.encode("1234 x!\n")) == "1234 x!\n"


def test_unsupported_tokenizers(tmp_path):
    p = _write_gguf(tmp_path / "bert.gguf", "bert", ["[PAD]", "a"], [3, 1])
    with pytest.raises(TokenizerError, match="unsupported tokenizer model 'bert'"):
        Tokenizer.from_gguf(p)
    p = _write_gguf(tmp_path / "pre.gguf", "gpt2", ["a", "b", "ab"], [1, 1, 1], merges=["a b"], pre="no-such-pre")
    with pytest.raises(TokenizerError, match="unsupported pre-tokenizer 'no-such-pre'"):
        Tokenizer.from_gguf(p)


def test_metadata_not_mutated(request):
    """Building the tokenizer must not change the GGUF's token_type array (llama.cpp-style overrides are local)."""
    with GGUFFile(model_path(request, "gemma3_path")) as g:
        before = np.array(g.metadata["tokenizer.ggml.token_type"])
        Tokenizer.from_gguf(g)
        assert np.array_equal(g.metadata["tokenizer.ggml.token_type"], before)


def test_tokenizer_model_of_the_wrong_type_is_named(tmp_path):
    """A fuzz finding: tokenizer.ggml.model stored as an array crashed with numpy's ambiguity error."""
    w = gguf.GGUFWriter(tmp_path / "bad.gguf", "llama")
    w.add_key_value("tokenizer.ggml.model", ["gpt2"], gguf.GGUFValueType.ARRAY)
    w.add_token_list(["a", "b"])
    w.add_token_types([1, 1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model should be a string"):
        Tokenizer.from_gguf(tmp_path / "bad.gguf")
