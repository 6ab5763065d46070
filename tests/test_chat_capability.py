"""Telling a model that can chat from a base model by its GGUF metadata: the two real models
(SmolLM2-135M-Instruct carries a ChatML template; the Gemma 3 270M that `models pull` fetches is the
base model, with neither a template nor an instruct name) and the naming rules."""
from __future__ import annotations

import pytest

from engine.chat_capability import chat_capability, looks_instruction_tuned, model_chat_capability
from tests.model_available import needs_model


@needs_model("smollm2-135m")
def test_smollm2_instruct_can_chat_by_its_template(smollm2_path):
    cap = model_chat_capability(smollm2_path)
    assert cap.has_template and cap.can_chat
    assert "chat template" in cap.describe("smollm2-135m")


@needs_model("gemma3-270m")
def test_gemma3_270m_base_cannot_chat(gemma3_path):
    cap = model_chat_capability(gemma3_path)
    assert not cap.has_template and cap.instruct_evidence is None and not cap.can_chat
    assert "base model" in cap.describe("gemma3-270m")


@needs_model("gemma3-270m")
def test_the_engine_says_it_too(gemma3_path):
    from engine.engine import Engine

    assert not Engine(str(gemma3_path), threads=1, kv_budget="4MiB").chat_capability.can_chat


@pytest.mark.parametrize("name,tuned", [
    ("SmolLM2-135M-Instruct", True), ("Qwen2.5 0.5B Instruct", True), ("gemma-3-270m-it-q4_k_m.gguf", True),
    ("Llama-2-7b-chat.Q4_0.gguf", True), ("Gemma 3 270m", False), ("instructor-base", False),
    ("italian-gpt2", False), ("chatterbox", False), ("gemma-3-270m-q4_k_m.gguf", False),
])
def test_instruct_words_are_whole_words(name, tuned):
    assert looks_instruction_tuned(name) is tuned


def test_metadata_fields_and_file_name_are_evidence():
    base = {"general.name": "Gemma 3 270m", "general.basename": "gemma-3"}
    assert not chat_capability(base).can_chat
    assert not chat_capability({**base, "tokenizer.chat_template": "  "}).can_chat  # a blank template is none
    tuned = chat_capability({**base, "general.finetune": "it"})
    assert tuned.can_chat and not tuned.has_template and "general.finetune" in tuned.instruct_evidence
    by_file = chat_capability(base, "/models/gemma-3-270m-it-Q8_0.gguf")
    assert by_file.can_chat and "file name" in by_file.instruct_evidence
