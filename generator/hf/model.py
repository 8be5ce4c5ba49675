"""Fused layers from a checkpoint: load_hf (one FusedDecoderLayer) and FusedModel (embeddings, every layer, lm_head).

Everything is checked from the config and the weight files' headers before a tensor is read or CUDA is touched."""
from __future__ import annotations

import warnings

from .. import variants as gvariants
from .checkpoint import HFCheckpointError, _Checkpoint
from .config import VOCAB_ABSENT, HFConfigError, check_bool, check_positions, check_window, config_dtype


class HFPrecisionWarning(UserWarning):
    """A checkpoint run in another precision than its config's: bf16/fp32 weights cast to fp16 (which overflows to
    inf above 65,504, bf16 and fp32 do not), or an fp32 checkpoint run in bf16 without being asked
    (HFDowncastWarning)."""


class HFDowncastWarning(HFPrecisionWarning):
    """An fp32 checkpoint (config dtype/torch_dtype float32) run in bf16/fp16 because no dtype was asked for
    (generator.serve: the fused kernels' dtype); transformers would run it in fp32. Its own class so that a caller
    that says so in its own words (the CLI's note) can drop it by category."""


class HFUnusedTensorsWarning(UserWarning):
    """Tensors of the checkpoint that the config does not use (more layers than num_hidden_layers, a tensor no
    supported architecture has): transformers reports them as unexpected keys; they are not read."""


def warn_unused(ck: _Checkpoint, layer_names: list[dict], head: dict) -> None:
    """HFUnusedTensorsWarning (one line, the first few names) for every tensor of `ck` that neither a layer
    (layer_names: check_layer's {short: full} per layer) nor the head (_head_names) uses; rotary inv_freq buffers,
    which older checkpoints saved and transformers ignores, excepted."""
    used = {full for names in layer_names for full in names.values()} | {head["embed"], head["norm"], head["head"]}
    extra = sorted(t for t in ck.files if t not in used and not t.endswith("rotary_emb.inv_freq"))
    if extra:
        warnings.warn(HFUnusedTensorsWarning(
            f"{ck.index_path}: {len(extra)} tensor(s) not used by {ck.cfg_path.name} ({', '.join(extra[:4])}"
            f"{', ...' if len(extra) > 4 else ''}): not read (transformers reports them as unexpected)"),
            stacklevel=3)


def _built_variant(name: str, build_dir):
    """The Variant recorded in the build directory's manifest (LoadError naming the build command otherwise)."""
    from .. import loader
    entry, _ = loader.find_entry(name, build_dir)
    return loader._variant_from_entry(entry)


def _check_variant_fits(ck: _Checkpoint, v) -> None:
    """The built variant must compute exactly this checkpoint's layer (its dtype may differ: weights are cast). A
    sliding window the checkpoint has and the variant not is checked against the cache by check_window
    (_check_variant; serve at its cache_len); one the variant applies must be the checkpoint's (a decode variant's
    no longer than its cache never applies)."""
    for field in gvariants.LAYER_FIELDS:
        a, b = getattr(v.model, field), getattr(ck.model, field)
        if field == "rope_scaling":
            a, b = dict(a) if a else None, dict(b) if b else None
        if field == "sliding_window":  # the variant's window where it takes effect: the checkpoint's own
            a = gvariants.window_at(a, v.seq_len if v.mode == "decode" else None)
            if a is None:
                continue
        if a != b:
            raise HFConfigError(f"{ck.cfg_path}: variant '{v.name}' was built with {field}={a!r} but the config "
                                f"gives {field}={b!r}")


def _warn_fp16(ck: _Checkpoint, v, tensor: str, stacklevel: int = 3) -> None:
    """HFPrecisionWarning (one line) when a bf16 or fp32 model (config dtype/torch_dtype, else the stored dtype of
    `tensor`) is cast to an fp16 variant (v None: the unfused layers run in fp16, generator.serve): its
    intermediates may exceed fp16's 65,504 and become inf."""
    if v is not None and v.model.dtype != "fp16":
        return
    target = f"variant '{v.name}' is fp16" if v is not None else "the unfused layers run in fp16 (dtype=float16)"
    field, raw = config_dtype(ck.cfg)
    if raw in ("bfloat16", "float32", "float64"):
        src, what = ck.cfg_path, f"field '{field}' is {raw}"
    else:
        stored = ck.dtype(tensor)
        if stored not in ("BF16", "F32"):
            return
        src, what = ck.where(tensor), f"tensor '{tensor}' is stored as {stored}"
    warnings.warn(HFPrecisionWarning(
        f"{src}: {what} but {target}: fp16 overflows to inf above 65504 where bf16 does not, so activations of a "
        f"bf16/fp32-trained model may overflow ({'a bf16 variant' if v is not None else 'bf16'} is safe)"),
        stacklevel=stacklevel)


