"""Real chat templates of the model families users bring, rendered through rqllm's sandboxed path.

The templates under tests/fixtures/chat_templates/ are verbatim copies (data) of the ones llama.cpp keeps in
models/templates/ (taken from each model's HF tokenizer_config.json).  Each is written into a tiny GGUF as
``tokenizer.chat_template`` with the family's BOS/EOS tokens, and rendered with
``ChatFormat.from_gguf(gguf, Tokenizer.from_gguf(gguf))`` -- what ``Engine.chat`` does.  The expected
prompts are written out by hand from each family's documented prompt format.
"""
from __future__ import annotations

import datetime as _dt
from pathlib import Path

import gguf
import pytest

import engine.chat
from engine.chat import ChatError, ChatFormat, ChatTemplateError
from engine.gguf_file import GGUFFile
from engine.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]

# family -> (BOS text, EOS text, the GGUF's add_bos_token, control tokens the format uses)
FAMILIES = {
    "llama-3.1": ("<|begin_of_text|>", "<|eot_id|>", True, ["<|start_header_id|>", "<|end_header_id|>"]),
    "llama-3.2": ("<|begin_of_text|>", "<|eot_id|>", True, ["<|start_header_id|>", "<|end_header_id|>"]),
    "qwen3": ("<|endoftext|>", "<|im_end|>", False, ["<|im_start|>", "<think>", "</think>"]),
    "gemma-2": ("<bos>", "<eos>", True, ["<start_of_turn>", "<end_of_turn>"]),
    "phi-3.5-mini": ("<s>", "<|endoftext|>", False, ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]),
    "mistral-nemo": ("<s>", "</s>", True, ["[INST]", "[/INST]"]),
}


def template(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")


def _write_family_gguf(path: Path, family: str) -> Path:
    """An SPM vocabulary (<unk>, BOS, EOS, the format's control tokens, byte fallback) plus the real template."""
    bos, eos, add_bos, controls = FAMILIES[family]
    tokens = ["<unk>", bos, eos, *controls] + [f"<0x{b:02X}>" for b in range(256)] + ["▁"]
    types = [2, 3, 3] + [3] * len(controls) + [6] * 256 + [1]
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([0.0] * len(tokens))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(template(family))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def family_chat(tmp_path_factory):
    made: dict[str, tuple[ChatFormat, Tokenizer]] = {}

    def get(family: str) -> ChatFormat:
        if family not in made:
            path = _write_family_gguf(tmp_path_factory.mktemp(family) / f"{family}.gguf", family)
            with GGUFFile(path) as g:
                tok = Tokenizer.from_gguf(g, use_cache=False)
                chat = ChatFormat.from_gguf(g, tok)
            assert chat.name.endswith("tokenizer.chat_template")  # the GGUF's template, not a built-in
            assert (chat.bos_token, chat.eos_token) == FAMILIES[family][:2]
            made[family] = chat
        return made[family]

    return get


def test_fixtures_are_the_templates():
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(FAMILIES)


# --------------------------------------------------------------------------- Llama 3.1 / 3.2
def test_llama31_conversation(family_chat):
    assert family_chat("llama-3.1").render(CONVERSATION) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\n"
        "Be brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama31_without_system_and_generation_prompt(family_chat):
    # the system header is always written (with the dates); content is trimmed
    assert family_chat("llama-3.1").render([{"role": "user", "content": "  hi\n"}], add_generation_prompt=False) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\n"
        "<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    )


def test_llama31_encode_single_bos(family_chat):
    chat = family_chat("llama-3.1")
    ids = chat.encode([{"role": "user", "content": "hi"}])
    assert ids[:2] == [1, 3]  # <|begin_of_text|><|start_header_id|>: the template writes BOS, encode adds none
    assert ids.count(1) == 1
    assert ids.count(2) == 2  # <|eot_id|> after the system block and the user turn
    assert ids.count(3) == ids.count(4) == 3  # system, user and assistant headers, each one control token
    text = chat.render([{"role": "user", "content": "hi"}])
    assert ids == chat.tokenizer.encode(text, add_bos=False)


def test_llama31_tools_blocks_render_in_the_sandbox():
    """rqllm passes no tools (roles are system/user/assistant), but the real template's tools branches must
    still run in the sandbox: ``tojson(indent=4)``, ``reject('equalto', ...)``, ``join``, ``raise_exception``.
    The variables a caller would pass are set in front of the real template."""
    prefix = (
        "{%- set builtin_tools = ['brave_search', 'code_interpreter', 'wolfram_alpha'] %}"
        "{%- set custom_tools = [{'name': 'get_weather', 'parameters': {'city': 'string'}}] %}"
    )
    chat = ChatFormat(prefix + template("llama-3.1"), bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                      name="llama-3.1+tools")
    assert chat.render([{"role": "system", "content": "S"}, {"role": "user", "content": "Weather in Paris?"}]) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\n"
        "Environment: ipython\n"
        "Tools: brave_search, wolfram_alpha\n\n"
        "Cutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\n"
        "S<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
        "Given the following functions, please respond with a JSON for a function call "
        "with its proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
        "Do not use variables.\n\n"
        '{\n    "name": "get_weather",\n    "parameters": {\n        "city": "string"\n    }\n}'
        "\n\n"
        "Weather in Paris?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # tools in the user message with no user message left: the template's own raise_exception
    with pytest.raises(ChatTemplateError, match=r"^chat template raised: Cannot put tools in the first user message"):
        chat.render([{"role": "system", "content": "S"}])


class _FrozenDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2025, 3, 7, 9, 30, tzinfo=tz)


