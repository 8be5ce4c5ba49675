"""The served model's sampled draw after the head, in one launch (templates/sample.cu): serve.sample_tokens' tokens.

serve.sample_tokens (the reference, and the path where this one does not serve) is ~30 torch launches a step: the
temperature, torch.topk, the mask, the softmax, the cumulative sum, the noise's hash over int64 tensors, the Gumbel
scores and two argmaxes — ~190 µs of a Llama-3.2-1B step on the H200 at batch 1 (bench/NOTES.md session 40), where
the greedy step's whole head takes ~130. Here one kernel draws and advances the decode step as the fused head's
greedy step does (lm_head.Advance): with top-k (and top-p) its blocks select the row's top-k logits by radix select
(no torch.topk: its ~45 µs of launches), sort them and draw; top-p without top-k ranks the NUCLEUS_CANDIDATES largest
(sample_tokens sorts the whole vocabulary: ~0.27 ms of a 128 K vocabulary's step) and, in a row where they hold less
than top_p of the probability, finds the cut over the whole row instead; with top-k off and top-p 1, nothing is
ranked.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .lm_head import Advance
from .targets import DTYPES

THREADS = 256  # templates/sample.cu: THREADS
IDS_PER_BLOCK = 4096  # logits a block takes (templates/sample.cu: SLICE; ~32 blocks a 128 K vocabulary's row)
MAX_CANDIDATES = 4096  # sample_topk's kept logits sorted in shared memory (8 bytes each): top_k up to 2,048
MAX_VOCAB = 128 * IDS_PER_BLOCK  # sample_topk's slices' counts of a row in shared memory (templates: MAX_SLICES)
# the logits a row with top-k off and top-p < 1 ranks: its cut lies among them where they hold top_p or more of the
# row's probability (a trained model's nucleus at top-p 0.9 is far smaller), else the row's last block finds it over
# the whole row (the same cut either way, to the probabilities' fp32 rounding; bench/NOTES.md session 41 times both)
NUCLEUS_CANDIDATES = 256


def supported(candidates: int, nucleus: bool, vocab: int) -> str | None:
    """None where Sampler serves a draw of this shape (Sampler.__call__'s candidates and nucleus) over `vocab`
    logits, else why not."""
    if candidates <= 0 and nucleus:
        return "top-p without candidates to rank (NUCLEUS_CANDIDATES)"
    if candidates > MAX_CANDIDATES:
        return f"top-k above {MAX_CANDIDATES // 2}: {candidates} candidates"
    if candidates > 0 and vocab > MAX_VOCAB:
        return f"vocabulary {vocab} > {MAX_VOCAB}"
    return None


def source(hidden: int, dtype: str) -> str:
    """The kernels' whole CUDA source for embedding rows of `hidden` (a multiple of 8) elements of `dtype`."""
    from .render import TEMPLATES, _inline
    dt = DTYPES[dtype]
    cfg = (f"#define MEGAKERNEL_CONFIG 1\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"
           f"constexpr int HIDDEN = {hidden};\ntypedef {dt.ctype} T;\ntypedef {dt.ctype2} T2;\n"
           f"constexpr float T_MAX = {dt.max_finite!r}f;\n#define DTYPE_BF16 {1 if dtype == 'bf16' else 0}\n"
           f"#define MMA_AB \"{dt.mma}\"\n")  # (common.cuh's helpers need the whole dtype config)
    return _inline(cfg + (TEMPLATES / "sample.cu").read_text(), TEMPLATES, set())


class Sampler:
    """next = serve.sample_tokens(logits, temp, topk, topp, seed, pos + 1) for rows whose temperature is > 0 (rows at
    0 keep `next`, the head's greedy tokens), in one kernel, and the served decode step's advance where given
    (lm_head.Advance). Top-k keeps the logits >= the row's k-th largest (ties included), at most the candidates'
    count rounded up to a power of two (they differ only where more logits tie at the k-th than that); a row with
    top-k off and top-p < 1 keeps sample_tokens' set whatever its candidates (its cut is found over the whole row
    where they hold less than top_p).

    hidden, dtype: the embedding rows' (the advance's x_next = embed[next]); device: a CUDA device. Compiled at
    construction into build_dir's object cache, as lm_head.LMHead is. The same draw as sample_tokens: the same noise
    (serve.uniform_noise's hash), fp32 arithmetic in its order but for the softmax's sum and the cumulative sum. Where
    the two may keep different tokens (a helper's emulation, 12,000 random draws: 28 differed, all the third): a
    token within an fp32 rounding of the top-p cut (the whole row's cut sums probabilities in fixed point, 2^-40
    units, where torch's cumulative sum rounds in fp32); more logits tied at the k-th than the candidates hold (the
    kernel keeps the lowest ids, torch.topk some); logits tied at the top-p cut (the kernel ranks the lowest id first,
    torch's sort in no set order); and -0 against +0 (the kernel ranks their bits). Both rank the logits divided by
    the temperature. One launch at a time (its counters are shared). Raises ValueError (shapes, dtypes) and
    CompileError.
    """

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device | str, *,
                 build_dir: str | Path = "build", arch: str | None = None):
        if hidden % 8:
            raise ValueError(f"Sampler: hidden {hidden} is not a multiple of 8")
        names = [n for n, d in DTYPES.items() if getattr(torch, d.torch) == dtype]
        if not names:
            raise ValueError(f"Sampler: dtype {dtype} (bf16/fp16: the embedding rows' copy)")
        import cupy
        from cupy_backends.cuda.api import driver

        from . import compile as gcompile
        from .loader import env_flag, pdl_config
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"Sampler: a CUDA device, got {self.device}")
        if self.device.index is None:  # (tensors name their device's index: "cuda" is the current one)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.hidden, self.dtype = hidden, dtype
        arch = arch or "%d%d" % torch.cuda.get_device_capability(self.device)
        src = source(hidden, names[0])
        key = gcompile.cache_key(src, arch)
        self.meta, _ = gcompile.compiled_object(src, key, arch, Path(build_dir))
        with cupy.cuda.Device(self.device.index):
            self._module = cupy.RawModule(path=str(Path(build_dir) / "objects" / key / "kernel.cubin"))
            fns = {n: self._module.get_function(n) for n in ("sample_topk", "sample_gumbel")}
            fns["sample_topk"].max_dynamic_shared_size_bytes = max(MAX_CANDIDATES * 8, THREADS * 16 * 8)
            self._fns = {n: f.kernel for n, f in fns.items()}
        self._driver = driver
        self.counter = torch.zeros(1, dtype=torch.int32, device=self.device)  # the kernels leave it at 0
        self._scratch: dict[tuple, dict[str, torch.Tensor]] = {}  # by (rows, slices, candidates): see scratch()
        self.pdl = torch.cuda.get_device_capability(self.device) >= (9, 0) and env_flag("MEGAKERNEL_PDL", True)
        self._pdl_config = pdl_config
        self._configs: dict[tuple[int, int], object] = {}  # PDL launch configurations by (grid, smem), made once

    def __call__(self, logits: torch.Tensor, temp: torch.Tensor, topk: torch.Tensor, topp: torch.Tensor,
                 seed: torch.Tensor, pos: torch.Tensor, next_tokens: torch.Tensor, *, candidates: int,
                 nucleus: bool, advance: Advance | None = None) -> torch.Tensor:
        """logits [B, vocab] float32; temp, topp [B] float32; topk, seed [B] int64 (seeds in [0, 2^62)); pos [B]
        int32 (the step's positions: the noise's step is pos + 1, the position the token takes); next_tokens [B]
        int64, in: the greedy tokens, out: the draw (returned). candidates > 0: the logits a row ranks (rounded up to
        a power of two), every sampled row's (temperature > 0) top_k in 1..candidates or off (<= 0: top-p over the
        whole vocabulary); candidates 0 with nucleus False: top-k off and top-p 1 in every sampled row (nothing
        ranked). A row's top_p 1 is off (no cut), as sample_tokens'.
        On torch's current stream; capturable in a CUDA graph once the draw shape (rows, candidates) has run outside
        one (its scratch is made then: scratch()). Raises ValueError where supported() refuses the draw's shape or a
        tensor is not as above."""
        B, V = logits.shape if logits.dim() == 2 else (-1, -1)
        if not isinstance(candidates, int) or candidates < 0 or V < 1:
            raise ValueError(f"Sampler: candidates a count >= 0 and logits [B, vocab >= 1], got {candidates!r} and "
                             f"{tuple(logits.shape)}")
        why = supported(candidates, nucleus, V)
        if why:
            raise ValueError(f"Sampler: {why}")
        ok = B >= 1 and logits.dtype == torch.float32 and logits.is_contiguous() and all(
            t.shape == (B,) and t.device == logits.device == self.device and t.is_contiguous() for t in
            (temp, topk, topp, seed, pos, next_tokens)) and temp.dtype == topp.dtype == torch.float32 and \
            topk.dtype == seed.dtype == next_tokens.dtype == torch.int64 and pos.dtype == torch.int32
        if not ok:
            raise ValueError(f"Sampler: logits [B, vocab] float32, temp/top_p [B] float32, top_k/seed/next [B] int64 "
                             f"and pos [B] int32, contiguous on {self.device}; got logits {tuple(logits.shape)} "
                             f"{logits.dtype} {logits.device}")
        if advance is not None:
            hist, step, apos, embed, x_next = advance
            if apos.data_ptr() != pos.data_ptr() or hist.dim() != 2 or hist.shape[1] != B or \
                    hist.dtype != torch.int64 or step.shape != (1,) or step.dtype != torch.int64 or \
                    embed.dim() != 2 or embed.shape[0] < V or embed.shape[1] != self.hidden or \
                    embed.dtype != self.dtype or x_next.shape != (B, self.hidden) or x_next.dtype != self.dtype or \
                    not all(t.is_contiguous() and t.device == self.device for t in advance) or \
                    embed.data_ptr() % 16 or x_next.data_ptr() % 16:
                raise ValueError(f"Sampler: advance (hist [steps, {B}] int64, step [1] int64, pos: the draw's pos, "
                                 f"embed [>= {V}, {self.hidden}] and x_next [{B}, {self.hidden}] {self.dtype}, "
                                 f"16-byte aligned) contiguous on {self.device}")
        adv = [0] * 5 if advance is None else [t.data_ptr() for t in advance]
        # (hist, step, pos, embed, x_next) as the kernels take them
        tail = [ctypes.c_uint64(adv[0]), ctypes.c_uint64(adv[1]), ctypes.c_uint64(pos.data_ptr()),
                ctypes.c_uint64(adv[3]), ctypes.c_uint64(adv[4])]
        G = max(1, -(-V // IDS_PER_BLOCK))
        if candidates > 0:
            C = 1 << (min(candidates, V) - 1).bit_length()  # (a power of two: the kernel's sort)
            sc = self.scratch(B, G, C)
            args = [ctypes.c_uint64(logits.data_ptr()), ctypes.c_int32(V), ctypes.c_int32(G), ctypes.c_int32(C),
                    ctypes.c_uint64(temp.data_ptr()), ctypes.c_uint64(topk.data_ptr()),
                    ctypes.c_uint64(topp.data_ptr()), ctypes.c_uint64(seed.data_ptr()),
                    ctypes.c_uint64(next_tokens.data_ptr()), ctypes.c_int32(B), ctypes.c_uint64(sc["cand"].data_ptr()),
                    ctypes.c_uint64(sc["cnt"].data_ptr()), ctypes.c_uint64(sc["zs"].data_ptr()),
                    ctypes.c_uint64(sc["rowdone"].data_ptr()),
                    ctypes.c_uint64(self.counter.data_ptr()), *tail]
            # (dynamic shared memory: the kept logits sorted, C x 8 bytes, or a whole row's cut: THREADS x 16 x 8)
            self._launch("sample_topk", G * B, args, smem=max(C * 8, THREADS * 16 * 8))
        else:
            sc = self.scratch(B, G, 0)
            args = [ctypes.c_uint64(logits.data_ptr()), ctypes.c_int32(V), ctypes.c_int32(G),
                    ctypes.c_uint64(temp.data_ptr()), ctypes.c_uint64(seed.data_ptr()),
                    ctypes.c_uint64(next_tokens.data_ptr()), ctypes.c_int32(B),
                    ctypes.c_uint64(sc["rowmax"].data_ptr()), ctypes.c_uint64(self.counter.data_ptr()), *tail]
            self._launch("sample_gumbel", G * B, args)
        return next_tokens

    def scratch(self, rows: int, slices: int, candidates: int) -> dict[str, torch.Tensor]:
        """The kernels' scratch for a draw shape, made at its first draw and kept (a CUDA graph captured with it
        keeps its addresses; nothing is freed or grown under it): rowmax [rows] int64 (sample_gumbel's row maxima),
        rowdone [rows] int32 (sample_topk's slices' arrivals), both left at 0 by the kernels; cand [rows x slices x
        candidates] int64, cnt [rows x slices] int32 and zs [rows x slices] float32 pairs (sample_topk's slices'
        kept logits, their counts, and a top-k-off row's slices' maxima and sums of exp).
        Raises RuntimeError where a new one would be made during a CUDA graph's capture (draw once before it)."""
        key = (rows, slices, candidates)
        if key not in self._scratch:
            with torch.cuda.device(self.device):
                capturing = torch.cuda.is_current_stream_capturing()
            if capturing:
                raise RuntimeError(f"Sampler: a draw of {rows} rows and {candidates} candidates captured before it "
                                   "ran once: draw it once outside the capture (its scratch is made then)")
            z = dict(dtype=torch.int32, device=self.device)
            self._scratch[key] = {"rowmax": torch.zeros(rows, dtype=torch.int64, device=self.device),
                                  "rowdone": torch.zeros(rows, **z),
                                  "cand": torch.empty(rows * slices * max(candidates, 1), dtype=torch.int64,
                                                      device=self.device),
                                  "cnt": torch.zeros(rows * slices, **z),
                                  "zs": torch.zeros(rows * slices * 2, device=self.device)}
        return self._scratch[key]

    def scratch_bytes(self) -> int:
        """Bytes of every draw shape's scratch made so far (scratch())."""
        return sum(t.numel() * t.element_size() for sc in self._scratch.values() for t in sc.values()) + 4

    def _launch(self, name: str, grid: int, args: list, smem: int = 0) -> None:
        params = (ctypes.c_void_p * len(args))(*map(ctypes.addressof, args))
        stream = torch.cuda.current_stream(self.device).cuda_stream
        fn = self._fns[name]
        with torch.cuda.device(self.device):
            if self.pdl:  # the kernels wait (griddepcontrol.wait) before their first load
                from .loader import launch_pdl
                cfg = self._configs.get((grid, smem))
                if cfg is None:
                    cfg = self._configs[grid, smem] = self._pdl_config(grid, THREADS, smem, cooperative=False)
                launch_pdl(cfg, stream, fn.ptr, ctypes.addressof(params))
            else:
                self._driver.launchKernel(fn.ptr, grid, 1, 1, THREADS, 1, 1, smem, stream, ctypes.addressof(params),
                                          0)
