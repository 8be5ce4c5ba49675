"""Fused decoder-layer kernel generator: variants.yaml -> Jinja CUDA -> AOT cubins -> torch-callable layers."""
__version__ = "0.1.0"


def __getattr__(name):
    # lazy: the CLI's build path must not import torch/cupy driver code it does not need
    if name in ("load", "FusedDecoderLayer", "LoadError"):
        from . import loader
        return getattr(loader, name)
    raise AttributeError(name)
