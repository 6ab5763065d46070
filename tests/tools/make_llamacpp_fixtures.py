"""Write the llama.cpp ground-truth fixtures the tests compare against.

    python tests/tools/make_llamacpp_fixtures.py [--models smollm2-135m gemma3-270m] [--out tests/fixtures]

For each model it writes (everything computed by llama.cpp through llama-cpp-python, never by rqllm):

* llamacpp_tokens_<model>.json  token ids from llama.cpp's tokenizer for ~30 texts
  (Llama.tokenize(text.encode(), add_bos=False, special=True)), plus the BOS behaviour;
* llamacpp_greedy_<model>.json  for 8 raw prompts: prompt ids (BOS as the GGUF's
  tokenizer.ggml.add_bos_token says) and the first 32 greedy ids (temperature 0, top_k 1,
  repeat_penalty 1.0, n_ctx 512, 2 threads; generation stops early at EOS);
* llamacpp_logits_<model>.json  for one 64-token text (logits_all): the top-1 id, its logit and
  the margin to the second best at every position, the top-5 ids and logits at a few positions;
  under "long", the same top-1 data at positions 448.. of a ~700-token text (past gemma3's
  512-token sliding window).

Greedy cases also record llama.cpp's margin (best minus second-best logit) at every step: a step
with a tiny margin is a coin toss for any other implementation (llama.cpp itself flips such steps
between batched and token-by-token evaluation).  Models load with use_extra_bufts=False.

Run it again after changing the prompts or upgrading llama-cpp-python, and commit the JSON.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MODEL_PATHS = {
    "smollm2-135m": Path.home() / ".cache/rqllm/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": Path.home() / ".cache/rqllm/models/gemma3-270m/gemma-3-270m-q4_k_m.gguf",
}
N_CTX = 512
N_THREADS = 2
N_GREEDY = 32
N_LOGIT_TOKENS = 64
TOP5_POSITIONS = (0, 1, 2, 7, 15, 31, 47, 63)

CHAT = {
    "smollm2-135m": ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                     "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"),
    "gemma3-270m": ("<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
                    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"),
}


def tokenizer_texts(model: str) -> list[str]:
    special_short, _ = CHAT[model]
    return [
        # plain English
        "Hello world",
        "The quick brown fox jumps over the lazy dog.",
        "It's a beautiful day, isn't it? I'd say we'll go.",
        # leading / trailing spaces
        " leading space",
        "   three leading spaces",
        "trailing space ",
        # whitespace runs, tabs, newlines
        "a  b   c    d",
        "tab\tseparated\tvalues\t\tend",
        "line one\nline two\n\nline four\r\nwindows",
        "\n\n\nstarts with newlines",
        "mixed \t \n whitespace\t\n",
        # digits, dates, numbers
        "1234567890",
        "On 2024-03-15 at 13:45, the price was $1,234.56 (up 7.5%).",
        "3.14159 2.71828 1e-10 0x1F",
        # code
        "def add(a, b):\n    return a + b\n",
        "for (int i = 0; i < n; ++i) { sum += x[i]; }",
        '{"key": [1, 2, 3], "nested": {"ok": true}}',
        "<div class=\"x\">&amp;</div>",
        # accented Latin
        "Café crème brûlée, naïve façade, Zürich, São Paulo.",
        "Ça va? Él está aquí. Ångström.",
        # other scripts
        "日本語のテキストです。",
        "中文分词测试：你好，世界！",
        "한국어 문장입니다.",
        "Привет, мир! Как дела?",
        "مرحبا بالعالم",
        # emoji
        "I love pizza 🍕🍕 and 🚀!",
        "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag",
        # special tokens in text
        special_short,
        "text before " + special_short.split("\n")[0] + " text after",
        # odd bytes / punctuation
        "!!!??? ... --- ___ ~~~",
        "",
    ]


def greedy_prompts(model: str) -> list[tuple[str, str]]:
    _, chat = CHAT[model]
    return [
        ("story", "Once upon a time, in a small village at the edge of a forest,"),
        ("factual", "Question: What is the tallest mountain in the world?\nAnswer:"),
        ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
        ("list", "Here is a shopping list:\n1. Apples\n2."),
        ("chat", chat),
        ("french", "La capitale de la France est"),
        ("arithmetic", "12 + 35 = 47\n81 - 19 = 62\n7 * 8 ="),
        ("paragraph",
         "The history of computing is longer than the history of computing hardware and modern "
         "computing technology and includes the history of methods intended for pen and paper or "
         "for chalk and slate, with or without the aid of tables. Digital computing is intimately "
         "tied to the representation of numbers. But long before abstractions like the number "
         "arose, there were mathematical concepts to serve the purposes of civilization. These "
         "concepts are implicit in concrete practices such as"),
    ]


LOGITS_TEXT = (
    "The river wound slowly through the valley, past old stone bridges and quiet farms. "
    "In the spring, the water rose with melting snow from the mountains, and the farmers "
    "watched the banks carefully. Children played on the shore in summer, skipping flat "
    "stones across the surface and counting how many times each one bounced before it sank. "
    "In autumn the leaves turned red and gold."
)

# Longer than gemma3's 512-token sliding window, so local layers drop their oldest keys.
LONG_TEXT = " ".join([
    "Maria kept a notebook of everything she noticed on her walks to the harbour.",
    "On Monday she counted eleven fishing boats, three of them painted blue, and a tanker",
    "waiting beyond the breakwater with its anchor chain rusting in the green water.",
    "The fish market opened at six; by seven the gulls had learned which stall threw away",
    "the heads, and they lined up on the roof like customers waiting for a bakery to open.",
    "Her grandfather had worked on the ferry for thirty years. He said the tide tables were",
    "the only honest book ever printed, because the sea checks every number twice a day.",
    "On Tuesday it rained. The cobbles shone, the awnings sagged with water, and a man in",
    "a yellow coat tried to sell umbrellas to people who already carried two.",
    "She wrote down the prices: coffee 2.40, a loaf of rye 3.10, a kilo of mussels 6.75.",
    "Wednesday brought wind from the north. Laundry snapped on the balconies, a child lost",
    "a red kite over the customs house, and the harbour master raised the small-craft flag.",
    "In the library she read about the lighthouse, built in 1871 from granite carried by",
    "rail from a quarry two hundred kilometres inland. Its lamp burned colza oil, then",
    "paraffin, then electricity; the keeper's cottage became a museum in 1964.",
    "Thursday was market day in the square. Farmers sold cheese wrapped in leaves, honey in",
    "jars with handwritten labels, onions braided into ropes, and apples of six kinds whose",
    "names sounded like characters from an old novel: Reinette, Calville, Api, Belle de Boskoop.",
    "An accordion player stood by the fountain and played the same waltz all morning; by noon",
    "the pigeons seemed to walk in three-four time.",
    "On Friday a research vessel came in, white and orange, bristling with antennas. Students",
    "in boots unloaded crates of sediment cores and argued about whether the mud from the",
    "deepest station smelled of sulphur or of old pennies. One of them showed Maria a sample",
    "under a hand lens: tiny shells, each smaller than a grain of salt, coiled like staircases.",
    "Saturday was quiet. The cafes put out chairs, the sun warmed the stones, and old men",
    "played cards in the shade, slapping each trick down as if it settled an ancient dispute.",
    "Maria drew a map of the harbour from memory and then corrected it against the real thing,",
    "finding that she had placed the fuel dock on the wrong side and forgotten the slipway entirely.",
    "On Sunday the bells rang for a long time. Families walked along the mole in their good",
    "clothes, a brass band tuned up outside the town hall, and the fishing boats stayed tied",
    "up, rocking gently, their nets piled on deck like sleeping animals.",
    "At the end of the week she read the notebook from the beginning and was surprised by how",
    "much she had already forgotten: the colour of the tanker, the price of mussels, the name",
    "of the apple that tasted of pears. Writing things down, she decided, is a way of lending",
    "your memory to paper, and paper is a patient creditor.",
    "The next week she began a second notebook, this time for sounds: the clank of halyards",
    "against aluminium masts, the diesel cough of the first boat leaving before dawn, the hiss",
    "of the espresso machine in the cafe by the steps, the tide sucking at the weed on the pilings.",
])
N_LONG_CTX = 1024
LONG_FROM = 448  # long-text positions recorded: LONG_FROM .. end (the window edge is at 512)


def disable_extra_buffer_types(llama_cpp) -> None:
    """Load models with use_extra_bufts=False: plain ggml-cpu matmuls (no AMX, no repacking).

    The same kernels on every x86 machine, so fixtures do not depend on the CPU's extras; and on
    this machine (Xeon with AMX) a llama-cpp-python 0.3.36 built with AMX segfaults in
    ggml_backend_amx_mul_mat on the first decode.  Llama() takes no such argument, so wrap the
    default-params function it calls.
    """
    lowlevel = llama_cpp.llama_cpp
    if getattr(lowlevel.llama_model_default_params, "_rqllm_no_extra_bufts", False):
        return
    original = lowlevel.llama_model_default_params

    def params():
        p = original()
        p.use_extra_bufts = False
        return p

    params._rqllm_no_extra_bufts = True
    lowlevel.llama_model_default_params = params


def gguf_add_bos(llm) -> bool:
    value = llm.metadata.get("tokenizer.ggml.add_bos_token", "false")
    return str(value).lower() == "true"


def to_json(obj, level: int = 0) -> str:
    """JSON with one key per line but lists of numbers kept on one line (readable diffs)."""
    pad, inner = " " * level, " " * (level + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(k)}: {to_json(v, level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(inner + to_json(v, level + 1) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


def write(path: Path, data: dict) -> None:
    path.write_text(to_json(data) + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def common_header(model: str, path: Path, llama_cpp) -> dict:
    return {
        "model": model,
        "file": path.name,
        "file_size": path.stat().st_size,
        "generator": "tests/tools/make_llamacpp_fixtures.py",
        "llama_cpp_python_version": llama_cpp.__version__,
        "machine": platform.machine(),
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "model_params": {"use_extra_bufts": False},
    }


def make_tokens(model: str, path: Path, llama_cpp) -> dict:
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    add_bos = gguf_add_bos(llm)
    cases = []
    for text in tokenizer_texts(model):
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        cases.append({"text": text, "ids": ids})
    # The special-token text without special parsing, for contrast (markers split as plain text).
    chat_short, _ = CHAT[model]
    plain = llm.tokenize(chat_short.encode("utf-8"), add_bos=False, special=False)
    sample = "Hello world"
    return {
        **common_header(model, path, llama_cpp),
        "call": "Llama.tokenize(text.encode(), add_bos=False, special=True)",
        "bos_id": llm.token_bos(),
        "eos_id": llm.token_eos(),
        "gguf_add_bos_token": add_bos,
        "add_bos_example": {
            "text": sample,
            "add_bos_true": llm.tokenize(sample.encode(), add_bos=True, special=True),
            "add_bos_false": llm.tokenize(sample.encode(), add_bos=False, special=True),
        },
        "special_false_example": {"text": chat_short, "ids": plain},
        "cases": cases,
    }


def make_greedy(model: str, path: Path, llama_cpp) -> dict:
    # logits_all keeps each step's logits, to record how decisive each greedy choice was.
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_threads=N_THREADS,
                          n_threads_batch=N_THREADS, logits_all=True, seed=0, verbose=False)
    add_bos = gguf_add_bos(llm)
    eos = llm.token_eos()
    cases = []
    for name, prompt in greedy_prompts(model):
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=add_bos, special=True)
        out: list[int] = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                reset=True):
            out.append(int(tok))
            if tok == eos or len(out) == N_GREEDY:
                break
        text = llm.detokenize(out).decode("utf-8", errors="replace")
        # step i's logits are at row len(ids) - 1 + i; margin = best minus second-best logit
        steps = np.array(llm.scores[len(ids) - 1: len(ids) - 1 + len(out)], dtype=np.float32)
        assert list(steps.argmax(axis=-1)) == out, "scores do not line up with the generated ids"
        top2 = np.sort(steps, axis=-1)[:, -2:]
        margins = [round(float(m), 4) for m in top2[:, 1] - top2[:, 0]]
        cases.append({"name": name, "prompt": prompt, "prompt_ids": ids, "greedy_ids": out,
                      "margins": margins, "greedy_text": text,
                      "stopped_at_eos": bool(out and out[-1] == eos)})
        print(f"  {model} {name}: {len(ids)} prompt ids -> {text[:60]!r}")
    return {
        **common_header(model, path, llama_cpp),
        "settings": {"n_ctx": N_CTX, "n_threads": N_THREADS, "temperature": 0.0, "top_k": 1,
                     "repeat_penalty": 1.0, "max_tokens": N_GREEDY, "stop": "eos", "logits_all": True},
        "margins": "per generated token: llama.cpp's best minus second-best logit at that step",
        "add_bos": add_bos,
        "eos_id": eos,
        "cases": cases,
    }


def make_logits(model: str, path: Path, llama_cpp) -> dict:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_threads=N_THREADS,
                          n_threads_batch=N_THREADS, logits_all=True, seed=0, verbose=False)
    add_bos = gguf_add_bos(llm)
    ids = llm.tokenize(LOGITS_TEXT.encode("utf-8"), add_bos=add_bos, special=True)[:N_LOGIT_TOKENS]
    assert len(ids) == N_LOGIT_TOKENS, len(ids)
    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
    top1 = logits.argmax(axis=-1)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    top5 = {}
    for p in TOP5_POSITIONS:
        order = np.argsort(-logits[p], kind="stable")[:5]
        top5[str(p)] = {"ids": [int(i) for i in order], "logits": [float(logits[p, i]) for i in order]}
    return {
        **common_header(model, path, llama_cpp),
        "settings": {"n_ctx": N_CTX, "n_threads": N_THREADS, "logits_all": True},
        "text": LOGITS_TEXT,
        "add_bos": add_bos,
        "ids": ids,
        "top1_ids": [int(i) for i in top1],
        "top1_logits": [float(logits[i, t]) for i, t in enumerate(top1)],
        "margins": [round(float(m), 4) for m in top2[:, 1] - top2[:, 0]],
        "top5": top5,
        "long": make_long(path, llama_cpp, add_bos),
    }


def make_long(path: Path, llama_cpp, add_bos: bool) -> dict:
    """Top-1 ids and logits at the positions around and past gemma3's sliding window edge."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_LONG_CTX, n_threads=N_THREADS,
                          n_threads_batch=N_THREADS, logits_all=True, seed=0, verbose=False)
    ids = llm.tokenize(LONG_TEXT.encode("utf-8"), add_bos=add_bos, special=True)
    assert 560 <= len(ids) <= N_LONG_CTX, len(ids)
    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[LONG_FROM: len(ids)], dtype=np.float32)
    top1 = logits.argmax(axis=-1)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return {
        "settings": {"n_ctx": N_LONG_CTX, "n_threads": N_THREADS, "logits_all": True},
        "text": LONG_TEXT,
        "ids": ids,
        "from_position": LONG_FROM,
        "top1_ids": [int(i) for i in top1],
        "top1_logits": [round(float(logits[i, t]), 4) for i, t in enumerate(top1)],
        "margins": [round(float(m), 4) for m in top2[:, 1] - top2[:, 0]],
    }


def model_path(model: str) -> Path:
    """engine.registry.resolve(model) (pulls a missing model) when available, else the usual path."""
    sys.path.insert(0, str(ROOT))
    try:
        from engine.registry import resolve
    except ImportError:
        return MODEL_PATHS[model]
    return resolve(model)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODEL_PATHS))
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures")
    ap.add_argument("--only", choices=("tokens", "greedy", "logits"), nargs="+",
                    default=("tokens", "greedy", "logits"))
    args = ap.parse_args(argv)
    import llama_cpp

    disable_extra_buffer_types(llama_cpp)
    args.out.mkdir(parents=True, exist_ok=True)
    makers = {"tokens": make_tokens, "greedy": make_greedy, "logits": make_logits}
    for model in args.models:
        path = model_path(model)
        for kind in args.only:
            write(args.out / f"llamacpp_{kind}_{model}.json", makers[kind](model, path, llama_cpp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