def _check_variant(ck: _Checkpoint, v, layers, *, tensor_parallel: bool = False) -> None:
    """Before any tensor is read: the variant computes these layers exactly (HFConfigError naming the field), its
    seq_len is within any sliding window they have, and an fp16 variant of a bf16 model warns. A tp > 1 variant
    is refused unless the caller runs tensor parallel (tensor_parallel=True: generator.serve)."""
    _check_variant_fits(ck, v)
    if v.tp > 1 and not tensor_parallel:
        raise HFConfigError(f"variant '{v.name}' is split over tp = {v.tp} GPUs: load it with "
                            "generator.serve.Model.from_hf(path, group=...) in one process per GPU")
    for i in layers:
        check_window(ck.mapped.window, v.seq_len, f"{ck.cfg_path}: variant '{v.name}'", ck.model.layers, i,
                     v.model.sliding_window)
    check_positions(ck.mapped.limit, v.seq_len, f"{ck.cfg_path}: variant '{v.name}'")
    _warn_fp16(ck, v, f"{ck.prefix}layers.{layers[0]}.self_attn.q_proj.weight")


def _variant_name(variant) -> str:
    if isinstance(variant, gvariants.Variant):
        return variant.name
    if not isinstance(variant, str):
        raise TypeError(f"variant: a built variant's name (str), got {type(variant).__name__}")
    return variant


def _need_cuda(name: str, device) -> None:
    """LoadError (as generator.load says it) before a tensor is moved to a device that cannot take it."""
    import torch

    from .. import loader
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise loader.LoadError(f"{name}: no CUDA device here (torch.cuda.is_available() is False): the fused layer "
                               "runs on an NVIDIA GPU")


def _load_layer(ck: _Checkpoint, layer_idx: int, name: str, v, build_dir, device):
    from .. import loader, reference
    names = ck.check_layer(layer_idx)  # every shape check: headers only, no tensor read, no CUDA
    _need_cuda(name, device)
    dtype = reference.TORCH_DTYPES[v.model.dtype]
    weights = {short: ck.get(full).to(device=device, dtype=dtype) for short, full in names.items()}
    return loader.load(name, weights, build_dir=build_dir, device=device)


def load_hf(path, layer_idx: int, variant, build_dir="build", device="cuda"):
    """Layer `layer_idx` of a checkpoint (safetensors, or PyTorch's) as a FusedDecoderLayer of the built variant
    `variant`.

    Checks, in order and before touching CUDA: the config maps (HFConfigError), every tensor of the layer exists
    with the shape the config gives (HFCheckpointError naming the tensor and the file), the variant is built and
    computes exactly this layer (LoadError / HFConfigError), and its seq_len is no longer than a sliding window
    the layer has (HFConfigError naming seq_len and sliding_window; a window >= seq_len never takes effect). An
    fp16 variant of a bf16/fp32 model warns (HFPrecisionWarning). Then the tensors are read, cast to the variant's
    dtype, moved to `device` and handed to generator.loader.load. -> FusedDecoderLayer: x [batch, hidden] ->
    [batch, hidden] in the variant's dtype."""
    ck = _Checkpoint(path)
    ck.check_layer(layer_idx)
    name = _variant_name(variant)
    v = _built_variant(name, build_dir)
    _check_variant(ck, v, [layer_idx])
    return _load_layer(ck, layer_idx, name, v, build_dir, device)


