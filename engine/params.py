"""What a caller asks of one generation, and what it gets back."""
from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_TOKENS_LIMIT = 1 << 20
# How the next tokens are guessed before the model checks them (engine.speculative):
# "prompt_lookup" continues a match of the last tokens in the prompt and text so far, "draft" asks
# the engine's draft model, "off" decodes one token per pass. None: the engine's default.
SpeculativeMode = Literal["off", "prompt_lookup", "draft"]
SPECULATIVE_MODES: tuple[str, ...] = get_args(SpeculativeMode)


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: {"name", "schema", "strict", "description"}."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the output always follows the schema (we decode under its grammar)


class ResponseFormat(BaseModel):
    """What the output must be (engine.constraint): OpenAI's "text", "json_object" (any JSON object)
    and "json_schema"; rqllm's "regex" (the whole output matches `regex`). A grammar that does not
    compile is refused here, where requests are built, never at a worker."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema", "regex"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = Field(None, min_length=1, max_length=4096)

    @model_validator(mode="after")
    def _compiles(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is needed with type "json_schema", and only with it')
        if (self.type == "regex") != (self.regex is not None):
            raise ValueError('regex is needed with type "regex", and only with it')
        from engine.constraint import grammar_error  # llguidance is loaded only when a format is asked for

        error = grammar_error(self)
        if error:
            raise ValueError(f"{self.type} cannot be compiled: {error}")
        return self


class SamplingParams(BaseModel):
    """Sampling knobs. temperature 0 means greedy."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(256, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    top_k: int = Field(0, ge=0, description="0 disables")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=10.0, description="llama.cpp's repeat penalty over the last 64 tokens, prompt included: "
                                          "positive logits divided by it, negative ones multiplied")
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="OpenAI's: subtracted from a token's logit once per time the token "
                                          "was generated so far")
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="OpenAI's: subtracted from a token's logit once it was generated")
    no_repeat_ngram_size: int = Field(
        0, ge=0, le=64, description="ban the token that would repeat an n-gram of this many tokens already in "
                                    "the generated text (not the prompt); 0 disables")
    end_at_sentence: bool = Field(
        False, description="when max_tokens ends the text mid-sentence, end it after its last complete "
                           "sentence or line instead (finish_reason stays 'length')")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[str] = Field(default_factory=list, max_length=16)
    speculative: SpeculativeMode | None = Field(
        None, description="off | prompt_lookup | draft; None: the engine's default. Greedy output is the "
                          "same either way; sampled output follows the same distribution")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="return each generated token's log-probability and this many most "
                                       "likely alternatives at its position (engine.logprobs); None: none")

    response_format: ResponseFormat | None = Field(
        None, description="constrain the output to a JSON schema, any JSON object or a regex (engine.constraint)")

    @field_validator("response_format")
    @classmethod
    def _text_is_no_format(cls, v: ResponseFormat | None) -> ResponseFormat | None:
        return None if v is not None and v.type == "text" else v  # plain text: as if none were given

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v


FinishReason = Literal["stop", "length"]


class TopLogprob(BaseModel):
    """A token and its log-probability at a position (OpenAI's chat logprobs entry)."""

    token: str
    bytes: list[int]
    logprob: float


class TokenLogprob(TopLogprob):
    """A generated token's log-probability, with the most likely tokens at its position."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class Generation(BaseModel):
    """The outcome of one generation."""

    text: str
    prompt_ids: list[int]
    ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    prefill_seconds: float
    decode_seconds: float
    prefill_tps: float
    decode_tps: float
    prefix_hit_tokens: int = 0
    draft_tokens: int = 0  # tokens proposed by speculative decoding and checked by the model
    accepted_tokens: int = 0  # of those, the ones the model agreed with (kept)
    logprobs: list[TokenLogprob] | None = None  # one per token of `ids`, when params.logprobs asked for them
