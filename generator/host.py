"""Values the host computes for a kernel from a variant's parameters (covered by the build's identity, since the
kernel source does not contain them)."""
from __future__ import annotations

import math

from .variants import Model


def inv_freq(m: Model, device="cpu"):
    """RoPE inverse frequencies [head_dim / 2] fp32, as transformers computes them
    (modeling_rope_utils._compute_default_rope_parameters; scaling: _compute_llama3_parameters,
    _compute_linear_scaling_rope_parameters: every frequency / factor; _compute_yarn_parameters: interpolated
    frequencies blended into the original ones over a ramp of dimensions, YaRN, Peng et al. 2023)."""
    import torch
    base = 1.0 / (m.rope_theta ** (torch.arange(0, m.head_dim, 2, dtype=torch.int64).float() / m.head_dim))
    s = dict(m.rope_scaling or {})
    if s.get("rope_type") == "linear":
        base = base / s["factor"]
    elif s.get("rope_type") == "yarn":
        dim, theta, old = m.head_dim, m.rope_theta, s["original_max_position_embeddings"]

        def correction_dim(rotations):  # the dimension that turns `rotations` times over the original length
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
        if s["truncate"]:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # (transformers' guard against a zero-width ramp)
        extra = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # (transformers' order of
        base = 1.0 / (s["factor"] * pos_freqs) * (1 - extra) + 1.0 / pos_freqs * extra   # operations: bit-equal)
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


def rope_attention(m: Model) -> float:
    """The factor RoPE's cos and sin are multiplied by, so q and k (and the cached k) are too: yarn's
    attention_factor (transformers' attention_scaling), else 1."""
    s = dict(m.rope_scaling or {})
    return float(s["attention_factor"]) if s.get("rope_type") == "yarn" else 1.0


def rope_cos_sin(m: Model, pos, device=None):
    """RoPE's cos and sin at positions `pos` (an integer tensor, any shape) -> two fp32 tensors [*pos.shape,
    head_dim / 2], each times rope_attention(m), as transformers' rotary embeddings give them before their cast to
    the model dtype (angles pos x inv_freq in fp32; modeling_llama.LlamaRotaryEmbedding.forward). inv_freq is
    computed on the host and copied each call: build a table once (as the unfused layer does), not in a timed or
    graph-captured step."""
    device = pos.device if device is None else device
    freqs = pos.to(device).float()[..., None] * inv_freq(m, device)
    af = rope_attention(m)
    return freqs.cos() * af, freqs.sin() * af
