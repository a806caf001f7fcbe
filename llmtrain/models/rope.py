"""Rotary frequencies: the default theta^(-2i/d), and YaRN (Peng et al. 2023, arXiv:2309.00071) as DeepSeek
uses it for long contexts.

YaRN keeps the fast-turning pairs (more than beta_fast turns over the original context) at their frequency,
divides the slow ones (under beta_slow turns) by `factor`, and blends linearly in between. It multiplies
cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim), and DeepSeek's attention multiplies its
softmax scale by mscale(factor, mscale_all_dim)^2, where mscale(s, m) = 0.1 * m * ln(s) + 1 (1 for s <= 1).
"""

from __future__ import annotations

import math

import torch

import kernels
from llmtrain.config import ModelConfig

YARN_BETA_FAST = 32.0
"""YaRN's turns over the original context above which a pair keeps its frequency (the published value)."""
YARN_BETA_SLOW = 1.0
"""YaRN's turns below which a pair is fully interpolated (the published value)."""


def inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """(rope_dim / 2,) fp32 angular frequency of each rotary pair."""
    d, base = cfg.rope_dim, cfg.rope_theta
    powers = base ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    # The expression transformers uses for the default rope, so cos/sin match it bit for bit.
    freq = 1.0 / powers
    if cfg.rope_scaling == "none":
        return freq

    def pair_turning(turns: float) -> float:
        # The pair index whose wavelength fits `turns` times into the original context.
        return d * math.log(cfg.rope_original_max_positions / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_turning(YARN_BETA_FAST)), 0)
    high = min(math.ceil(pair_turning(YARN_BETA_SLOW)), d - 1)
    span = high - low if high > low else 0.001
    interpolated = ((torch.arange(d // 2, dtype=torch.float) - low) / span).clamp(0, 1)
    kept = 1 - interpolated
    return 1.0 / (cfg.rope_scaling_factor * powers) * (1 - kept) + freq * kept


def _mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def cos_sin_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by (1 without scaling)."""
    if cfg.rope_scaling == "none":
        return 1.0
    s, m, m_all = cfg.rope_scaling_factor, cfg.rope_mscale, cfg.rope_mscale_all_dim
    return _mscale(s, m) / _mscale(s, m_all) if m and m_all else _mscale(s, 1.0)


def softmax_scale_factor(cfg: ModelConfig) -> float:
    """What DeepSeek's latent attention multiplies its softmax scale by (1 without scaling)."""
    if cfg.rope_scaling == "none" or not cfg.rope_mscale_all_dim:
        return 1.0
    return _mscale(cfg.rope_scaling_factor, cfg.rope_mscale_all_dim) ** 2


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, impl: str
) -> torch.Tensor:
    """kernels.apply_rotary of x (b, s, heads, d) with (s, d) tables, or per-sample (b, s, d) ones (packed
    documents), which go through it as one long sequence."""
    if cos.dim() == 2:
        return kernels.apply_rotary(x, cos, sin, interleaved=interleaved, impl=impl)
    b, s = x.shape[:2]
    flat = x.reshape(1, b * s, *x.shape[2:])
    cos, sin = cos.reshape(b * s, -1), sin.reshape(b * s, -1)
    return kernels.apply_rotary(flat, cos, sin, interleaved=interleaved, impl=impl).view_as(x)
