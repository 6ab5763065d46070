"""RoPE frequencies: what the forward pass rotates each pair of a head's dimensions by.

The compiled pass rotates pair i (i < n_rot / 2) of a query or key at position p by the angle
p * freq[i] and scales cos and sin by `mscale`. Every RoPE variant we run is a choice of that table
and that factor, made here once per model (llama.cpp computes the same per call, in ggml's
rope_yarn: ggml/src/ggml-cpu/ops.cpp):

* plain:    freq[i] = base^(-2i / n_rot)
* factors:  divided by a per-pair factor: Llama 3's `rope_freqs.weight`, Phi-3's
            `rope_factors_long` / `rope_factors_short` (LongRoPE)
* linear:   times freq_scale = 1 / rope.scaling.factor
* yarn:     per pair, a mix of the scaled and the unscaled angle, m * theta + (1 - m) * freq_scale *
            theta, m ramping from 1 (high-frequency pairs, kept) to 0 (low-frequency pairs, scaled)
            between ggml_rope_yarn_corr_dims' bounds; cos and sin times (1 + 0.1 ln(1 / freq_scale))
* and cos and sin times rope.scaling.attn_factor (YaRN's and LongRoPE's attention factor).

The angle mix is linear in the angle, so it folds into the frequency: the table stays one float per
pair. Computed in float64 and rounded once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SCALING_TYPES = ("none", "linear", "yarn", "longrope")
YARN_BETA_FAST = 32.0  # llama.cpp's defaults (src/llama-hparams.h, llama-context.cpp)
YARN_BETA_SLOW = 1.0


@dataclass(frozen=True)
class RopeScaling:
    """The GGUF's `{arch}.rope.scaling.*` keys, as llama.cpp reads them (src/llama-model.cpp)."""

    kind: str = "none"  # one of SCALING_TYPES
    factor: float = 1.0  # context extension factor; freq_scale = 1 / factor
    original_ctx: int = 0  # the context the model was trained at before extension
    attn_factor: float = 1.0

    @property
    def freq_scale(self) -> float:
        return 1.0 / self.factor if self.kind in ("linear", "yarn") and self.factor > 0 else 1.0


def yarn_corr_dims(n_rot: int, original_ctx: int, base: float,
                   beta_fast: float = YARN_BETA_FAST, beta_slow: float = YARN_BETA_SLOW) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims (ggml/src/ggml.c): the pair range over which YaRN's ramp falls,
    from the pairs that turn beta_fast and beta_slow times over the original context."""

    def corr_dim(n_turns: float) -> float:
        return n_rot * math.log(original_ctx / (n_turns * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(corr_dim(beta_fast))), min(n_rot - 1.0, math.ceil(corr_dim(beta_slow)))


def frequencies(base: float, n_rot: int, scaling: RopeScaling = RopeScaling(),
                factors: np.ndarray | None = None) -> np.ndarray:
    """freq[i] for i < n_rot / 2, float32 (see the module docstring)."""
    i = np.arange(n_rot // 2, dtype=np.float64)
    freq = base ** (-2.0 * i / n_rot)
    if factors is not None:
        freq = freq / np.asarray(factors, dtype=np.float64)
    fs = scaling.freq_scale
    if scaling.kind == "yarn":
        lo, hi = yarn_corr_dims(n_rot, scaling.original_ctx, base)
        keep = 1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)  # rope_yarn_ramp, ext_factor 1
        freq = freq * (fs * (1.0 - keep) + keep)
    else:
        freq = freq * fs
    return freq.astype(np.float32)


def mscale(scaling: RopeScaling) -> float:
    """The factor on cos and sin."""
    if scaling.kind == "yarn":
        return scaling.attn_factor * (1.0 + 0.1 * math.log(1.0 / scaling.freq_scale))
    return scaling.attn_factor
