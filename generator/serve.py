"""A whole model served end to end: dispatch over the declared variants, a decode step in a CUDA graph, generate().

    Model.from_hf(path, build_dir=..., variants=...)   checkpoint + built variants -> a servable model
    model.generate(prompts, max_new_tokens, ...)       batched prompts of any lengths, greedy or sampled, streamed
    model.stats(), model.memory(), model.paths()       what served which call, and where the GPU memory went

Dispatch (pure functions below, testable without a GPU): a decode step of B live sequences runs the fused variant of
the smallest declared batch >= B (the rest padded), else the unfused PyTorch layer (generator.unfused) at batch B,
warning once per missing shape with the variants.yaml entry that would cover it. A prompt is split into the declared
prefill chunk lengths (largest first, per the measured route of generator.routes); what no fused chunk covers runs
unfused. Every path shares one copy of each layer's packed weights and one KV cache per layer
([max_batch, kv_heads, cache_len, head_dim]; a variant of batch b uses the first b sequences).

The whole decode step (every layer, final norm, lm_head, next-token choice, the token into the generation's
history, the positions advanced and the next step's embedding rows) is one CUDA graph per (path, batch,
greedy/sampled; unfused: and the cache rows its attention reads, kv_bucket), replayed with no host work; every check
happens before. A greedy step on the fused head ends in the head's launch (lm_head.Advance: no launches after it),
and the host copies each step's tokens from the history on a side stream, so nothing stands between two steps'
graphs. Sampling is counter-based (a hash of seed, position and token id turned into Gumbel noise), so a seed gives
the same tokens with or without graphs, at any padding, on any path that gives the same logits.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

import torch

from . import lm_head, reference, sampler
from .unfused import UnfusedLayer
from .variants import Model as ModelShape, Variant, same_layer, shard_model, tile_problem

GiB = 1 << 30


class ServeError(ValueError):
    """A request or configuration the model cannot serve: one line saying what and why."""


class MissingVariantWarning(UserWarning):
    """A call ran on the unfused path because no built variant covers its shape; the message holds the
    variants.yaml entry that would."""


class PositionWarning(UserWarning):
    """A generate call reaches positions past the config's max_position_embeddings: it runs as asked (RoPE is defined
    there), but the model never saw those positions in training."""


# ---------------------------------------------------------------------------------------------------------------
# dispatch: pure functions
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Choice:
    """How one call is served: path "fused" | "unfused" | "fused-decode" (prompt tokens one at a time through the
    fused decode variant: only where the unfused layers are not loaded), the variant (None for unfused), the
    batch it runs at (>= the live batch: the rest is padding), why, and `missing`: the (mode, batch, seq_len) of
    the variant that would have served it fused, where none was declared."""
    path: str
    variant: str | None
    batch: int
    why: str
    missing: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Piece:
    """A run of prompt positions [start, start + length) served by one Choice (length = the chunk for fused)."""
    start: int
    length: int
    choice: Choice


def decode_choice(live: int, decode_variants: dict[int, str], routes: dict[str, str], seq_len: int,
                  unfused: bool = True) -> Choice:
    """The variant serving a decode step of `live` sequences: the smallest declared batch >= live whose route is
    fused (padding the rest), else the unfused layer at batch `live`. decode_variants {batch: name}, routes
    {name: "fused"|"unfused"} (missing: fused). ServeError when nothing can serve it (unfused=False)."""
    if live < 1:
        raise ServeError(f"batch: at least one sequence, got {live}")
    fits = sorted(b for b in decode_variants if b >= live)
    for b in fits:
        name = decode_variants[b]
        if routes.get(name, "fused") == "fused":
            why = "declared" if b == live else f"declared; {b - live} padding sequence(s)"
            return Choice("fused", name, b, why)
    missing = None if fits else ("decode", live, seq_len)
    why = (f"route of {decode_variants[fits[0]]} is unfused" if fits else
           f"no declared decode variant of batch >= {live}" if decode_variants else "no fused decode variant loaded")
    if not unfused:
        raise ServeError(f"decode of batch {live}: {why}, and the unfused layers are not loaded (unfused=False)")
    return Choice("unfused", None, live, why, missing)


def unfused_points(live: int, prefill_variants: dict[tuple[int, int], str], costs: dict) -> list[tuple[int, float]]:
    """(chunk length, unfused µs) measured beside the prefill variants (generator.routes figures `costs` {variant:
    {"unfused_us", ...}}) of the smallest measured batch >= live, by length; [] where nothing was measured."""
    by_batch: dict[int, list] = {}
    for (b, c), name in prefill_variants.items():
        us = (costs.get(name) or {}).get("unfused_us")
        if b >= live and us:
            by_batch.setdefault(b, []).append((c, float(us)))
    return sorted(by_batch[min(by_batch)]) if by_batch else []


def _graph_baseline(device) -> int:
    """Bytes reserved just before a capture, as torch.cuda.graph's entry leaves them (it synchronises and empties
    the cache: read before that, the blocks it frees would hide the graph's own growth)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


def padded(n: int) -> int:
    """The length an unfused prompt piece of n tokens runs at (Model._piece pads to a power of two, >= 16)."""
    return max(16, 1 << (n - 1).bit_length())


KV_BUCKET_MIN = 256  # kv_bucket's floor: fewer graphs where attention is a small part of a short context's step


def kv_bucket(rows: int, cache_len: int) -> int:
    """Cache rows an unfused decode step attends over when its sequences need `rows` (the largest position + 1): the
    next power of two >= max(rows, KV_BUCKET_MIN), at most cache_len. The unfused step masks rows past each
    position, so any bound >= rows gives the same result; a bound from the host's own positions makes the step's
    cost follow them (not the cache's length), with one graph a bucket for each (batch, draw): at most
    ceil(log2(cache_len / KV_BUCKET_MIN)) + 1, captured into one memory pool. ValueError for rows outside
    1..cache_len."""
    if not 1 <= rows <= cache_len:
        raise ValueError(f"kv_bucket: {rows} rows needed, the cache holds 1..{cache_len}")
    return min(cache_len, max(KV_BUCKET_MIN, 1 << (rows - 1).bit_length()))


def unfused_cost(n: int, pts: list[tuple[int, float]]) -> float:
    """Estimated µs of an unfused prefill piece of n tokens from unfused_points `pts` (non-empty): linear between
    measured chunk lengths, the shortest one's time below it (fixed costs dominate there), the last per-token slope
    beyond."""
    if n <= pts[0][0]:
        return pts[0][1]
    for (c0, u0), (c1, u1) in zip(pts, pts[1:]):
        if n <= c1:
            return u0 + (u1 - u0) * (n - c0) / (c1 - c0)
    (c0, u0), (c1, u1) = pts[-2:] if len(pts) > 1 else ((0, 0.0), pts[-1])
    return u1 + (u1 - u0) / (c1 - c0) * (n - c1)


def prefill_plan(length: int, live: int, prefill_variants: dict[tuple[int, int], str], routes: dict[str, str],
                 *, max_unfused: int = 2048, decode: Choice | None = None, unfused: bool = True,
                 costs: dict | None = None) -> list[Piece]:
    """Split a prompt span [0, length) of `live` sequences into pieces. prefill_variants {(batch, chunk): name};
    a chunk is usable where a variant of batch >= live is routed fused (the smallest such batch). With measured
    figures (`costs`: generator.routes' {variant: {"fused_us", "unfused_us"}}) and the unfused layers loaded, the
    pieces minimise the estimated time: fused chunks at their measured µs against unfused pieces of at most
    `max_unfused` tokens at unfused_cost() (eight fused 16-token chunks lose to one unfused 128-token piece when
    the unfused path does 128 tokens in the time fused does 16). Otherwise (nothing measured) the largest usable
    chunk that fits in what is left is taken at each point, and positions no fused chunk covers are merged into
    unfused pieces of at most `max_unfused` tokens. Without unfused layers (unfused=False) those positions go one
    token at a time through the fused decode Choice `decode` ("fused-decode"). Each unfused piece names in
    `missing` the prefill variant that would cover it: (\"prefill\", live, largest power of two <= its length,
    capped at 2048)."""
    if length < 1:
        raise ServeError(f"prompt: at least one token, got {length}")
    chunks = {}
    for (b, c), name in prefill_variants.items():
        if b >= live and routes.get(name, "fused") == "fused" and (c not in chunks or b < chunks[c][0]):
            chunks[c] = (b, name)
    fused_us = {c: (costs or {}).get(name, {}).get("fused_us") for c, (b, name) in chunks.items()}
    plan = None
    pts = unfused_points(live, prefill_variants, costs or {})
    if unfused and chunks and all(fused_us.values()) and pts:
        memo: dict[int, float] = {}

        def cost(n):  # priced at the padded length it runs at
            if n not in memo:
                memo[n] = unfused_cost(padded(n), pts)
            return memo[n]
        plan = _cheapest(length, chunks, fused_us, max_unfused, cost)
    pieces: list[Piece] = []
    s = 0
    while s < length:
        left = length - s
        fit = [c for c in chunks if c <= left] if plan is None else [plan[s]] if plan[s] in chunks else []
        if fit:
            c = max(fit)
            b, name = chunks[c]
            pieces.append(Piece(s, c, Choice("fused", name, b, "declared" if b == live else
                                             f"declared; {b - live} padding sequence(s)")))
            s += c
            continue
        # no fused chunk fits in what is left (chunks only get harder to fit), or the cheapest plan runs the next
        # tokens unfused
        n = min(left, max_unfused) if plan is None else -plan[s]
        if unfused and plan is not None:  # a measured choice: a declared variant would not do better
            ch = Choice("unfused", None, live, "measured faster than the fused chunks (generator.routes)")
        elif unfused:
            want = min(2048, 1 << (n.bit_length() - 1))
            why = "no declared prefill variant" if not prefill_variants else \
                f"no fused prefill chunk <= {left} of batch >= {live}"
            ch = Choice("unfused", None, live, why, ("prefill", live, want))
        else:
            if decode is None or decode.path != "fused":
                raise ServeError(f"prefill of batch {live}: no fused prefill or decode variant serves it and the "
                                 "unfused layers are not loaded (unfused=False)")
            ch = Choice("fused-decode", decode.variant, decode.batch, "no unfused layers: token by token")
        if pieces and pieces[-1].choice == ch and pieces[-1].length + n <= max_unfused:
            last = pieces.pop()
            pieces.append(Piece(last.start, last.length + n, ch))
        else:
            pieces.append(Piece(s, n, ch))
        s += n
    return pieces


def _cheapest(length: int, chunks: dict, fused_us: dict, max_unfused: int, unfused_us) -> list[int]:
    """Dynamic programme over prompt positions: plan[s] = the fused chunk taken at s (> 0), or -n for an unfused
    piece of n tokens, minimising the summed estimated µs of [s, length)."""
    best = [0.0] * (length + 1)
    plan = [0] * length
    for s in range(length - 1, -1, -1):
        left = length - s
        n = min(left, max_unfused)
        best[s], plan[s] = unfused_us(n) + best[s + n], -n
        for c in chunks:
            if c <= left and fused_us[c] + best[s + c] < best[s]:
                best[s], plan[s] = fused_us[c] + best[s + c], c
    return plan


