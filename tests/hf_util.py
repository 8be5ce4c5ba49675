"""Helpers shared by the transformers comparisons (tests/test_hf.py on the CPU, tests/test_hf_gpu.py on a GPU) and by
the tests that compare two greedy runs (tests/test_serve.py, tests/tp_worker.py)."""
from __future__ import annotations

import inspect
import math

import torch


def rope_kwargs(cfg_cls, theta: float, scaling: dict | None = None) -> dict:
    """transformers 5 takes rope_parameters (rope_theta inside); 4.x takes rope_theta and rope_scaling."""
    if "rope_parameters" in inspect.signature(cfg_cls.__init__).parameters:
        return {"rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": theta}}
    return {"rope_theta": theta, **({"rope_scaling": scaling} if scaling else {})}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights scaled like a trained model's (unit-variance activations, peaked attention, non-trivial norms and
    biases): transformers' init leaves norms at 1 and biases at 0, which would test nothing."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def cache_kwarg(model) -> str:
    # transformers renamed forward's past_key_values to cache (the old name still works there, with a warning)
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_kv(cache, i):
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


def hf_decode_step(model, ids: torch.Tensor, P: int):
    """Prefill ids[:, :P] into a DynamicCache, then decode ids[:, P] at position P, capturing every layer's input
    and output. -> (inputs, outputs, cache before the step, cache after), per layer."""
    from transformers import DynamicCache
    layers = model.model.layers
    # (a sliding window: a cache of every row, which the config's would trim to the window; the model's mask
    # applies the window either way)
    cache = DynamicCache() if getattr(model.config, "sliding_window", None) else DynamicCache(config=model.config)
    kw = cache_kwarg(model)
    ins, outs, hooks = {}, {}, []

    def pre(i):
        def hook(mod, args, kwargs):
            ins[i] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        return hook

    def post(i):
        def hook(mod, args, kwargs, out):
            outs[i] = (out[0] if isinstance(out, tuple) else out).detach().clone()
        return hook

    with torch.no_grad():
        model(input_ids=ids[:, :P], use_cache=True, **{kw: cache})
        before = [tuple(t.clone() for t in cache_kv(cache, i)) for i in range(len(layers))]
        for i, layer in enumerate(layers):
            hooks.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
            hooks.append(layer.register_forward_hook(post(i), with_kwargs=True))
        try:
            model(input_ids=ids[:, P:P + 1], use_cache=True, **{kw: cache})
        finally:
            for h in hooks:
                h.remove()
        after = [tuple(t.clone() for t in cache_kv(cache, i)) for i in range(len(layers))]
    return ins, outs, before, after


# two greedy runs that agree up to rounding may still pick different tokens where the top two logits are closer than
# that rounding: a gap under this many rms of the step's logits is a near-tie (bf16 runs of different plans differ by
# ~1e-2 of the rms per logit, the tails a few times that; a random-weight model's top two are ~0.2 rms apart)
NEAR_TIE_RMS = 0.1


def greedy_agreement(tok_a: list[int], tok_b: list[int], logits_a: torch.Tensor, logits_b: torch.Tensor) -> dict:
    """Two greedy runs of one sequence that should agree up to rounding (e.g. a padded batch and the sequence alone):
    tok_*: their new token ids; logits_*: [steps, vocab], row t the step that chose token t. Returns diverges_at (the
    first step whose tokens differ, or None), logits_rel (||a - b|| / ||b|| of the logits over the steps up to and
    including it: both computed from the same tokens) and, where they diverge, tie_gap (the two chosen tokens' logit
    gap in run b at that step, in rms of its row: a near-tie under NEAR_TIE_RMS). Steps past a divergence follow
    different tokens and are not compared."""
    n = min(len(tok_a), len(tok_b))
    t = next((i for i in range(n) if tok_a[i] != tok_b[i]), None)
    la, lb = logits_a[: n if t is None else t + 1].float(), logits_b[: n if t is None else t + 1].float()
    out = {"diverges_at": t, "logits_rel": float((la - lb).norm() / lb.norm())}
    if t is not None:
        r = logits_b[t].float()
        out["tie_gap"] = float((r[tok_a[t]] - r[tok_b[t]]).abs() / r.pow(2).mean().sqrt())
    return out