def test_llama32_today_date_from_strftime_now(family_chat, monkeypatch):
    monkeypatch.setattr(engine.chat, "datetime", _FrozenDatetime)
    assert family_chat("llama-3.2").render(CONVERSATION) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\n"
        "Today Date: 07 Mar 2025\n\n"
        "Be brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama32_today_date_is_today(family_chat):
    before = _dt.datetime.now().strftime("%d %b %Y")
    text = family_chat("llama-3.2").render([{"role": "user", "content": "hi"}])
    after = _dt.datetime.now().strftime("%d %b %Y")
    assert any(f"Today Date: {d}\n\n<|eot_id|>" in text for d in (before, after)), text


# --------------------------------------------------------------------------- Qwen3
def test_qwen3_conversation(family_chat):
    # ChatML, no BOS; an assistant turn before the last user query shows no think block
    assert family_chat("qwen3").render(CONVERSATION) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_history_reasoning_is_dropped(family_chat):
    msgs = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nTwo plus two.\n</think>\n\n4."},
        {"role": "user", "content": "And 3+3?"},
    ]
    assert family_chat("qwen3").render(msgs) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_final_assistant_turn_gets_a_think_block(family_chat):
    chat = family_chat("qwen3")
    # the answer to the last query always carries a think block: empty when it had no reasoning
    assert chat.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
                       add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n"
    )
    assert chat.render([{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"}],
                       add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nGreet back.\n</think>\n\nHello!<|im_end|>\n"
    )


def test_qwen3_tool_response_user_turn_is_not_the_last_query(family_chat):
    # a user turn that is a wrapped tool response (str.startswith/endswith in the template) does not
    # count as the last query, so the assistant turn before it keeps its reasoning
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "<think>\nAsk the tool.\n</think>\n\nChecking."},
        {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"},
    ]
    assert family_chat("qwen3").render(msgs) == (
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAsk the tool.\n</think>\n\nChecking.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


# --------------------------------------------------------------------------- Gemma 2
def test_gemma2_conversation(family_chat):
    assert family_chat("gemma-2").render(CONVERSATION[1:]) == (
        "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4.<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_gemma2_system_role_is_a_clear_error(family_chat):
    # Gemma 2's own template refuses a system message (it does not fold it): a ChatTemplateError
    # (a ChatError/ValueError, which Engine.render_chat turns into an EngineError), not a crash
    chat = family_chat("gemma-2")
    with pytest.raises(ChatTemplateError, match=r"^chat template raised: System role not supported$") as info:
        chat.render(CONVERSATION)
    assert isinstance(info.value, ChatError) and isinstance(info.value, ValueError)
    with pytest.raises(ChatTemplateError, match=r"^chat template raised: Conversation roles must alternate"):
        chat.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# --------------------------------------------------------------------------- Phi-3.5-mini
def test_phi35_conversation(family_chat):
    assert family_chat("phi-3.5-mini").render(CONVERSATION) == (
        "<|system|>\nBe brief.<|end|>\n"
        "<|user|>\nWhat is 2+2?<|end|>\n"
        "<|assistant|>\n4.<|end|>\n"
        "<|user|>\nAnd 3+3?<|end|>\n"
        "<|assistant|>\n"
    )


def test_phi35_without_generation_prompt_ends_with_eos(family_chat):
    # an empty system message is left out; without a generation prompt the text ends with EOS
    assert family_chat("phi-3.5-mini").render(
        [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}], add_generation_prompt=False
    ) == "<|user|>\nhi<|end|>\n<|endoftext|>"


# --------------------------------------------------------------------------- Mistral (Mistral-Nemo-Instruct-2407)
def test_mistral_nemo_conversation(family_chat):
    # [INST] format, no spaces; the system prompt goes in front of the LAST user message;
    # assistant turns end with EOS; there is no generation-prompt suffix
    chat = family_chat("mistral-nemo")
    expected = "<s>[INST]What is 2+2?[/INST]4.</s>[INST]Be brief.\n\nAnd 3+3?[/INST]"
    assert chat.render(CONVERSATION) == expected
    assert chat.render(CONVERSATION, add_generation_prompt=False) == expected
    assert chat.render([{"role": "user", "content": "hi"}]) == "<s>[INST]hi[/INST]"


def test_mistral_nemo_alternation_error(family_chat):
    with pytest.raises(ChatTemplateError, match=r"^chat template raised: After the optional system message, "
                                                r"conversation roles must alternate"):
        family_chat("mistral-nemo").render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