def common_seq_len(variants: Iterable[Variant]) -> int | None:
    """The one seq_len (= cache rows per sequence) of the decode variants used together; None if there are none.
    ServeError (one line) when they mix seq_lens: one KV cache per layer serves them all."""
    lens = {}
    for v in variants:
        if v.mode == "decode":
            lens.setdefault(v.seq_len, v.name)
    if len(lens) > 1:
        raise ServeError("decode variants mix seq_len " + ", ".join(f"{s} ({n})" for s, n in sorted(lens.items()))
                         + ": one KV cache per layer serves all of them, so they must have one seq_len (pick them "
                         "with variants=[...])")
    return next(iter(lens), None)


def keep_one_seq_len(vs: list[Variant], cache_len: int | None) -> tuple[list[Variant], list[str], int | None]:
    """Of every built variant offered to a model (a default build declares several KV lengths, and one KV cache per
    layer serves one seq_len): (kept, the decode variants' names left out, the seq_len kept) -- the decode variants
    of cache_len's seq_len where one has it, else (cache_len None) of the longest; none where cache_len (an int) is
    none of theirs: decode then runs unfused (warned), as for a shape with no variant. Every prefill variant is kept
    (its chunk runs at any cache length)."""
    lens = sorted({v.seq_len for v in vs if v.mode == "decode"})
    if _int(cache_len) and cache_len >= 2 and lens and cache_len not in lens:  # (an invalid one: from_hf refuses it)
        keep = None
    elif len(lens) < 2:
        return vs, [], lens[0] if lens else None
    else:
        keep = cache_len if cache_len in lens else lens[-1]
    return ([v for v in vs if v.mode != "decode" or v.seq_len == keep],
            [v.name for v in vs if v.mode == "decode" and v.seq_len != keep], keep)


def drop_long_prefill(vs: list[Variant], cache_len: int) -> tuple[list[Variant], list[str]]:
    """(vs without the prefill variants whose chunk is longer than cache_len rows, their names): such a chunk can
    never run (the loader refuses it)."""
    long = [v.name for v in vs if v.mode == "prefill" and v.seq_len > cache_len]
    return [v for v in vs if v.name not in long], long


LARGER_CACHE = "a larger cache_len / seq_len"  # check_length's advice (the CLI says it in its options)


def check_length(prompt_lens: list[int], max_new_tokens: int, cache_len: int) -> None:
    """ServeError unless every sequence's prompt and new tokens fit the cache: the last token fed is at position
    len + max_new_tokens - 2, the longest prompt's last row must be < cache_len."""
    if not _int(max_new_tokens) or max_new_tokens < 1:
        raise ServeError(f"max_new_tokens: a positive integer, got {max_new_tokens!r}")
    need = max(prompt_lens) + max_new_tokens - 1
    longest = f"{max(prompt_lens)} token{'s' * (max(prompt_lens) != 1)}"
    if max(prompt_lens) > cache_len:
        raise ServeError(f"prompts: the longest prompt ({longest}) is over the cache capacity "
                         f"{cache_len} rows by itself ({LARGER_CACHE}, or a shorter prompt)")
    if need > cache_len:
        raise ServeError(f"max_new_tokens: the longest prompt ({longest}) + {max_new_tokens} new "
                         f"token{'s' * (max_new_tokens != 1)} need {need} cache rows (every token but the last new "
                         f"one is cached), over the cache capacity {cache_len} (at most "
                         f"{cache_len - max(prompt_lens) + 1} new tokens; or {LARGER_CACHE})")


_ENTRY_TAG = re.compile(r"-(decode|prefill)-b\d+-s\d+(-tp\d+)?(-(bf16|fp16))?$")  # missing_entry's name suffix


def missing_entry(entry_yaml: str, mode: str, batch: int, seq_len: int, tp: int = 1, dtype: str | None = None) -> str:
    """variants.yaml text that declares variant (mode, batch, seq_len, tp) of a model: the model's entry (from
    generator.hf.variant_entry_yaml) with its own `matrix:` line, named after the model and the shape (`llama` ->
    `llama-decode-b3-s64[-fp16]`: entries printed for several shapes or dtypes, or beside the model's own, paste as
    distinct keys; a model's built variants of any entry name serve it, matched by shape), in `dtype` ('bf16' /
    'fp16': what the model is served in) where given."""
    tp_field = f", tp: [{tp}]" if tp > 1 else ""
    own = re.search(r"^    dtype: (\S+)$", entry_yaml, flags=re.M)  # (the tag's dtype where dtype is None: fp32)
    tag = f"-{mode}-b{batch}-s{seq_len}" + (f"-tp{tp}" if tp > 1 else "") + (
        f"-{dtype or own.group(1)}" if dtype or own else "")
    text = re.sub(r"^(  [^\s#][^:]*):\s*$", lambda m: _ENTRY_TAG.sub("", m.group(1)) + tag + ":", entry_yaml, count=1,
                  flags=re.M)  # (a name that is itself an earlier warning's entry keeps one tag: its shape's)
    if dtype is not None:
        text = re.sub(r"^(    dtype: )\S+$", lambda m: m.group(1) + dtype, text, count=1, flags=re.M)
        # (and the entry's note on the config's dtype: "mapped to bf16" / "bf16 assumed" no longer holds)
        text = re.sub(r"(in config\.json): (?:mapped to \w+|\w+ assumed)", lambda m: f"{m.group(1)}: served in {dtype}",
                      text)
    return text.rstrip("\n") + (f"\n    matrix: {{mode: [{mode}], batch: [{batch}], seq_len: [{seq_len}]"
                                 f"{tp_field}}}\n")


# ---------------------------------------------------------------------------------------------------------------
# next-token choice: on the device, graph-capturable, reproducible from a seed
# ---------------------------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (int64 tensors holding values in [0, 2^32); constants < 2^31: no int64 overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int | torch.Tensor) -> torch.Tensor:
    """u [B, vocab] float32 in (0, 1), a function of (seed[b], step[b], token id) only. seed, step: int64 [B];
    vocab: the token ids 0 .. vocab - 1, or int64 [B, n] token ids (u [B, n]: the same values at those ids)."""
    # (the seed's high 32 bits mixed in: mix32(0) is 0, so seeds below 2^32 keep their streams)
    h = _mix32(_mix32((seed & _M32) ^ _mix32(seed >> 32)) ^ (step & _M32))
    idx = torch.arange(vocab, device=seed.device, dtype=torch.int64)[None, :] if isinstance(vocab, int) else vocab
    x = _mix32((h[:, None] + idx * 0x9E3779B1) & _M32)
    # (x >> 8) + 0.5 rounds in fp32: its largest value would make u 1 (Gumbel noise +inf): the float below 1 instead
    return (((x >> 8).float() + 0.5) * (1.0 / (1 << 24))).clamp_max_(1.0 - 2.0 ** -24)


def nucleus_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p's mask over probabilities probs [B, n] float32 sorted descending per row (top_p [B] float32): the
    smallest prefix whose probability reaches top_p, as transformers' TopPLogitsWarper keeps it (a token is kept
    where the probability before it is below top_p); top_p >= 1 keeps every token (transformers applies no
    warper: an fp32 cumulative sum can reach 1 before the row's end)."""
    return ((probs.cumsum(-1) - probs) < top_p[:, None]) | (top_p[:, None] >= 1)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  seed: torch.Tensor, step: torch.Tensor, *, candidates: int = 0, nucleus: bool = True
                  ) -> torch.Tensor:
    """Next tokens [B] int64 from logits [B, vocab] float32. Per sequence: temperature float32 [B] (0: greedy,
    argmax), top_k int64 [B] (<= 0: off), top_p float32 [B] (1: off), seed int64 [B], step int64 [B] (the position
    the token will take). As transformers' warpers in order (temperature, top-k, top-p: the smallest set of tokens
    whose probability reaches top_p, at least one), then an exact draw by the Gumbel-max trick with noise from
    uniform_noise: no host sync, no RNG state, capturable in a CUDA graph.
    Top-k keeps every token tied with the k-th largest logit, as transformers' TopKLogitsWarper does (bf16 logits
    tie often). What the caller knows of every row, for speed (the same draw): `candidates` > 0 where every
    sampled row's (temperature > 0) top_k is in 1 .. candidates: only the `candidates` largest logits are ranked
    (torch.topk, not a sort of the vocabulary: ~0.3 ms of a 128 K vocabulary's step on the H200; tokens tied with
    the k-th logit past them are left out, so give room: Model.generate ranks at least 2 x top_k and 128);
    `nucleus` False where every sampled row's top_p is 1 and top_k is off: nothing is ranked."""
    greedy = logits.argmax(-1)
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    if not nucleus and candidates <= 0:
        pick = (scaled - torch.log(-torch.log(uniform_noise(seed, step, logits.shape[-1])))).argmax(-1)
        return torch.where(temperature > 0, pick, greedy)
    if candidates > 0:
        scaled, order = scaled.topk(min(candidates, logits.shape[-1]), dim=-1)  # (sorted, largest first)
    else:
        scaled, order = scaled.sort(dim=-1, descending=True)
    kth = scaled.gather(-1, (top_k.clamp(1, scaled.shape[-1]) - 1)[:, None])  # each row's k-th largest
    in_k = (top_k[:, None] <= 0) | (scaled >= kth)
    scaled = scaled.masked_fill(~in_k, float("-inf"))
    probs = scaled.softmax(-1)
    keep = in_k & nucleus_keep(probs, top_p)
    keep[:, 0] = True
    g = -torch.log(-torch.log(uniform_noise(seed, step, order)))
    score = torch.where(keep, scaled + g, torch.full_like(scaled, float("-inf")))
    pick = order.gather(-1, score.argmax(-1, keepdim=True)).squeeze(-1)
    return torch.where(temperature > 0, pick, greedy)


# ---------------------------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------------------------

def layer_weight_bytes(m: ModelShape, elt: int) -> int:
    """Bytes of one layer's weights at `elt` bytes per element (packed or merged: the same count)."""
    total = 0
    for shape in reference.weight_shapes(m).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total * elt