def _head_names(ck: _Checkpoint) -> dict:
    """Names of the embedding, final norm and lm_head tensors, shape-checked from the headers (HFCheckpointError).
    tie_word_embeddings as transformers 5 loads it (PreTrainedModel.tie_weights): the embedding is the lm_head,
    unless the checkpoint ships both (then both are read, and used untied where they differ); a tied checkpoint
    with only lm_head.weight uses it as the embedding. -> {"embed", "norm", "head", "tie", "both", "vocab"}."""
    H = ck.model.hidden
    embed_name, norm_name, head_name = f"{ck.prefix}embed_tokens.weight", f"{ck.prefix}norm.weight", "lm_head.weight"
    # False: the default of every supported config class
    tie = check_bool(ck.cfg_path, ck.cfg, "tie_word_embeddings")
    if tie and embed_name not in ck.files and head_name in ck.files:
        embed_name = head_name  # transformers ties the other way round when only the lm_head was saved
    vocab = ck.shape(embed_name)[0] if embed_name in ck.files else ck.cfg.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise HFCheckpointError(f"{ck.index_path}: tensor '{embed_name}' is missing")
    absent = "vocab_size" not in ck.cfg  # (then the config class's default, as transformers reads it)
    cfg_vocab = ck.cfg.get("vocab_size", VOCAB_ABSENT.get(ck.cfg.get("model_type")))
    if not absent and (isinstance(cfg_vocab, bool) or not isinstance(cfg_vocab, int)):
        raise HFCheckpointError(f"{ck.cfg_path}: field 'vocab_size' must be an integer, got {cfg_vocab!r}")
    if cfg_vocab is not None and cfg_vocab != vocab:
        said = (f"{ck.cfg_path} has no field 'vocab_size', so transformers takes its default {cfg_vocab}" if absent
                else f"field 'vocab_size' of {ck.cfg_path} is {cfg_vocab}")
        raise HFCheckpointError(f"{ck.where(embed_name)}: tensor '{embed_name}' has {vocab} rows, but {said} "
                                "(transformers refuses the mismatch)")
    ck.check(embed_name, (vocab, H))
    ck.check(norm_name, (H,))
    both = embed_name != head_name and head_name in ck.files
    if not tie or both:
        ck.check(head_name, (vocab, H))
    return {"embed": embed_name, "norm": norm_name, "head": head_name, "tie": tie, "both": both, "vocab": vocab}


def _read_head(ck: _Checkpoint, head: dict, dtype, dev):
    """(embed [vocab, hidden], final norm weight [hidden] as stored, lm_head [vocab, hidden]) on `dev`; embed and
    lm_head in `dtype`, the same tensor when tied (a tied checkpoint whose lm_head differs warns, used untied)."""
    import torch
    embed_raw = ck.get(head["embed"])
    embed = embed_raw.to(device=dev, dtype=dtype)
    norm_w = ck.get(head["norm"]).to(device=dev)
    lm_head = embed
    tie, head_name, embed_name = head["tie"], head["head"], head["embed"]
    if not tie or head["both"]:
        head_raw = ck.get(head_name)
        if not tie or not torch.equal(head_raw, embed_raw.to(head_raw.dtype)):
            if tie:
                warnings.warn(f"{ck.where(head_name)}: field 'tie_word_embeddings' of {ck.cfg_path} is true but "
                              f"tensor '{head_name}' differs from '{embed_name}': both are used as shipped, "
                              "untied, as transformers does", stacklevel=3)
            lm_head = head_raw.to(device=dev, dtype=dtype)
    return embed, norm_w, lm_head


