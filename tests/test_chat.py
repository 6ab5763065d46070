"""engine.chat: GGUF chat templates (SmolLM2), the built-in Gemma format, validation and the sandbox."""

from __future__ import annotations

import pytest

from engine.chat import CHATML_TEMPLATE, ChatError, ChatFormat, ChatTemplateError
from engine.gguf_file import GGUFFile
from engine.tokenizer import Tokenizer
from tests.test_gguf_file import model_path

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def smollm2(request):
    g = GGUFFile(model_path(request, "smollm2_path"))
    tok = Tokenizer.from_gguf(g)
    yield ChatFormat.from_gguf(g, tok), tok
    g.close()


@pytest.fixture(scope="module")
def gemma3(request):
    g = GGUFFile(model_path(request, "gemma3_path"))
    tok = Tokenizer.from_gguf(g)
    yield ChatFormat.from_gguf(g, tok), tok
    g.close()


# --------------------------------------------------------------------------- SmolLM2 (template from the GGUF)
def test_smollm2_uses_gguf_template(smollm2):
    chat, _ = smollm2
    assert chat.name.endswith("tokenizer.chat_template")
    assert chat.render([{"role": "user", "content": "hi"}]) == (
        SMOL_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == (
        SMOL_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_smollm2_conversation(smollm2):
    chat, _ = smollm2
    assert chat.render(CONVERSATION) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_encode(smollm2):
    chat, tok = smollm2
    ids = chat.encode([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(1) == 3  # three <|im_start|>; SmolLM2 adds no BOS
    assert ids == tok.encode(chat.render([{"role": "user", "content": "hi"}]), add_bos=False)


# --------------------------------------------------------------------------- Gemma 3 (built-in format)
def test_gemma_builtin(gemma3):
    chat, _ = gemma3
    assert chat.name == "gemma (built-in)"
    assert chat.render([{"role": "user", "content": "hi"}]) == (
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    )
    assert chat.render(CONVERSATION) == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4.<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert chat.render([{"role": "user", "content": "  padded \n"}], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\npadded<end_of_turn>\n"
    )


def test_gemma_encode_single_bos(gemma3):
    chat, tok = gemma3
    ids = chat.encode([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    assert ids[:4] == [2, 105, 2364, 107]  # <bos><start_of_turn>user\n
    assert ids.count(2) == 1
    assert ids[-3:] == [105, 4368, 107]  # <start_of_turn>model\n
    assert tok.decode(ids) == "<bos><start_of_turn>user\nS\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    # the rendered text carries the BOS: tokenizing it with add_bos=False gives the same ids
    text = chat.render([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    assert tok.encode(text, add_bos=False) == ids


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "messages,pattern",
    [
        ([{"role": "tool", "content": "x"}], r"message 0: unknown role 'tool'"),
        ([{"role": "user", "content": "ok"}, {"role": "bot", "content": "x"}], r"message 1: unknown role 'bot'"),
        ([{"role": "user", "content": 5}], r"content must be a string, got int"),
        ([{"role": "user"}], r"content"),
        ([{"content": "x"}], r"role"),
        ([], r"messages is empty"),
        ("hello", r"must be a list"),
        (["hello"], r"expected a dict"),
    ],
)
def test_invalid_messages(smollm2, gemma3, messages, pattern):
    for chat, _ in (smollm2, gemma3):
        with pytest.raises(ChatError, match=pattern):
            chat.render(messages)


def test_extra_message_keys_ignored(smollm2):
    chat, _ = smollm2
    a = chat.render([{"role": "user", "content": "hi", "name": "bob"}])
    assert a == chat.render([{"role": "user", "content": "hi"}])


# --------------------------------------------------------------------------- sandbox and template errors
@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ raise_exception.__globals__ }}",
        "{% if raise_exception.__globals__ %}leak{% endif %}",
        "{% for k in cycler.__dict__ %}{{ k }}{% endfor %}",
        "{% set _ = messages.append({'role': 'x'}) %}{{ messages }}",
        "{{ messages[0].update({'role': 'x'}) }}",
    ],
)
def test_sandbox_refuses_python_internals(template):
    chat = ChatFormat(template, name="evil")
    with pytest.raises(ChatTemplateError, match=r"'evil' was refused by the sandbox: .*unsafe"):
        chat.render([{"role": "user", "content": "x"}])


def test_raise_exception_and_broken_templates():
    chat = ChatFormat("{% if messages[0].role != 'system' %}{{ raise_exception('need a system prompt') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="chat template raised: need a system prompt"):
        chat.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatFormat("{% for m in messages %}", name="broken")
    with pytest.raises(ChatTemplateError, match="failed"):
        ChatFormat("{{ messages[5].content }}").render([{"role": "user", "content": "x"}])


def test_template_globals_and_filters():
    chat = ChatFormat("{{ bos_token }}{{ messages | tojson }}{{ eos_token }}{% if add_generation_prompt %}!{% endif %}",
                      bos_token="<s>", eos_token="</s>")
    assert chat.render([{"role": "user", "content": "é"}]) == '<s>[{"role": "user", "content": "é"}]</s>!'
    assert len(ChatFormat("{{ strftime_now('%Y') }}").render([{"role": "user", "content": "x"}])) == 4
    # undefined variables stay harmless (templates test optional ones like `tools`)
    assert ChatFormat("{% if tools %}T{% endif %}{{ nothing }}ok").render([{"role": "user", "content": "x"}]) == "ok"


def test_chatml_fallback():
    chat = ChatFormat(CHATML_TEMPLATE, name="chatml (built-in)")
    assert chat.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ChatError, match="needs a tokenizer"):
        chat.encode([{"role": "user", "content": "U"}])


@pytest.mark.parametrize("template", [
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ self.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ '{0.__class__}'.format(messages) }}",
    "{{ ''|attr('\\x5f\\x5fclass\\x5f\\x5f') }}",
    "{{ ''['__class__'] }}",
    "{{ strftime_now.__globals__['datetime'] }}",
    "{{ raise_exception.__code__ }}",
])
def test_sandbox_refuses_other_routes_to_python_internals(template):
    with pytest.raises(ChatTemplateError, match=r"'evil' was refused by the sandbox: access to attribute '__\w+__'"):
        ChatFormat(template, name="evil").render([{"role": "user", "content": "x"}])
