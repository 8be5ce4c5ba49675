"""Helpers shared by the transformers comparisons (tests/test_hf.py on the CPU, tests/test_hf_gpu.py on a GPU)."""
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
