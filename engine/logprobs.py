"""Log-probabilities of generated tokens, as OpenAI's `logprobs` report them.

A token's log-probability is the log-softmax of the logits the sampler was given for its position:
the model's own distribution, before penalties, temperature, top-k/p and min-p (vLLM's default, and
what makes the numbers comparable across sampling settings). Speculative decoding gives the same
numbers: each decided token's row of the verifying pass holds the logits plain decoding would have
had there (engine.speculative).

Tokens are shown as OpenAI shows them: their text, and their UTF-8 bytes (a byte-level token may hold
part of a character; its text is then "bytes:\\xe2\\x80" as OpenAI writes such tokens).
"""
from __future__ import annotations

import numpy as np

from engine.params import TokenLogprob, TopLogprob
from engine.tokenizer import Tokenizer

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


def token_text(piece: bytes) -> str:
    """A token's text for logprobs: the bytes as UTF-8, or OpenAI's "bytes:\\x.." form when they are
    not whole characters."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


class LogprobRecorder:
    """Collects a TokenLogprob for every decided token, from the logits it was sampled from. add() must
    run before the logits array is reused (the model overwrites it at its next pass)."""

    def __init__(self, tokenizer: Tokenizer, top: int):
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], not {top}")
        self.tokenizer = tokenizer
        self.top = top
        self.entries: list[TokenLogprob] = []

    def _describe(self, token: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.token_bytes(token)
        return token_text(piece), list(piece)

    def add(self, logits: np.ndarray, token: int) -> None:
        values = np.asarray(logits, dtype=np.float64)
        peak = values.max()
        log_total = peak + np.log(np.exp(values - peak).sum())  # log of the softmax's denominator
        top: list[TopLogprob] = []
        if self.top:
            n = values.shape[0]
            best = np.argpartition(values, n - self.top)[n - self.top:]
            for t in best[np.argsort(-values[best], kind="stable")]:
                text, raw = self._describe(int(t))
                top.append(TopLogprob(token=text, bytes=raw, logprob=float(values[t] - log_total)))
        text, raw = self._describe(token)
        self.entries.append(TokenLogprob(token=text, bytes=raw, logprob=float(values[token] - log_total),
                                         top_logprobs=top))