class FusedModel:
    """A whole checkpoint: embeddings, every layer as a fused kernel, final norm and lm_head in torch.

    The KV caches live in the layers (capacity = the variant's seq_len); every sequence of the batch is at its own
    position, given to step()."""

    def __init__(self, layers, embed, norm_weight, lm_head, model, variant, device):
        self.layers = layers
        self.embed = embed
        self.norm_weight = norm_weight
        self.lm_head = lm_head
        self.model = model          # the checkpoint's Model (config)
        self.variant = variant      # the built Variant (batch, seq_len, dtype)
        self.device = device
        self.dtype = embed.dtype

    @property
    def batch(self) -> int:
        return self.variant.batch

    @property
    def seq_len(self) -> int:
        return self.variant.seq_len

    @property
    def vocab(self) -> int:
        return self.embed.shape[0]

    @classmethod
    def from_hf(cls, path, variant, build_dir="build", device="cuda") -> "FusedModel":
        """Every layer of a checkpoint on the built variant `variant`, with load_hf's checks for each (all before
        a tensor is read). embed [vocab, hidden] and lm_head [vocab, hidden] in the variant's dtype, the final
        norm's weight in fp32. tie_word_embeddings as transformers 5 loads it (PreTrainedModel.tie_weights): the
        embedding is the lm_head, unless the checkpoint ships both with different values, then both are used as
        shipped (with a warning); a tied checkpoint with only lm_head.weight uses it as the embedding."""
        import torch

        from .. import reference
        ck = _Checkpoint(path)
        layer_names = [ck.check_layer(i) for i in range(ck.model.layers)]  # every tensor checked before any read
        head = _head_names(ck)
        warn_unused(ck, layer_names, head)
        name = _variant_name(variant)
        v = _built_variant(name, build_dir)
        _check_variant(ck, v, list(range(ck.model.layers)))

        dtype = reference.TORCH_DTYPES[v.model.dtype]
        dev = torch.device(device)
        layers = [_load_layer(ck, i, name, v, build_dir, dev) for i in range(ck.model.layers)]
        if layers:
            dev = layers[0].device  # "cuda" -> "cuda:N"
        embed, norm_w, lm_head = _read_head(ck, head, dtype, dev)
        norm_w = norm_w.to(torch.float32)
        return cls(layers, embed, norm_w, lm_head, ck.model, v, dev)

    def _check_batch(self, what: str, n: int) -> None:
        if n != self.batch:
            raise ValueError(f"{what}: batch {n}, but variant '{self.variant.name}' was built for batch "
                             f"{self.batch}")

    def step(self, token_ids, pos):
        """token_ids [B] (int), pos [B] int32 (each sequence's position) -> logits [B, vocab] float32."""
        import torch

        from .. import reference
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
            raise ValueError(f"token_ids: a 1-d integer tensor [batch], got shape "
                             f"{tuple(getattr(token_ids, 'shape', ()))}")
        self._check_batch("token_ids", token_ids.shape[0])
        if not isinstance(pos, torch.Tensor):
            pos = torch.as_tensor(pos, dtype=torch.int32)
        if pos.dtype != torch.int32 or tuple(pos.shape) != (self.batch,):
            raise ValueError(f"pos: an int32 tensor of shape ({self.batch},), got {pos.dtype} "
                             f"{tuple(pos.shape)}")
        with torch.no_grad():
            ids = token_ids.to(self.device).long()
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.vocab:
                raise ValueError(f"token_ids: values must be in [0, {self.vocab - 1}], got {lo}..{hi}")
            x = self.embed[ids]
            if self.layers:
                self.layers[0].check_positions(pos.cpu())  # once, on the host; the layers then skip the check
            pos_dev = pos.to(self.device)
            for layer in self.layers:
                x = layer(x, pos_dev, validate=False)
            h = reference.norm(x, self.norm_weight, None, self.model)
            return (h.to(self.lm_head.dtype) @ self.lm_head.T).float()

    def generate(self, input_ids, max_new_tokens: int):
        """Greedy decoding: input_ids [B, T] -> [B, T + max_new_tokens]. The prompt is fed token by token through
        the decode kernel (every sequence at the same position)."""
        import torch
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids: a 2-d integer tensor [batch, tokens], got shape "
                             f"{tuple(getattr(input_ids, 'shape', ()))}")
        B, T = input_ids.shape
        self._check_batch("input_ids", B)
        if T < 1 or max_new_tokens < 0:
            raise ValueError(f"input_ids: at least one token, and max_new_tokens >= 0 (got {T}, {max_new_tokens})")
        if T + max_new_tokens - 1 > self.seq_len:
            raise ValueError(f"input_ids: {T} prompt + {max_new_tokens} new tokens need {T + max_new_tokens - 1} "
                             f"cache rows, over variant '{self.variant.name}''s seq_len {self.seq_len}")
        out = [input_ids[:, t].to(self.device).long() for t in range(T)]
        if max_new_tokens == 0:
            return input_ids.clone()
        for t in range(T + max_new_tokens - 1):
            logits = self.step(out[t], torch.full((B,), t, dtype=torch.int32))
            if t >= T - 1:
                out.append(logits.argmax(dim=-1))
        return torch.stack(out, dim=1).to(input_ids.device)
