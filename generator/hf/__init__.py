"""Hugging Face checkpoints -> variants.yaml entries, fused layers and a whole fused model.

    config.py      config.json -> variants.yaml model fields (model_entry, model_from_hf; `megakernel from-hf`)
    yaml_edit.py   the entry as YAML text, appended to a variants file (variant_entry_yaml, append_entry)
    checkpoint.py  the weight files (safetensors, or PyTorch's): which holds each tensor, shapes and dtypes
    model.py       load_hf (one FusedDecoderLayer) and FusedModel (embeddings + every layer + lm_head)

Only what the kernel computes exactly is mapped; anything else is a one-line HFConfigError naming the file and the
field, never approximated. Checkpoint problems are found from the files' headers (a PyTorch file's pickled
metadata, memory-mapped), before any tensor is read or anything touches CUDA.
"""
from .checkpoint import HFCheckpointError, _Checkpoint
from .config import (HFConfigError, Mapped, Window, check_positions, check_window, config_dtype, config_path,
                     default_name,
                     map_config, model_entry, model_from_hf, read_config)
from .model import FusedModel, HFDowncastWarning, HFPrecisionWarning, HFUnusedTensorsWarning, load_hf
from .yaml_edit import (DEFAULT_SEQ_LEN, WARNING_MARK, append_entry, context_words, default_seq_len,
                        trained_positions, variant_entry_yaml)

__all__ = ["DEFAULT_SEQ_LEN", "FusedModel", "HFCheckpointError", "HFConfigError", "HFDowncastWarning",
           "HFPrecisionWarning", "HFUnusedTensorsWarning", "Mapped", "WARNING_MARK", "Window", "append_entry",
           "check_positions", "check_window", "config_dtype", "config_path", "context_words", "default_name",
           "default_seq_len",
           "load_hf", "map_config", "model_entry", "model_from_hf", "read_config", "trained_positions",
           "variant_entry_yaml", "_Checkpoint"]
