"""Values the host computes for a kernel from a variant's parameters (covered by the build's identity, since the
kernel source does not contain them)."""
from __future__ import annotations

import math

from .variants import Model


def inv_freq(m: Model, device="cpu"):
    """RoPE inverse frequencies [head_dim / 2] fp32, as transformers computes them
    (modeling_rope_utils._compute_default_rope_parameters; scaling: _compute_llama3_parameters,
    _compute_linear_scaling_rope_parameters: every frequency / factor, the attention factor 1)."""
    import torch
    base = 1.0 / (m.rope_theta ** (torch.arange(0, m.head_dim, 2, dtype=torch.int64).float() / m.head_dim))
    s = dict(m.rope_scaling or {})
    if s.get("rope_type") == "linear":
        base = base / s["factor"]
    elif s:
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > low_wavelen, base / factor, base)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        base = torch.where(medium, smoothed, scaled)
    return base.to(device)