def plan_memory(m: ModelShape, *, vocab: int, tied: bool, elt: int, max_batch: int, cache_len: int,
                fused: bool, unfused: bool, workspace_bytes: int, tp: int = 1) -> dict[str, int]:
    """Bytes the model will hold on the GPU, before anything is loaded: weights (fused packed, unfused merged),
    embedding + lm_head, KV caches (2 x layers x [max_batch, kv_heads, cache_len, head_dim]), the fused layers'
    workspaces (workspace_bytes: sum over the variants of one layer's; every layer of a variant shares one), and a
    margin for loading (one layer's weights twice), the decode steps' buffers (logits, token history, the fused
    draw's scratch: at most 8 bytes a logit a row, sampler.Sampler.scratch) and graphs."""
    per_layer = layer_weight_bytes(m, elt)
    out = {
        "weights_fused": per_layer * m.layers if fused else 0,
        "weights_unfused": per_layer * m.layers if unfused else 0,
        "embed_lm_head": vocab * m.hidden * elt * (1 if tied else 2) + m.hidden * 4,
        "kv_caches": 2 * m.layers * max_batch * m.kv_heads * cache_len * m.head_dim * elt,
        "workspaces": workspace_bytes,
        # loading reads a whole layer (tp shards of m) before keeping its shard
        "margin": (tp + 1) * per_layer + 8 * max_batch * (vocab * 4 + cache_len * 8) + 64 * (1 << 20),
    }
    out["total"] = sum(out.values())
    return out


# check_fits's advice (the generate command words it in its options: cli._as_options)
FITS_ADVICE_UNFUSED = "lower max_batch or cache_len (or max_new_tokens)"  # (no variants: none to load fewer of)
FITS_ADVICE = FITS_ADVICE_UNFUSED + ", or load fewer variants / unfused=False"


def check_fits(plan: dict[str, int], free: int, total: int, what: str, where: str = "on the GPU") -> None:
    """ServeError (one line) when plan["total"] bytes exceed `free` bytes of the device."""
    if plan["total"] > free:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in plan.items() if k != "total" and v)
        advice = FITS_ADVICE if plan.get("weights_fused") else FITS_ADVICE_UNFUSED
        raise ServeError(f"{what}: needs {plan['total'] / GiB:.2f} GiB {where} ({parts} GiB) but only "
                         f"{free / GiB:.2f} of {total / GiB:.2f} GiB are free: {advice}")


def host_memory() -> tuple[int, int] | None:
    """(available, total) bytes of this machine's memory from /proc/meminfo (MemAvailable: free memory plus what
    the page cache would give back, MemTotal); None where the system does not say (no check is made then)."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return int(info["MemAvailable"].split()[0]) * 1024, int(info["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def checkpoint_bytes(files: Iterable[Path]) -> int:
    """Size on disk of a checkpoint's weight files (safetensors or PyTorch)."""
    return sum(Path(f).stat().st_size for f in set(files))


# ---------------------------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------------------------

class Draw(NamedTuple):
    """A sampled generation's draw shape, fixed for the generation (a decode graph each): sample_tokens' static
    arguments `candidates` and `nucleus`, and `room`, the logits a row of the fused draw ranks (sampler.Sampler's
    candidates; 0: none ranked)."""
    candidates: int
    nucleus: bool
    room: int


@dataclasses.dataclass
class Generation:
    """What generate() returns. tokens: the new tokens of each sequence (stop token included, nothing after it);
    sequences: prompt + new tokens; ttft_s: seconds from the call to the first tokens (prefill); decode_s: seconds
    of the decode loop; tokens_per_s: new tokens of live sequences per second of decode; decode_choice,
    prefill_pieces: the Choice of the decode step and the Piece of each prompt piece; logits: per new token of the
    longest sequence a [B, vocab] float32 (output_logits=True; the first is the prefill's; a stopped sequence's rows
    after its stop token are what its padding computed, not tokens)."""
    tokens: list[list[int]]
    sequences: list[list[int]]
    ttft_s: float
    decode_s: float
    tokens_per_s: float
    decode_choice: Choice
    prefill_pieces: list[Piece]
    logits: list[torch.Tensor] | None = None


_KERNEL_DTYPES = {t: name for name, t in reference.TORCH_DTYPES.items()}  # the kernels' dtypes, as variants.yaml names


def _num(v) -> bool:  # a finite real number (numpy's too)
    return isinstance(v, (numbers.Real)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v) -> bool:  # an integer (numpy's too), not a bool
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


SEED_MAX = 2 ** 62  # seeds in [0, SEED_MAX): seed + 7919 x sequence must fit int64


def _listed(x):
    """A torch tensor or numpy array as its Python value (.tolist()); anything else as it is."""
    return x.tolist() if isinstance(x, torch.Tensor) or type(x).__module__ == "numpy" and hasattr(x, "tolist") else x


