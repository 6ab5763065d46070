"""The KV cache: allocated once from a byte budget; the capacity in tokens follows from it."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

# Entry types of the cache. f16 (llama.cpp's default, and ours) holds twice the tokens of f32 in a
# budget and gives the same greedy tokens on llama.cpp's paths (tests/test_forward.py); the attention
# kernels read the halves directly, so decode reads half the cache bytes: at ~1,250 positions it ran
# 1.41x (SmolLM2) and 1.11x (Gemma 3) f32's speed, and the same at short contexts (measured).
KV_TYPES = {"f16": np.float16, "f32": np.float32}
DEFAULT_KV_TYPE = "f16"
ENV_KV_TYPE = "RQLLM_KV_TYPE"


def kv_type(requested: str | None = None) -> str:
    """`requested`, else RQLLM_KV_TYPE, else DEFAULT_KV_TYPE; a clear error for anything else."""
    value = requested or os.environ.get(ENV_KV_TYPE) or DEFAULT_KV_TYPE
    if value not in KV_TYPES:
        source = "kv type" if requested else ENV_KV_TYPE
        raise ValueError(f"{source} must be one of {', '.join(KV_TYPES)}; got {value!r}")
    return value

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str | int) -> int:
    """'256MiB' -> 268435456. Plain integers are bytes."""
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"byte size must be positive, got {text}")
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a byte size (examples: 64MiB, 1GiB, 500MB, 1048576)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"byte size must be positive, got {text!r}")
    return value


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


@dataclass
class KVCache:
    """Per-layer K and V arrays [slots, kv_dim] of f16 or f32 (kv_type). Sliding-window layers hold
    a ring of window + max_ubatch - 1 slots; global layers hold `capacity` slots."""

    capacity: int
    k: list[np.ndarray]
    v: list[np.ndarray]
    kv_type: str = DEFAULT_KV_TYPE

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    @staticmethod
    def plan(budget_bytes: int, kv_dim: int, local_slots: list[int | None], max_capacity: int,
             kv_type_name: str | None = None) -> tuple[int, int]:
        """(capacity in tokens, bytes the arrays will take) for a budget, without allocating anything.
        kv_type_name: "f16" | "f32" (default: kv_type())."""
        row = 2 * kv_dim * np.dtype(KV_TYPES[kv_type(kv_type_name)]).itemsize  # K and V

        def cost(cap: int) -> int:
            return sum(cap if s is None else min(cap, s) for s in local_slots) * row

        if cost(1) > budget_bytes:
            raise ValueError(
                f"KV budget {format_bytes(budget_bytes)} cannot hold even one token "
                f"(one token needs {format_bytes(cost(1))})")
        lo, hi = 1, max_capacity
        while lo < hi:  # cost is monotonic in capacity
            mid = (lo + hi + 1) // 2
            if cost(mid) <= budget_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo, cost(lo)

    @classmethod
    def from_budget(cls, budget_bytes: int, n_layer: int, kv_dim: int, local_slots: list[int | None],
                    max_capacity: int, kv_type_name: str | None = None) -> KVCache:
        """Largest capacity whose arrays fit the budget. local_slots[l] is the ring size a
        sliding-window layer needs at most (None for global layers)."""
        name = kv_type(kv_type_name)
        cap, _ = cls.plan(budget_bytes, kv_dim, local_slots, max_capacity, name)
        k, v = [], []
        for s in local_slots:
            slots = cap if s is None else min(cap, s)
            k.append(np.zeros((slots, kv_dim), dtype=KV_TYPES[name]))
            v.append(np.zeros((slots, kv_dim), dtype=KV_TYPES[name]))
        assert len(k) == n_layer
        return cls(capacity=cap, k=k, v=v, kv_type=name)


class CachedTokens:
    """Which tokens' K/V sit in a model's cache at positions 0.., so that a new sequence sharing a
    prefix with them reuses that prefix instead of computing it again.

    ring_slack: for models with sliding-window layers, how many positions past the window their
    rings hold (MAX_UBATCH - 1: engine.model.kv_layout); None when every layer keeps every position.
    A ring slot holds the latest position written to it, so reusing n tokens is safe only when no
    position at or past n + ring_slack + 1 has been written since the ones the new tokens read.
    `top` is the end of all positions written since the cache last started from position 0: a
    sequence that reused a prefix and ended sooner leaves the longer one's later positions in the
    rings, and speculative decoding writes past the tokens it keeps."""

    def __init__(self, ring_slack: int | None):
        self.ring_slack = ring_slack
        self.tokens: list[int] = []
        self.top = 0

    def reusable(self, ids: list[int]) -> int:
        """How many leading ids already sit in the cache (at most len(ids) - 1: the last one is always
        computed again, for its logits)."""
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        n = min(n, len(ids) - 1)
        if n and self.ring_slack is not None and n < self.top - self.ring_slack:
            return 0
        return max(n, 0)

    def begin(self, start: int) -> None:
        """A sequence is about to be written from position `start` (the tokens before it are reused)."""
        del self.tokens[start:]
        if start == 0:
            self.top = 0

    def wrote(self, tokens: list[int], end: int) -> None:
        """Positions up to end - 1 have been written since begin(); `tokens` (a prefix of what was
        written) have the K/V of this sequence."""
        self.tokens = list(tokens)
        self.top = max(self.top, end)