def eos_token_ids(model_dir: Path, cfg: dict, cfg_path: Path | None = None) -> list[int]:
    """The checkpoint's end-of-sequence token ids, as transformers' generate reads them (GenerationConfig): where
    the directory holds generation_config.json, that file's eos_token_id alone (an instruct model's end-of-turn ids
    are often only there; a file that sets none means none, as transformers reads it), else config.json's (`cfg`,
    read from `cfg_path`); an int or a list, [] where none is set (an id outside [0, vocab), e.g. -1, is kept as
    transformers keeps it: it is never generated). Raises ServeError (one line, naming the file)
    where the value is not integer token ids (a string "2", a float) or generation_config.json is not a JSON object."""
    gen = Path(model_dir) / "generation_config.json"
    try:
        doc, path = json.loads(gen.read_text()), gen
    except FileNotFoundError:
        doc, path = cfg, Path(cfg_path or Path(model_dir) / "config.json")
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ServeError(f"{gen}: not readable JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise ServeError(f"{path}: top level must be a JSON object, got {type(doc).__name__}")
    eos = doc.get("eos_token_id")
    if eos is None:
        return []
    ids = [eos] if not isinstance(eos, list) else eos
    # (a negative id is kept, as one past the vocabulary: transformers takes it, and it stops nothing)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ServeError(f"{path}: eos_token_id: integer token ids (an int or a list), got {eos!r}")
    return ids


class Model:
    """A checkpoint served on the declared variants that fit it, with the unfused layer for the rest.

    Attributes: shape (the layer's generator.variants.Model), dtype, device, vocab, cache_len, max_batch,
    decode_variants {batch: name}, prefill_variants {(batch, chunk): name}, routes {name: "fused"|"unfused"},
    fused {variant name: [FusedDecoderLayer per layer]}, unfused [UnfusedLayer per layer] or None, k_caches/v_caches
    (one [max_batch, kv_heads, cache_len, head_dim] pair per layer), use_graphs (CUDA graphs for decode steps and
    prompt pieces on a GPU).
    Build with Model.from_hf.
    """

    def __init__(self, *, shape, embed, norm_weight, lm_head, fused, unfused, k_caches, v_caches, routes,
                 route_why, cache_len, entry_yaml, checkpoint_bytes=0, eos=(), route_costs=None, tp=1,
                 build_dir=None, max_positions=None, positions_words=None):
        self.shape = shape
        self.embed, self.norm_weight, self.lm_head = embed, norm_weight, lm_head
        self.dtype, self.device = embed.dtype, embed.device
        self.vocab = embed.shape[0]
        self.fused, self.unfused = fused, unfused
        self.k_caches, self.v_caches = k_caches, v_caches
        self.max_batch = k_caches[0].shape[0] if k_caches else 1
        self.cache_len = cache_len
        self.routes, self.route_why = routes, route_why
        self.route_costs = route_costs or {}  # measured µs per prefill variant (generator.routes): prefill_plan
        self.tp = tp  # GPUs each layer is split over (tensor parallel; from_hf's group)
        self.decode_variants = {ls[0].variant.batch: n for n, ls in fused.items() if ls[0].variant.mode == "decode"}
        self.prefill_variants = {(ls[0].variant.batch, ls[0].variant.seq_len): n for n, ls in fused.items()
                                 if ls[0].variant.mode == "prefill"}
        self.entry_yaml = entry_yaml
        self.checkpoint_bytes = checkpoint_bytes
        self.eos = tuple(eos)
        # the positions the model is meant to run at (hf.trained_positions; None: not an int in config.json), and
        # how the warning past them names them (hf.context_words)
        self.max_positions = max_positions
        self.positions_words = positions_words or f"max_position_embeddings {max_positions}"
        self.use_graphs = self.device.type == "cuda"
        self.max_unfused_chunk = 2048
        self._warned: set = set()
        self._busy = threading.Lock()  # held by the generate()/stream() under way: they share caches and buffers
        self._counters: dict[tuple, dict] = {}
        self._graphs: dict[tuple, tuple] = {}
        self._bufs: dict[tuple, dict] = {}
        self._graph_bytes = 0
        self.max_prefill_graphs = 64  # prompt pieces captured (per path, batch, start, padded length); then eager
        self._prefill_pool = None
        self._decode_pool = None  # (the unfused decode steps' graphs, one a kv_bucket: _step)
        self._plans: dict[tuple, list] = {}  # (prompt length, batch) -> its pieces
        # the head (final norm, LM head, greedy token) as one kernel (generator.lm_head) where it serves the model;
        # fused_head False: torch's (norm, GEMM, argmax)
        self.build_dir = build_dir
        self._fused_head_on = self.device.type == "cuda" and build_dir is not None
        self._heads: dict[int, lm_head.LMHead] = {}  # by kernel_rows: 1, MAX_BATCH
        self._head_why: str | None = None
        self._sampler: sampler.Sampler | None = None  # a sampled step's draw in one kernel (with the fused head)
        self._sampler_why: str | None = None

    # -- construction --
    @classmethod
    def from_hf(cls, path, *, build_dir="build", variants: Iterable[str] | None = None, device="cuda",
                max_batch: int | None = None, cache_len: int | None = None, dtype: torch.dtype | None = None,
                unfused: bool = True, gpu_name: str | None = None, routes_dir=None, group=None,
                default_cache_len: int | None = None) -> "Model":
        """Load a checkpoint directory (config.json and safetensors or PyTorch weights) for serving.

        variants: names of built variants to use (each must be built in build_dir and compute this checkpoint's
        layer: LoadError / HFConfigError); None: every variant of build_dir's manifest that computes it (none is
        fine: everything runs unfused; where their decode variants have several seq_lens, those of cache_len, else
        of the longest, with a warning naming the others; on the CPU none: fused kernels run on CUDA). Decode
        variants must share one seq_len, the cache length
        (ServeError where `variants` names several);
        cache_len (rows per sequence) is needed only when no decode variant is used (default_cache_len, where
        given, stands in for it then, raised to the longest chunk of the prefill variants used: generate's longest
        prompt + new tokens). max_batch: sequences the caches
        hold (default: the largest batch of the variants, else of the built decode variants that a cache_len
        none of them holds left out (caches of that many sequences at that cache_len: pass max_batch for fewer), else
        1). dtype: of the weights and caches, a torch dtype or
        'bf16' / 'fp16' / 'fp32' (default: the variants', else on a GPU the config's bf16/fp16 (the fused kernels'
        dtypes), on the CPU the config's dtype as transformers loads it, float64 as float32; torch.float32 only
        without fused variants). unfused=False keeps no
        second copy of the weights: then every call must have a fused variant. The planned memory is checked before
        any tensor is read (ServeError, one line): against torch.cuda.mem_get_info on a GPU, the machine's available
        memory on the CPU (host_memory). gpu_name and
        routes_dir select the measured routes (generator.routes; default: this GPU's). group: a torch.distributed
        process group (NCCL, one process per GPU, every rank calling from_hf and generate alike) for tensor
        parallel: each rank holds its heads and MLP columns of every layer (interface.TP_SPLIT) and KV caches of
        kv_heads / tp heads, the embedding and lm_head whole; the variants used must be built with that tp
        (ServeError), and the unfused layers split the same way.

        Raises ServeError for an argument it cannot serve; a directory or checkpoint that cannot be read as
        transformers reads it raises generator.hf.HFConfigError (a ValueError: the checkpoint's own fault, not the
        call's), a built variant that does not load generator.manifest.LoadError (a RuntimeError); each one line."""
        from . import loader, manifest, routes as groutes
        from .hf import model as hfm
        from .hf.checkpoint import _Checkpoint
        from .hf.config import check_positions, check_window, config_dtype
        from .hf.yaml_edit import context_words, trained_positions, variant_entry_yaml

        # numpy's integers as Python's (the checks below take ints; a bool stays refused)
        cache_len, max_batch, default_cache_len = (int(v) if _int(v) else v
                                                   for v in (cache_len, max_batch, default_cache_len))
        # the arguments used before (or without) the checks of what they mean: their types, each named
        if not isinstance(path, (str, os.PathLike)):
            raise ServeError(f"path: a model directory (or its config.json), a str or path, got {path!r}")
        for name, val, none_ok in (("build_dir", build_dir, False), ("routes_dir", routes_dir, True)):
            if not (val is None and none_ok) and not isinstance(val, (str, os.PathLike)):
                raise ServeError(f"{name}: a directory, a str or path, got {val!r}")
        if gpu_name is not None and not isinstance(gpu_name, str):
            raise ServeError(f"gpu_name: a GPU's name as torch.cuda.get_device_name gives it, got {gpu_name!r}")
        if not isinstance(unfused, bool):
            raise ServeError(f"unfused: True or False, got {unfused!r}")
        if default_cache_len is not None and not (_int(default_cache_len) and default_cache_len >= 2):
            raise ServeError(f"default_cache_len: rows per sequence, an integer >= 2, got {default_cache_len!r}")
        if variants is not None and not isinstance(variants, str):
            try:
                variants = list(variants)  # (any iterable of names, read once)
            except TypeError:
                raise ServeError(f"variants: built variant names (a list of str), got {variants!r}") from None
        if group is not None and not isinstance(group, getattr(torch.distributed, "ProcessGroup", ())):
            raise ServeError(f"group: a torch.distributed process group (e.g. torch.distributed.group.WORLD), got "
                             f"{group!r}")
        asked = dtype
        if isinstance(dtype, str):  # the names variants.yaml and `--dtype` use, and torch's
            names = {**reference.TORCH_DTYPES, "fp32": torch.float32}
            names.update({str(t).removeprefix("torch."): t for t in names.values()})
            if dtype.removeprefix("torch.") not in names:
                raise ServeError(f"dtype: 'bf16', 'fp16', 'fp32' or a torch dtype (torch.bfloat16, ...), got {dtype!r}")
            dtype = names[dtype.removeprefix("torch.")]
        # (a shape the fused kernels cannot compute, variants.tile_problem, is served by the unfused layers)
        ck = _Checkpoint(path, kernel=False)
        no_kernel = tile_problem(ck.model)
        eos = eos_token_ids(ck.dir, ck.cfg, ck.cfg_path)  # a bad one refused before any weight is read
        layer_names = [ck.check_layer(i) for i in range(ck.model.layers)]  # the whole checkpoint, before any load
        head = hfm._head_names(ck)
        hfm.warn_unused(ck, layer_names, head)
        shape = ck.model
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            dev = None
        if dev is None or dev.type not in ("cuda", "cpu"):
            raise ServeError(f"device: 'cuda', 'cuda:N' or 'cpu', got {device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ServeError(f"device: {device} but no CUDA GPU is visible (torch.cuda.is_available() is False); "
                             "device='cpu' serves the unfused layers on the CPU")
        if isinstance(variants, list) and variants and dev.type != "cuda" and not no_kernel:  # (before the build is
            # read; a shape no kernel computes is said first, below)
            raise ServeError(f"device: fused variants run on CUDA, got {dev} (variants=[] serves unfused on {dev})")
        # the variants
        # the build's records (not read where variants=[]: the unfused layers need no build)
        # (off CUDA no fused kernel runs: every built variant offered means none, as `generate --device cpu` does)
        offered = variants is None and dev.type == "cuda"
        entries = manifest.read_manifest(Path(build_dir))["variants"] if offered or variants else {}
        tp = 1 if group is None else torch.distributed.get_world_size(group)
        try:
            local = shard_model(shape, tp)  # what each GPU holds of a layer
        except ValueError as exc:
            raise ServeError(f"group: {exc}") from None
        if variants is None:
            def fits(v):  # (a decode variant's window compared where its cache lets it apply)
                return same_layer(v.model, shape, v.seq_len if v.mode == "decode" else None) and v.tp == tp
            chosen = [] if not offered else sorted(
                n for n, e in entries.items() if fits(manifest.variant_from_entry(e)))
        else:
            if isinstance(variants, str):
                raise ServeError("variants: a list of variant names, got a single string")
            chosen = list(variants)
            if chosen and no_kernel:
                raise ServeError(f"variants: no fused kernel computes this checkpoint's layers ({ck.cfg_path}: "
                                 f"{no_kernel}); variants=[] serves them unfused")
        vs = []
        for name in chosen:
            v = hfm._built_variant(name, build_dir)
            hfm._check_variant(ck, v, list(range(shape.layers)), tensor_parallel=True)
            if v.tp != tp:
                raise ServeError(f"variants: {name} is built for tp = {v.tp} GPUs, but the model runs on {tp} "
                                 f"({'no process group' if group is None else 'the process group'})")
            vs.append(v)
        if variants is None and len(dts := {v.model.dtype for v in vs}) > 1:  # (a build of both dtypes: the asked
            want = _KERNEL_DTYPES.get(dtype) if dtype is not None else shape.dtype  # one's, else the checkpoint's)
            if want in dts:
                warnings.warn(f"variants of dtype {want} used ({'dtype' if dtype is not None else 'the checkpoint'}'s); "
                              f"not used: {', '.join(v.name for v in vs if v.model.dtype != want)} (pass variants=[...] "
                              "or dtype to choose)", stacklevel=2)
                vs = [v for v in vs if v.model.dtype == want]
        built_batch = max([v.batch for v in vs if v.mode == "decode"], default=1)  # (max_batch's default below)
        if variants is None and (kept := keep_one_seq_len(vs, cache_len))[1]:
            lens = sorted({v.seq_len for v in vs if v.mode == "decode"})
            vs, dropped, keep = kept
            if keep is None:
                warnings.warn(f"cache_len {cache_len}: no built decode variant holds {cache_len} rows per sequence "
                              f"(theirs: seq_len {', '.join(map(str, lens))}), so decode runs unfused; not used: "
                              f"{', '.join(dropped)} (pass cache_len={lens[-1]}, or declare decode variants of "
                              f"seq_len {cache_len})", stacklevel=2)
            else:
                warnings.warn(f"decode variants of seq_len {keep} used (the KV cache's rows per sequence); not used: "
                              f"{', '.join(dropped)} (pass variants=[...] or cache_len to choose)", stacklevel=2)
        dts = {v.model.dtype for v in vs}
        if len(dts) > 1:
            raise ServeError(f"variants: mix dtypes {', '.join(sorted(dts))}: one copy of the weights serves all of "
                             "them, so they must share one dtype")
        if vs:
            vdtype = reference.TORCH_DTYPES[dts.pop()]
            if dtype is not None and dtype != vdtype:
                raise ServeError(f"dtype: {dtype} but the variants are {vdtype}")
            dtype = vdtype
        elif dtype is None:  # on the CPU no fused kernel runs: the checkpoint's own dtype, as transformers 5 loads it
            # (the config's, else the weights' stored one)
            own = dev.type == "cpu" and (config_dtype(ck.cfg)[1] or {"F32": "float32", "F64": "float64"}.get(
                ck.dtype(f"{ck.prefix}layers.0.self_attn.q_proj.weight")))
            dtype = torch.float32 if own in ("float32", "float64") else reference.TORCH_DTYPES[shape.dtype]
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ServeError(f"dtype: torch.bfloat16, torch.float16 or torch.float32 (or 'bf16', 'fp16', 'fp32'), "
                             f"got {dtype}")
        if not vs and dtype == torch.float16:  # (fused fp16 variants warned in _check_variant)
            hfm._warn_fp16(ck, None, f"{ck.prefix}layers.0.self_attn.q_proj.weight", stacklevel=4)
        field, raw = config_dtype(ck.cfg)
        if asked is None and raw in ("float32", "float64") and dtype != torch.float32:
            warnings.warn(hfm.HFDowncastWarning(
                f"{ck.cfg_path}: field '{field}' is {raw} but the model runs in {str(dtype).removeprefix('torch.')} "
                "(the fused kernels' dtype; dtype=torch.float32 with variants=[] runs it unfused, "
                + ("as transformers does)" if raw == "float32" else "the nearest to transformers' float64)")),
                stacklevel=2)
        seq = common_seq_len(vs)
        if seq is not None and cache_len not in (None, seq):
            raise ServeError(f"cache_len: the decode variants hold seq_len = {seq} rows per sequence, got {cache_len} "
                             f"(a cache of {seq} rows serves them fused; without fused variants, e.g. variants=[], "
                             f"{cache_len} rows run unfused; or declare decode variants of seq_len {cache_len})")
        if seq is None and cache_len is None and default_cache_len is not None:  # room for every prefill chunk too
            cache_len = max([default_cache_len] + [v.seq_len for v in vs if v.mode == "prefill"])
        given = cache_len is not None
        cache_len = seq if seq is not None else cache_len
        if isinstance(cache_len, bool) or not isinstance(cache_len, int) or cache_len < 2:
            if given:
                raise ServeError(f"cache_len: rows per sequence, an integer >= 2, got {cache_len!r}")
            raise ServeError(f"cache_len: no decode variant fixes the cache length: pass cache_len (rows per "
                             f"sequence, >= 2; the CLI's --cache-len), got {cache_len!r}")
        # the unfused layers compute the model's own window; a prefill variant's must be it where the cache is longer
        check_window(ck.mapped.window, cache_len, f"{ck.cfg_path}: cache_len", shape.layers, None,
                     shape.sliding_window)
        check_positions(ck.mapped.limit, cache_len, f"{ck.cfg_path}: cache_len")
        for v in vs:
            if v.mode == "prefill":
                check_window(ck.mapped.window, cache_len, f"{ck.cfg_path}: cache_len {cache_len} with variant "
                             f"'{v.name}'", shape.layers, None, v.model.sliding_window)
        # a prefill chunk longer than the cache can never run (the loader refuses it): named ones are an error, of
        # every built variant offered they are left out, said in one warning
        kept, long = drop_long_prefill(vs, cache_len)
        if long and variants is not None:
            raise ServeError(f"variants: {', '.join(long)}: a prefill chunk longer than cache_len {cache_len} (rows "
                             "per sequence) cannot run")
        if long:
            vs = kept
            warnings.warn(f"prefill variants with chunks longer than cache_len {cache_len} not used: "
                          f"{', '.join(long)}", stacklevel=2)
        batches = [v.batch for v in vs]
        if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int)
                                      or max_batch < 1):
            raise ServeError(f"max_batch: a positive integer, got {max_batch!r}")
        # (decode run unfused at a cache_len no built variant holds: the batches the build declares all the same)
        max_batch = max([max_batch or (1 if any(v.mode == "decode" for v in vs) else built_batch)] + batches)
        if not unfused and not any(v.mode == "decode" for v in vs):
            raise ServeError("unfused=False: no decode variant is used, so nothing could serve a decode step")
        # memory, before any tensor is read
        elt = torch.finfo(dtype).bits // 8
        ws = sum(entries[v.name]["plan"]["workspace"]["bytes"] for v in vs)
        plan = plan_memory(local, vocab=head["vocab"], tied=head["tie"] and not head["both"], elt=elt,
                           max_batch=max_batch, cache_len=cache_len, fused=bool(vs), unfused=unfused,
                           workspace_bytes=ws, tp=tp)
        if dev.type == "cuda" and torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info(dev)
            check_fits(plan, free, total, f"{ck.dir} with max_batch {max_batch}, cache_len {cache_len}")
        elif dev.type == "cpu" and (mem := host_memory()) is not None:
            check_fits(plan, *mem, f"{ck.dir} with max_batch {max_batch}, cache_len {cache_len}", "of CPU memory")
        gpu = gpu_name or (torch.cuda.get_device_name(dev) if dev.type == "cuda" and torch.cuda.is_available()
                           else "cpu")
        routes, why = {}, {}
        try:
            for v in vs:
                routes[v.name], why[v.name] = groutes.route(v.name, gpu, routes_dir)
        except ValueError as exc:  # MEGAKERNEL_ROUTE set to no path
            raise ServeError(str(exc)) from None
        # the measured times plan a prompt's pieces (not where MEGAKERNEL_ROUTE forces one path)
        costs = {} if os.environ.get("MEGAKERNEL_ROUTE") else groutes.read_routes(gpu, routes_dir)
        # load: one packed copy per layer, one cache pair per layer, shared by every variant
        if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        fused: dict[str, list] = {v.name: [] for v in vs}
        unf, kcs, vcs = ([] if unfused else None), [], []
        for i in range(shape.layers):
            names = layer_names[i]
            W = {short: ck.get(full).to(device=dev, dtype=dtype) for short, full in names.items()}
            k = torch.zeros(max_batch, local.kv_heads, cache_len, shape.head_dim, dtype=dtype, device=dev)
            vv = torch.zeros_like(k)
            kcs.append(k)
            vcs.append(vv)
            packed = None
            for v in vs:
                layer = loader.load(v.name, W if packed is None else None, build_dir=build_dir, device=dev,
                                    packed=packed, caches=(k, vv), cache_len=cache_len, group=group,
                                    share_workspace=fused[v.name][0] if fused[v.name] else None)
                packed = layer.packed
                fused[v.name].append(layer)
            if unf is not None:
                unf.append(UnfusedLayer(W, shape, k, vv, group=group))
            del W
        embed, norm_w, lm_head = hfm._read_head(ck, head, dtype, dev)
        try:
            entry = None if no_kernel else variant_entry_yaml(ck.cfg_path, name=vs[0].model.name if vs else None)
        except Exception:  # noqa: BLE001 - the hint is best effort; the model itself loaded
            entry = f"  # `megakernel from-hf {ck.dir}` prints this model's entry\n"
        if no_kernel:  # (said once, here: no variant can be declared for it)
            warnings.warn(MissingVariantWarning(f"{ck.cfg_path}: no fused kernel computes this shape ({no_kernel}): "
                                                "every layer runs the unfused PyTorch layer"), stacklevel=2)
        return cls(shape=shape, embed=embed, norm_weight=norm_w.to(dtype), lm_head=lm_head, fused=fused,
                   unfused=unf, k_caches=kcs, v_caches=vcs, routes=routes, route_why=why, cache_len=cache_len,
                   entry_yaml=entry, checkpoint_bytes=checkpoint_bytes(ck.files.values()), eos=eos,
                   route_costs={v.name: costs[v.name] for v in vs if v.name in costs}, tp=tp, build_dir=build_dir,
                   max_positions=(trained := trained_positions(ck.cfg, ck.model.rope_scaling)),
                   positions_words=trained and context_words(ck.cfg, trained))

    # -- reports --
    def stats(self) -> list[dict]:
        """One row per (mode, path, variant) that served calls: mode "decode" or "prefill", path (Choice's:
        "fused", "unfused" or "fused-decode"), variant the fused variant's name (on the unfused path "unfused bN":
        the batch of N sequences its call computed), calls, tokens (real tokens of live sequences), padded_tokens
        (the rest of what the call's batch x length computed: padding sequences, and in prefill the positions past a
        shorter prompt; an unfused piece's padding to a power of two is not counted). Counted since the model was
        made or reset_stats."""
        return [{"mode": k[0], "path": k[1], "variant": k[2], **c} for k, c in sorted(self._counters.items(),
                                                                                     key=str)]

    def reset_stats(self) -> None:
        """Zero the counters stats() reads (e.g. after a warm-up, so they count the served traffic only)."""
        self._counters.clear()

    def _count(self, mode: str, ch: Choice, live: int, tokens_per_seq: int = 1, real: int | None = None) -> None:
        """One call on `ch`: `real` tokens of live sequences (default live x tokens_per_seq), the rest of the
        ch.batch x tokens_per_seq it computed padding."""
        c = self._counters.setdefault((mode, ch.path, ch.variant or f"unfused b{ch.batch}"),
                                      {"calls": 0, "tokens": 0, "padded_tokens": 0})
        real = live * tokens_per_seq if real is None else real
        c["calls"] += 1
        c["tokens"] += real
        c["padded_tokens"] += ch.batch * tokens_per_seq - real

    def paths(self, batch: int = 1, prompt_len: int = 1) -> dict:
        """Which path would serve each layer for a request of `batch` sequences and a `prompt_len` prompt:
        {"decode": Choice, "prefill": [Piece], "head": head_path(batch),
        "layers": [{"layer": i, "decode": path/variant, "prefill": ...}]}.
        Every layer has the same shape, so every layer takes the same path. ServeError for a batch outside
        [1, max_batch] or a prompt outside [1, cache_len] tokens (generate would refuse them)."""
        if not _int(batch) or not 1 <= batch <= self.max_batch:
            raise ServeError(f"batch: sequences in [1, {self.max_batch}] (max_batch), got {batch!r}")
        if not _int(prompt_len) or not 1 <= prompt_len <= self.cache_len:
            raise ServeError(f"prompt_len: tokens in [1, {self.cache_len}] (cache_len), got {prompt_len!r}")
        d = decode_choice(batch, self.decode_variants, self.routes, self.cache_len, self.unfused is not None)
        p = prefill_plan(prompt_len, batch, self.prefill_variants, self.routes, max_unfused=self.max_unfused_chunk,
                         decode=d, unfused=self.unfused is not None, costs=self.route_costs)
        desc = lambda ch: ch.variant or f"unfused b{ch.batch}"  # noqa: E731
        pre = ", ".join(sorted({desc(x.choice) for x in p}))
        return {"decode": d, "prefill": p, "head": self.head_path(batch),
                "layers": [{"layer": i, "decode": desc(d), "prefill": pre} for i in range(self.shape.layers)]}

    def memory(self) -> dict[str, int]:
        """Bytes held on the model's device: weights_fused (one packed copy per layer), weights_unfused, embed_lm_head,
        kv_caches, workspaces (one per variant, shared by its layers), step_buffers (each decode path's inputs,
        logits and token history: [cache_len, batch] int64; the fused draw's scratch), graphs (pool growth measured
        around each capture),
        total; and checkpoint_bytes (the weight files on disk) for comparison."""
        def nbytes(t):
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        seen, storages, fused_w, ws = set(), set(), 0, 0
        for layers in self.fused.values():
            for layer in layers:
                if id(layer.packed) not in seen:
                    seen.add(id(layer.packed))
                    fused_w += sum(nbytes(t) for t in layer.packed.values())
                ptr = layer.workspace.untyped_storage().data_ptr()
                if ptr not in storages:  # one workspace serves all layers of a variant
                    storages.add(ptr)
                    ws += layer.workspace.numel()
        head = nbytes(self.embed) + (0 if self.lm_head is self.embed else nbytes(self.lm_head)) + \
            nbytes(self.norm_weight)
        out = {"weights_fused": fused_w, "weights_unfused": sum(u.weight_bytes for u in self.unfused or []),
               "embed_lm_head": head, "kv_caches": sum(nbytes(k) + nbytes(v) for k, v in zip(self.k_caches,
                                                                                            self.v_caches)),
               "workspaces": ws, "step_buffers": sum(nbytes(t) for b in self._bufs.values() for t in b.values()) +
               (self._sampler.scratch_bytes() if self._sampler is not None else 0),
               "graphs": self._graph_bytes}
        out["total"] = sum(out.values())
        out["checkpoint_bytes"] = self.checkpoint_bytes
        return out

    def _warn_missing(self, ch: Choice, depth: int = 0) -> None:
        """MissingVariantWarning, once per shape, where a declared variant would serve `ch` fused; not for a
        tensor-parallel prompt (prefill variants are one-GPU). Off CUDA, where no fused kernel runs (built or not),
        one line once a model instead (a trial found a 20-line entry a shape a flood there)."""
        if ch.missing is None or ch.missing in self._warned or self.entry_yaml is None:
            return  # (entry_yaml None: a shape no variant can serve, said once by from_hf)
        if self.tp > 1 and ch.missing[0] == "prefill":
            return
        if self.device.type != "cuda":
            if "off-cuda" not in self._warned:
                self._warned.add("off-cuda")
                warnings.warn(MissingVariantWarning(
                    f"device {self.device.type}: every call runs the unfused PyTorch layers (fused variants run on a "
                    "CUDA GPU, where each shape without a built one is warned with the variants.yaml entry that "
                    "declares it)"), stacklevel=5 + depth)
            return
        self._warned.add(ch.missing)
        mode, b, s = ch.missing
        what = f"batch {b}" if mode == "decode" else f"batch {b}, chunks of {s}"
        warnings.warn(MissingVariantWarning(
            f"no built {mode} variant serves {what} (cache_len {self.cache_len}): running the unfused PyTorch layer; "
            f"to serve it fused, declare in variants.yaml under `models:` and `megakernel build`:\n"
            + missing_entry(self.entry_yaml, mode, b, s, self.tp, dtype=_KERNEL_DTYPES.get(self.dtype))),
            stacklevel=5 + depth)

    # -- the pieces of a step --
    @property
    def fused_head(self) -> bool:
        """Whether the head is the fused kernel where it serves (head_path); setting it drops the captured steps,
        which hold the head they were captured with."""
        return self._fused_head_on

    @fused_head.setter
    def fused_head(self, on: bool) -> None:
        if on and self.device.type != "cuda":
            raise ServeError(f"fused_head: the fused head runs on a CUDA GPU; this model is on {self.device}")
        if bool(on) != self._fused_head_on:
            self._graphs.clear()
            self._prefill_pool = self._decode_pool = None  # (a pool whose graphs are gone is not captured into again)
        self._fused_head_on = bool(on)

    def head_path(self, batch: int) -> str:
        """Which head serves `batch` rows: "fused" (generator.lm_head: one kernel) or "torch (<why>)". ServeError
        for a batch that is not a positive integer."""
        if not _int(batch) or batch < 1:
            raise ServeError(f"batch: rows, a positive integer, got {batch!r}")
        why = self._head_why or self._head_unsupported(batch)
        return "fused" if why is None else f"torch ({why})"

    def _fused_off(self) -> str | None:
        """Why no fused head or draw runs on this model (fused_head off, or not on a GPU), else None."""
        if not self.fused_head:
            return "fused_head off" if self.device.type == "cuda" else f"on {self.device.type}"
        return None

    def _head_unsupported(self, batch: int) -> str | None:
        return self._fused_off() or lm_head.supported(batch, self.shape.hidden, self.shape.norm, self.dtype)

    def _fused_head(self, batch: int) -> lm_head.LMHead | None:
        """The head's kernel for `batch` rows (compiled into build_dir at its first use), or None: torch's head.
        A head that cannot be built warns once and is not tried again."""
        if self._head_why is not None or self._head_unsupported(batch) is not None:
            return None
        rows = lm_head.kernel_rows(batch)
        if rows not in self._heads:
            try:
                self._heads[rows] = lm_head.LMHead(self.norm_weight, self.lm_head, self.shape.norm_eps, batch,
                                                   build_dir=self.build_dir)
            except Exception as exc:  # noqa: BLE001 - any failure leaves torch's head, said once
                last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
                self._head_why = f"the fused head failed: {last}"
                warnings.warn(f"{self._head_why}; serving torch's head", stacklevel=3)
                return None
        return self._heads[rows]

    def draw_path(self, temperature, top_k=0, top_p=1.0) -> str:
        """Which code draws a decode step's tokens for these settings (generate's): "greedy" (the head's argmax),
        "fused" (generator.sampler: one kernel, its own ranking of the largest logits, or none at top-k off and
        top-p 1) or
        "torch (<why>)" (serve.sample_tokens: the same draw in ~30 launches). Settings as generate() takes them,
        with its defaults (each one value, or a list, tensor or array of one per sequence); ServeError where
        generate would refuse them."""
        temperature, top_k, top_p = _listed(temperature), _listed(top_k), _listed(top_p)
        n = next((len(v) for v in (temperature, top_k, top_p) if isinstance(v, (list, tuple))), 1)
        if n < 1:
            raise ServeError("draw_path: one value, or a list of one per sequence (at least one)")
        temps, ks, ps, _ = self._check_sampling(n, temperature, top_k, top_p)
        sampled = self._draw_shape(temps, ks, ps)
        if sampled is None:
            return "greedy"
        why = self._sampler_unsupported(sampled)
        return "fused" if why is None else f"torch ({why})"

    def _check_sampling(self, rows: int, temperature, top_k, top_p, seed=0) -> tuple[list, list, list, list]:
        """generate()'s sampling settings for `rows` sequences -> per sequence (temperature, top_k, top_p, seed):
        each setting one value for all (the seed: seed + 7919 b for sequence b) or a list (tuple, tensor, array)
        of one per sequence; a top_k of the whole vocabulary or more is off (0: transformers' TopKLogitsWarper
        clamps it to the vocabulary, which keeps every token). ServeError (one line) for settings generate
        refuses."""
        rules = (("temperature", temperature, "a finite number >= 0 (0: greedy)", lambda v: _num(v) and v >= 0),
                 ("top_k", top_k, "an integer >= 0 (0: off)", lambda v: _int(v) and v >= 0),
                 ("top_p", top_p, "a number in (0, 1] (1: off)", lambda v: _num(v) and 0 < v <= 1),
                 ("seed", seed, "an integer in [0, 2**62)", lambda v: _int(v) and 0 <= v < SEED_MAX))
        out = []
        for nm, val, rule, ok in rules:
            val = _listed(val)  # (a tensor or array: its values)
            vals = list(val) if isinstance(val, (list, tuple)) else None
            if vals is not None and len(vals) != rows:
                raise ServeError(f"{nm}: {rule}, or a list of one per sequence ({rows}), got "
                                 f"{len(vals)} value{'' if len(vals) == 1 else 's'}")
            for v in vals if vals is not None else [val]:
                if not ok(v):
                    raise ServeError(f"{nm}: {rule}" + (", or a list of one per sequence" if vals is not None else "")
                                     + f", got {v!r}")
            if vals is None:
                vals = [int(val) + 7919 * b for b in range(rows)] if nm == "seed" else [val] * rows
            out.append(vals)
        temps, ks, ps, seeds = out
        ks = [0 if int(k) >= self.vocab else int(k) for k in ks]
        return [float(t) for t in temps], ks, [float(p) for p in ps], [int(x) for x in seeds]

    def _draw_shape(self, temps: list, ks: list, ps: list) -> Draw | None:
        """The draw's shape (Draw) for a generation's per-sequence settings (top_k clamped, off as 0), None where
        every sequence is greedy. Over the sampled sequences: all with top-k on, the candidates leave room for ties
        at the largest k-th logit, in powers of two (few graphs for many top_k values); all with top-k off, none are
        ranked (nucleus: some top_p < 1; sample_tokens then sorts the vocabulary, the fused draw ranks
        sampler.NUCLEUS_CANDIDATES); some of each, sample_tokens sorts the whole vocabulary (each row its own top-k),
        the fused draw ranks as many as the top-k rows need, and at least NUCLEUS_CANDIDATES."""
        rows = [b for b, t in enumerate(temps) if t > 0]
        if not rows:
            return None
        on = [ks[b] > 0 for b in rows]
        nucleus = any(ps[b] < 1 for b in rows)
        top = max((ks[b] for b in rows if ks[b] > 0), default=0)
        cands = min(self.vocab, max(128, 1 << (2 * top - 1).bit_length())) if top else 0
        if not any(on):
            return Draw(0, nucleus, sampler.NUCLEUS_CANDIDATES if nucleus else 0)
        if not all(on):
            return Draw(0, True, max(cands, sampler.NUCLEUS_CANDIDATES))
        return Draw(cands, nucleus, cands)

    def _sampler_unsupported(self, sampled: Draw) -> str | None:
        if self._fused_off():
            return self._fused_off()
        if self.dtype not in (torch.bfloat16, torch.float16):
            return f"dtype {str(self.dtype).removeprefix('torch.')}"
        return self._sampler_why or sampler.supported(sampled.room, sampled.nucleus, self.vocab)

    def _fused_sampler(self, sampled: Draw) -> sampler.Sampler | None:
        """The draw's kernels (compiled into build_dir at their first use), or None: sample_tokens. A sampler that
        cannot be built warns once and is not tried again."""
        if self._sampler_unsupported(sampled) is not None:
            return None
        if self._sampler is None:
            try:
                self._sampler = sampler.Sampler(self.shape.hidden, self.dtype, self.device, build_dir=self.build_dir)
            except Exception as exc:  # noqa: BLE001 - any failure leaves torch's draw, said once
                last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
                self._sampler_why = f"the fused draw failed: {last}"
                warnings.warn(f"{self._sampler_why}; drawing with torch", stacklevel=3)
                return None
        return self._sampler

    def _logits(self, x: torch.Tensor, logits: torch.Tensor | None = None,
                nxt: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, hidden] -> (logits [B, vocab] float32, greedy next tokens [B] int64), into the given tensors where
        given: the fused head's kernel where it serves B rows (head_path), else torch's: the final RMSNorm
        (layernorm for a layernorm shape) as transformers computes it, lm_head in the model's dtype, argmax."""
        head = self._fused_head(x.shape[0])
        if head is not None:
            return head(x.contiguous(), logits, nxt)
        lg = self._torch_logits(x)
        if logits is not None:
            logits.copy_(lg)
            lg = logits
        nx = lg.argmax(-1)
        if nxt is not None:
            nxt.copy_(nx)
            nx = nxt
        return lg, nx

    def _torch_logits(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.shape.norm == "layernorm":
            h = torch.nn.functional.layer_norm(xf, (xf.shape[-1],), self.norm_weight.float(), None,
                                               self.shape.norm_eps).to(x.dtype)
        else:
            h = self.norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.shape.norm_eps)
                                    ).to(x.dtype)
        return (h @ self.lm_head.T).float()

    def _layers_decode(self, x: torch.Tensor, pos: torch.Tensor, ch: Choice, kv_len: int | None = None
                       ) -> torch.Tensor:
        if ch.path == "unfused":  # (kv_len: the rows its attention reads, > every position; the fused path reads
            for u in self.unfused:  # only rows 0..pos itself)
                x = u.decode(x, pos, kv_len)
        else:
            for layer in self.fused[ch.variant]:
                x = layer(x, pos, validate=False)
        return x

    def _buffers(self, ch: Choice) -> dict:
        key = (ch.path, ch.variant, ch.batch)
        if key not in self._bufs:
            B, dev = ch.batch, self.device
            self._bufs[key] = {
                # the generation's tokens, a row a decode step (step: the row the next step writes; a generation
                # has fewer steps than cache rows): the host copies each row on a side stream, never in the step's way
                "hist": torch.zeros(self.cache_len, B, dtype=torch.long, device=dev),
                "step": torch.zeros(1, dtype=torch.long, device=dev),
                "pos": torch.zeros(B, dtype=torch.int32, device=dev),
                "temp": torch.zeros(B, device=dev), "topk": torch.zeros(B, dtype=torch.long, device=dev),
                "topp": torch.ones(B, device=dev), "seed": torch.zeros(B, dtype=torch.long, device=dev),
                "out": torch.zeros(B, dtype=torch.long, device=dev),
                "logits": torch.zeros(B, self.vocab, device=dev),
                "x": torch.zeros(B, self.shape.hidden, dtype=self.dtype, device=dev)}  # embed[tok]: a step's input
        return self._bufs[key]

    def _compute(self, ch: Choice, bufs: dict, sampled: Draw | None, advance: bool = True,
                 kv_len: int | None = None) -> None:
        """x (the step's tokens' embeddings), pos -> logits, out (the next tokens); writes cache row pos of every
        sequence (idempotent); with `advance` then hist[step] = out, step += 1, pos += 1, x = embed[out]: the next
        step's inputs. A greedy step on the fused head advances in the head's own launch (lm_head.Advance), else
        torch does."""
        x = self._layers_decode(bufs["x"], bufs["pos"], ch, kv_len)
        head = None if sampled or not advance else self._fused_head(x.shape[0])
        if head is not None:
            head(x.contiguous(), bufs["logits"], bufs["out"],
                 lm_head.Advance(bufs["hist"], bufs["step"], bufs["pos"], self.embed, bufs["x"]))
            return
        logits, _ = self._logits(x, bufs["logits"], bufs["out"])
        draw = self._fused_sampler(sampled) if sampled else None
        if draw is not None:  # the draw and the advance in one launch
            draw(logits, bufs["temp"], bufs["topk"], bufs["topp"], bufs["seed"], bufs["pos"], bufs["out"],
                 candidates=sampled.room, nucleus=sampled.nucleus,
                 advance=lm_head.Advance(bufs["hist"], bufs["step"], bufs["pos"], self.embed, bufs["x"])
                 if advance else None)
            return
        if sampled:
            bufs["out"].copy_(sample_tokens(logits, bufs["temp"], bufs["topk"], bufs["topp"], bufs["seed"],
                                            bufs["pos"].long() + 1, candidates=sampled.candidates,
                                            nucleus=sampled.nucleus))
        if advance:
            bufs["hist"].index_copy_(0, bufs["step"], bufs["out"][None])
            bufs["step"].add_(1)
            bufs["pos"].add_(1)
            torch.index_select(self.embed, 0, bufs["out"], out=bufs["x"])

    def _step(self, ch: Choice, bufs: dict, sampled: Draw | None, kv_len: int | None = None) -> None:
        """One decode step from the static buffers: replay of the captured graph (captured at the first call of
        this (path, batch, sampled, kv_len), after one eager warm-up step that computes the same values and does not
        advance), or eagerly. kv_len: the unfused step's attention rows (kv_bucket; None on a fused path): the step
        that first reaches a bucket captures its graph, a pause of a warm-up step and a capture mid-generation."""
        if not (self.use_graphs and self.device.type == "cuda"):
            self._compute(ch, bufs, sampled, kv_len=kv_len)
            return
        key = (ch.path, ch.variant, ch.batch, sampled, kv_len)
        g = self._graphs.get(key)
        if g is None:
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):  # warm-up: the same step (it rewrites the same cache rows)
                self._compute(ch, bufs, sampled, advance=False, kv_len=kv_len)
            torch.cuda.current_stream(self.device).wait_stream(s)
            # the unfused buckets' graphs share one pool (as prompt pieces do): what a capture allocates is scratch
            # (the step's results go to `bufs`), and steps never run at once
            pool = None
            if kv_len is not None:
                if self._decode_pool is None:
                    self._decode_pool = torch.cuda.graph_pool_handle()
                pool = self._decode_pool
            before = _graph_baseline(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._compute(ch, bufs, sampled, kv_len=kv_len)
            self._graphs[key] = g
            self._graph_bytes += max(0, torch.cuda.memory_reserved(self.device) - before)
        g.replay()

    def _prefill(self, tok: torch.Tensor, lens: list[int], pieces: list[Piece]) -> torch.Tensor:
        """Prompts tok [B, T] (padded past each length) through every layer, piece by piece, in lockstep; -> the
        hidden state [B, hidden] at each sequence's last prompt position. Padding positions write cache rows past a
        sequence's length, which its decode steps overwrite before reading."""
        B, T = tok.shape
        H = self.shape.hidden
        last = torch.empty(B, H, dtype=self.dtype, device=self.device)
        for pc in pieces:
            ch, s, C = pc.choice, pc.start, pc.length
            self._count("prefill", ch, B, C, real=sum(max(0, min(n, s + C) - s) for n in lens))
            if ch.path == "fused-decode":
                ids = torch.zeros(ch.batch, dtype=torch.long, device=self.device)
                pos = torch.full((ch.batch,), 0, dtype=torch.int32, device=self.device)
                outs = []
                for t in range(s, s + C):
                    ids[:B] = tok[:, t]
                    pos.fill_(t)
                    outs.append(self._layers_decode(self.embed[ids], pos, ch)[:B])
                h = torch.stack(outs, dim=1)
            else:
                h = self._piece(ch, tok[:, s:s + C], s)[:B]
            for b, n in enumerate(lens):
                if s <= n - 1 < s + C:
                    last[b] = h[b, n - 1 - s]
        return last

    def _piece(self, ch: Choice, tok: torch.Tensor, s: int) -> torch.Tensor:
        """Prompt tokens tok [B, C] at positions s .. s + C - 1 through every layer on Choice ch (fused prefill
        chunk or unfused) -> hidden states [batch, C, hidden]. On a GPU the piece is a CUDA graph, captured at the
        first piece of its (path, variant, batch, start, length) after one eager run that computes the same values:
        a short prompt's prefill is otherwise bound by the host launching ~30 kernels per layer. Unfused pieces are
        padded to a power of two (>= 16) within the cache, so few graphs serve every length: the padding tokens
        write cache rows past the prompt, which decode overwrites before it reads them."""
        B, C = tok.shape
        P = C
        if ch.path == "unfused":
            P = max(16, 1 << (C - 1).bit_length())
            if s + P > self.cache_len:
                P = C
        key = ("prefill", ch.path, ch.variant, ch.batch, s, P)
        g = self._graphs.get(key)
        if g is None:
            ids = torch.zeros(ch.batch, P, dtype=torch.long, device=self.device)
            start = torch.full((ch.batch,), s, dtype=torch.int32, device=self.device)
            out = torch.empty(ch.batch, P, self.shape.hidden, dtype=self.dtype, device=self.device)

            def run():
                x = self.embed[ids]
                if ch.path == "unfused":
                    for u in self.unfused:
                        x = u.prefill(x, start, kv_len=s + P)
                else:
                    for layer in self.fused[ch.variant]:
                        x = layer.prefill(x, start, validate=False)
                out.copy_(x)
            ids[:B, :C] = tok
            graphs = sum(k[0] == "prefill" for k in self._graphs)
            if not (self.use_graphs and self.device.type == "cuda") or graphs >= self.max_prefill_graphs:
                run()
                return out[:, :C]
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                run()  # warm-up: the same piece (it rewrites the same cache rows)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._prefill_pool is None:
                # one pool for every piece's graph: what a capture allocates is scratch (the output is `out`), and
                # pieces never run at once
                self._prefill_pool = torch.cuda.graph_pool_handle()
            before = _graph_baseline(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._prefill_pool):
                run()
            # every tensor the graph reads or writes stays referenced with it (a freed `start` would be reused by
            # the allocator under the graph's feet)
            self._graphs[key] = g = (graph, ids, out, start)
            self._graph_bytes += max(0, torch.cuda.memory_reserved(self.device) - before)
        graph, ids, out, _ = g
        ids[:B, :C] = tok
        ids[B:].zero_()
        if P > C:
            ids[:, C:].zero_()
        graph.replay()
        return out[:, :C]

    # -- generate --
    def _check_prompts(self, prompts) -> list[list[int]]:
        if type(prompts).__module__ == "numpy" and hasattr(prompts, "ndim") and prompts.dtype != object:
            try:  # a numpy array is checked as a tensor (its shape and dtype said as such)
                prompts = torch.from_numpy(prompts)
            except TypeError:  # (a dtype torch has no counterpart of: a string array)
                raise ServeError(f"prompts: a 2-d integer array [batch, tokens] (1-d: one sequence) or a list of "
                                 f"token-id lists, got numpy {prompts.dtype} {prompts.shape}") from None
        if not isinstance(prompts, torch.Tensor):  # (a tensor is checked as one below)
            prompts = _listed(prompts)  # (a numpy array of objects: as a list)
        if isinstance(prompts, torch.Tensor):
            if prompts.dim() not in (1, 2) or prompts.dtype.is_floating_point or prompts.dtype.is_complex \
                    or prompts.dtype == torch.bool:
                raise ServeError(f"prompts: a 2-d integer tensor [batch, tokens] (1-d: one sequence) or a list of "
                                 f"token-id lists, got {prompts.dtype} {tuple(prompts.shape)}")
            if prompts.device.type == "meta":
                raise ServeError("prompts: a tensor on the meta device holds no ids (give one on the CPU or a GPU)")
            prompts = prompts.tolist()  # (1-d: a flat list, one sequence, as below)
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ServeError("prompts: a non-empty list of token-id lists (one per sequence)")
        if all(_int(t) for t in prompts):
            prompts = [list(prompts)]  # one sequence given as a flat list
        out = []
        for i, p in enumerate(prompts):
            p = _listed(p)  # one sequence's ids as an array
            if not isinstance(p, (list, tuple)) or not p:
                raise ServeError(f"prompts[{i}]: a non-empty list of token ids, got {p!r:.60}")
            for t in p:
                if not _int(t) or not 0 <= t < self.vocab:
                    raise ServeError(f"prompts[{i}]: token ids must be integers in [0, {self.vocab - 1}], got {t!r}")
            out.append([int(t) for t in p])  # numpy integers as Python ints
        if len(out) > self.max_batch:
            raise ServeError(f"prompts: {len(out)} sequences, but the caches hold max_batch = {self.max_batch} "
                             "(Model.from_hf(max_batch=...))")
        return out

    def stream(self, prompts, max_new_tokens: int = 32, *, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, stop_tokens: Iterable[int] | int | None = None,
               output_logits: bool = False) -> Iterator[tuple[int, int]]:
        """generate() as an iterator of (sequence index, token id), in order as they are produced (a step's tokens
        are read while the next step runs on the GPU). Arguments as generate(). One generation at a time per model
        (they share its KV caches): a second stream() or generate() started before this one is exhausted or closed
        raises ServeError."""
        return self._held(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, output_logits, None,
                          0)

    def _held(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, output_logits, _result,
              _depth) -> Iterator[tuple[int, int]]:
        """stream()'s generator, holding the model for its generation; generate() passes `_result` (a list the
        Generation is appended to) and `_depth` (its frame, for the warnings' stacklevel)."""
        if not self._busy.acquire(blocking=False):
            raise ServeError("another generate() or stream() is under way on this model (they share its KV caches): "
                             "exhaust or close() that stream first")
        held = [True]

        def release():  # this stream's hold only, once: at its last GPU work (before its last tokens) or its end
            if held[0]:
                held[0] = False
                self._busy.release()
        try:
            yield from self._stream(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens,
                                    output_logits, _result, _depth, release)
        finally:
            release()

    @torch.no_grad()
    def _stream(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, output_logits, _result,
                _depth, release):
        prompts = self._check_prompts(prompts)
        if not isinstance(output_logits, (bool, int)) and type(output_logits).__name__ != "bool_":
            raise ServeError(f"output_logits: True or False, got {output_logits!r:.40}")
        B = len(prompts)
        lens = [len(p) for p in prompts]
        check_length(lens, max_new_tokens, self.cache_len)
        max_new_tokens = int(max_new_tokens)  # (numpy's integers too)
        temps, ks, ps, seeds = self._check_sampling(B, temperature, top_k, top_p, seed)
        raw_seed = _listed(seed)  # (the argument, not _check_sampling's per-sequence seeds: any not the default 0)
        seeded = any(raw_seed) if isinstance(raw_seed, (list, tuple)) else raw_seed != 0
        if not any(temps) and (any(ks) or min(ps) < 1 or seeded) and "greedy" not in self._warned:
            self._warned.add("greedy")  # as transformers warns where do_sample is off
            given = " / ".join(f"{nm} {v}" for nm, v, on in (("top_k", top_k, any(ks)), ("top_p", top_p, min(ps) < 1),
                                                             ("seed", seed, seeded)) if on)  # (the settings not off)
            warnings.warn(f"temperature 0 decodes greedily: {given} {'has' if '/' not in given else 'have'} no effect "
                          "(set a temperature > 0 to sample)", stacklevel=4 + _depth)
        if isinstance(stop_tokens, (str, bytes)):  # (iterated, its characters would read as ids)
            raise ServeError(f"stop_tokens: integer token ids in [0, {self.vocab - 1}], got {stop_tokens!r}")
        stop_tokens = _listed(stop_tokens)
        if _int(stop_tokens):
            stop_tokens = [stop_tokens]  # one id, as transformers' eos_token_id takes it
        elif stop_tokens is not None and not isinstance(stop_tokens, Iterable):
            raise ServeError(f"stop_tokens: integer token ids in [0, {self.vocab - 1}], got {stop_tokens!r}")
        stops = list(self.eos if stop_tokens is None else stop_tokens)
        for t in stops:  # (before the set: a nested list is unhashable)
            if isinstance(t, (list, tuple)):  # the whole value: its inner list alone reads as a valid one
                raise ServeError(f"stop_tokens: one flat list of integer token ids in [0, {self.vocab - 1}], got "
                                 f"{stop_tokens!r:.60}")
            if not _int(t) or (stop_tokens is not None and not 0 <= t < self.vocab):
                raise ServeError(f"stop_tokens: integer token ids in [0, {self.vocab - 1}], got {t!r}")
        stops = set(stops)
        far = [t for t in self.eos if not 0 <= t < self.vocab] if stop_tokens is None else []
        if far and "eos" not in self._warned:  # (kept, as transformers keeps them: they stop nothing)
            self._warned.add("eos")
            warnings.warn(f"eos_token_id {', '.join(map(str, far))}: outside the vocabulary ({self.vocab} tokens), "
                          "never generated: no sequence stops on it", stacklevel=4 + _depth)
        if (self.max_positions is not None and (longest := max(lens) + max_new_tokens - 1) > self.max_positions
                and "positions" not in self._warned):
            self._warned.add("positions")  # (once a model, as the other warnings of a call)
            warnings.warn(PositionWarning(f"up to {longest} positions (the longest prompt + max_new_tokens - 1), past "
                                          f"{self.positions_words}: positions past it were never trained"),
                          stacklevel=4 + _depth)  # (once the call is accepted)
        # the draw's shape, fixed for the generation (Draw; None: greedy): a graph each
        sampled = self._draw_shape(temps, ks, ps)
        t0 = time.perf_counter()  # the time to first token counts the planning too
        dch = decode_choice(B, self.decode_variants, self.routes, self.cache_len, self.unfused is not None)
        key = (max(lens), B)
        if key not in self._plans:  # a prompt length's plan is fixed for the model: computed once
            self._plans[key] = prefill_plan(max(lens), B, self.prefill_variants, self.routes, decode=dch,
                                            max_unfused=self.max_unfused_chunk, unfused=self.unfused is not None,
                                            costs=self.route_costs)
        pieces = self._plans[key]
        for pc in pieces:
            self._warn_missing(pc.choice, _depth)
        if max_new_tokens > 1:
            self._warn_missing(dch, _depth)
        dev = self.device
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)  # noqa: E731
        bufs = self._buffers(dch)
        V = dch.batch
        pad = V - B
        bufs["temp"].copy_(torch.tensor(temps + [0.0] * pad))  # (padding: greedy)
        bufs["topk"].copy_(torch.tensor(ks + [0] * pad))
        bufs["topp"].copy_(torch.tensor(ps + [1.0] * pad))
        bufs["seed"].copy_(torch.tensor(seeds + [0] * pad))
        T = max(lens)
        tok = torch.tensor([p + [0] * (T - len(p)) for p in prompts], dtype=torch.long).to(dev)
        last = self._prefill(tok, lens, pieces)
        logits, first = self._logits(last)
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        if sampled:
            first = sample_tokens(logits, bufs["temp"][:B], bufs["topk"][:B], bufs["topp"][:B], bufs["seed"][:B],
                                  lens_t, candidates=sampled.candidates, nucleus=sampled.nucleus)
        all_logits = [logits.clone()] if output_logits else None
        torch.index_select(self.embed, 0, torch.cat([first, first.new_zeros(pad)]), out=bufs["x"])
        bufs["pos"].copy_(torch.tensor(lens + [0] * pad, dtype=torch.int32))
        bufs["step"].zero_()
        first_host = first.tolist()
        sync()
        ttft = time.perf_counter() - t0
        new: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B

        counted = [0]  # decode steps counted in the stats (each when its row is delivered)
        freed = [False]

        def finish():  # once: this generation's GPU work waited for while the model is still held, then freed (no
            if not freed[0]:  # device-wide wait after: another thread's generation may be capturing a graph by then)
                freed[0] = True
                sync()
                release()

        def deliver(row, count=False):  # count: a decode step's row (stats: its live sequences' tokens are real)
            live = B - sum(done)
            if count:
                self._count("decode", dch, live)
                counted[0] += 1
            got = []
            for b in range(B):
                if not done[b]:
                    new[b].append(row[b])
                    done[b] = row[b] in stops
                    got.append((b, row[b]))
            if all(done):  # the last tokens: the model is free once a step in flight ends (a consumer that takes
                finish()  # the stop token and no more leaves this generator paused: not holding)
            yield from got
        n = max_new_tokens - 1
        if n == 0 or all(t in stops for t in first_host):  # no decode step follows: the model is free
            finish()
        yield from deliver(first_host)
        t1 = time.perf_counter()
        pinned = dev.type == "cuda"
        host = torch.empty(max(n, 1), V, dtype=torch.long, pin_memory=pinned)
        side = torch.cuda.Stream(dev) if pinned else None  # the tokens' copies: off the steps' stream
        events = []
        steps = 0
        try:
            for i in range(n):
                if all(done):
                    break
                # (step i: sequence b at position lens[b] + i, padding at i)
                rows = kv_bucket(T + i + 1, self.cache_len) if dch.path == "unfused" else None
                self._step(dch, bufs, sampled, rows)
                steps += 1
                if output_logits:
                    all_logits.append(bufs["logits"][:B].clone())
                if pinned:  # step i's row once step i is done; the next steps run meanwhile (they write other rows)
                    side.wait_stream(torch.cuda.current_stream(dev))
                    with torch.cuda.stream(side):
                        host[i].copy_(bufs["hist"][i], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record()
                    events.append(ev)
                    if i >= 1:  # the previous step's tokens, read while this one runs
                        events[i - 1].synchronize()
                        yield from deliver(host[i - 1].tolist(), count=True)
                else:  # off the GPU nothing overlaps: each step's tokens at once (no step after a stop token)
                    host[i].copy_(bufs["hist"][i])
                    if i == n - 1:
                        finish()
                    yield from deliver(host[i].tolist(), count=True)
            if steps and pinned:  # the last step's tokens (nothing new where every sequence had stopped)
                finish()  # (a consumer that takes exactly the last token leaves this generator paused: not holding)
                yield from deliver(host[steps - 1].tolist(), count=True)
        finally:  # a stream closed (or a callback raising) with a launched step undelivered: counted all the same
            for _ in range(steps - counted[0]):
                self._count("decode", dch, B - sum(done))
        decode_s = time.perf_counter() - t1
        gen_tokens = sum(len(x) for x in new) - B
        if all_logits is not None:  # (the step after the last stop ran before the host saw that stop: not a token)
            del all_logits[max(len(x) for x in new):]
        if _result is not None:
            _result.append(Generation(
                tokens=new, sequences=[p + x for p, x in zip(prompts, new)], ttft_s=ttft, decode_s=decode_s,
                tokens_per_s=gen_tokens / decode_s if decode_s > 0 else 0.0, decode_choice=dch,
                prefill_pieces=pieces, logits=all_logits))

    def generate(self, prompts, max_new_tokens: int = 32, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop_tokens: Iterable[int] | int | None = None,
                 callback: Callable[[int, int], None] | None = None, output_logits: bool = False) -> Generation:
        """Generate up to max_new_tokens tokens for each prompt.

        prompts: a list of token-id lists of any lengths (or one flat list, or a 1-d / 2-d int tensor or numpy
        array), at most max_batch of them, ids in [0, vocab). Each sequence sits at its own position: prefill runs
        the fused prefill variants (or unfused, per dispatch), then decode steps run as one CUDA graph each.
        temperature 0: greedy; > 0: sampled with top_k (0: off) and top_p (1: off), reproducible from `seed` (sequence b uses
        seed + 7919 b). Each of temperature, top_k, top_p and seed may also be a list of one value per sequence
        (a server's requests: sequence b then uses seed[b] and draws as it would alone, but where more logits tie
        at its k-th than the batch's candidates hold, or within an fp32 rounding of its top-p cut, since the batch
        decides the draw's shape); a batch whose sequences mix top-k on and off sorts the vocabulary
        (Model.draw_path says which draw runs).
        stop_tokens: a sequence ends after producing one (an id or several; default: the checkpoint's eos_token_id as
        transformers reads it: generation_config.json's where the directory holds one, else config.json's; [] stops
        only at max_new_tokens).
        callback(seq, token) is called for every token as it arrives (stream() is the iterator form; the model is
        free for the next generation once the last token is produced). Returns a Generation. ServeError
        (one line) for a bad argument, when the longest prompt + max_new_tokens - 1 exceeds cache_len, or when
        another generate()/stream() is under way on the model (a callback may not start one)."""
        if callback is not None and not callable(callback):
            raise ServeError(f"callback: a function callback(seq, token), got {callback!r:.60}")
        res: list = []
        for b, t in self._held(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, output_logits,
                               res, 1):
            if callback is not None:
                callback(b, t)
        return res[0]
