"""The served model's head kernel (generator.lm_head: final RMSNorm -> LM head -> greedy token): it compiles without
spills for the shapes a served model has (CPU: nvcc), and on a GPU its logits and tokens equal the fp64 reference
of what transformers computes, every logit written, ties going to the first index, graph replays equal."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from generator import compile as gcompile, lm_head

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("hidden,maxb,dtype", [(2048, 1, "bf16"), (896, 8, "bf16"), (8192, 8, "fp16")])
def test_head_compiles_without_spills(tmp_path, hidden, maxb, dtype):
    src = lm_head.source(hidden, maxb, dtype)
    assert '#include "' not in src
    meta, cached = gcompile.compiled_object(src, gcompile.cache_key(src, "90"), "90", tmp_path)
    assert not cached and meta["spill_stores"] == 0 and meta["spill_loads"] == 0, meta
    assert meta["registers"] <= 168  # KS 16 above hidden 2048: one block of 8 warps an SM, as measured
    assert gcompile.compiled_object(src, gcompile.cache_key(src, "90"), "90", tmp_path)[1]  # cached now


def test_launch_geometry_is_the_templates():
    import re
    src = lm_head.source(2048, 1, "bf16")
    assert int(re.search(r"constexpr int WARPS = (\d+)", src).group(1)) == lm_head.WARPS
    assert int(re.search(r"#define LMH_R (\d+)", src).group(1)) == lm_head.ROWS_PER_WARP[1]


def test_which_heads_are_served():
    assert lm_head.supported(1, 2048, "rmsnorm", torch.bfloat16) is None
    assert lm_head.supported(1, 4096, "rmsnorm", torch.float16) is None
    assert "RMSNorm only" in lm_head.supported(1, 2048, "layernorm", torch.bfloat16)
    assert "a GEMM" in lm_head.supported(9, 2048, "rmsnorm", torch.bfloat16)
    assert lm_head.supported(8, 2048, "rmsnorm", torch.bfloat16) is None
    assert [lm_head.kernel_rows(b) for b in (1, 2, 8)] == [1, 8, 8]
    assert "float32" in lm_head.supported(1, 2048, "rmsnorm", torch.float32)
    assert "multiple of 8" in lm_head.supported(1, 2044, "rmsnorm", torch.bfloat16)


def reference(x, gain, W, eps):
    """transformers' LlamaRMSNorm (rounded to the model dtype, then times the gain in that dtype), then the head
    summed exactly (fp64): what the kernel computes before it rounds the logits to the model dtype."""
    xf = x.float()
    h = gain * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return h.double() @ W.double().T


def rounding_slack(x, gain, W, eps):
    """[B, vocab] fp64: how far a logit may move where the kernel's x * rsqrt(...) rounds to the model dtype the
    other way than torch's. The two 1/rms differ by a few fp32 ulps (their sums' order), so an element within 2^-18
    of a rounding midpoint may round to its other neighbour, and h_k = gain_k * that (rounded again) moves by up to
    two of its ulps: |h_k' - h_k| |W[v, k]| (every element of x with that mantissa moves with it). Measured on the
    H200: such flips put up to 275 logits of a row past the test's one-rounding bound, ~1 run in 100."""
    xf = x.float()
    xr = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).double()
    t = xr.to(x.dtype).double()
    mant = {torch.bfloat16: 7, torch.float16: 10}[x.dtype]
    mt, et = torch.frexp(t)
    ulp = torch.ldexp(torch.ones_like(t), et - 1 - mant)
    ulp = torch.where((mt.abs() == 0.5) & (xr.abs() < t.abs()), ulp / 2, ulp)  # below a power of two: half as wide
    near = ((xr - t).abs() - ulp / 2).abs() <= xr.abs() * 2.0 ** -18
    other = (t + torch.where(xr > t, ulp, -ulp)).to(x.dtype)  # the other neighbour (exact in the dtype)
    moved = ((gain * other).double() - (gain * t.to(x.dtype)).double()).abs() * near
    return moved @ W.double().abs().T


@gpu
@needs_cuda
@pytest.mark.parametrize("hidden,vocab,dtype,batch", [(2048, 32000 + 13, torch.bfloat16, 1),
                                                     (2048, 32000 + 13, torch.bfloat16, 5),
                                                     (896, 10007, torch.bfloat16, 8), (1032, 5003, torch.float16, 1),
                                                     (1032, 5003, torch.float16, 3)])
def test_gpu_head_equals_the_reference(tmp_path, hidden, vocab, dtype, batch):
    """batch 1: the FMA kernel; 2..8: the tensor-core kernel (hidden 1032: a k step past the end)."""
    seed = torch.seed() % 2**31  # fresh inputs every run
    g = torch.Generator(device="cuda").manual_seed(seed)
    W = (torch.randn(vocab, hidden, device="cuda", generator=g) / hidden ** 0.5).to(dtype)
    W[vocab - 1] = W[5]  # an exact tie: argmax takes the first index
    gain = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dtype)
    head = lm_head.LMHead(gain, W, 1e-5, batch, build_dir=Path(tmp_path))
    nb = batch
    for scale in (0.01, 1.0, 40.0):  # inputs of different rms (each row its own)
        x = (torch.randn(nb, hidden, device="cuda", generator=g) * scale
             * (1 + torch.arange(nb, device="cuda")[:, None])).to(dtype)
        logits = torch.full((nb, vocab), float("nan"), device="cuda")
        nxt = torch.full((nb,), -1, dtype=torch.int64, device="cuda")
        head(x, logits, nxt)
        torch.cuda.synchronize()
        assert not logits.isnan().any(), f"seed {seed}: a logit was not written"
        ref = reference(x, gain, W, 1e-5)
        err = ((logits.double() - ref).norm() / ref.norm()).item()
        assert err <= 4e-3, f"seed {seed}: relative error {err:.2e}"  # the logits' rounding to bf16/fp16
        assert torch.equal(logits, logits.to(dtype).float()), f"seed {seed}: logits rounded to the model dtype"
        # within one rounding of the exact sum: a wrong row, column or k chunk is far outside it
        bad = (logits.double() - ref).abs() > ref.abs() * 2 ** -7 + 1e-4 * ref.abs().max() + \
            rounding_slack(x, gain, W, 1e-5)  # fp32 sums' error, and h's rounding at a midpoint
        assert not bad.any(), f"seed {seed}: {bad.sum().item()} logits off, first at {bad.nonzero()[0].tolist()}"
        assert torch.equal(nxt, logits.argmax(-1)), f"seed {seed}: next is the first index of the largest logit"
        assert head.counter.item() == 0, f"seed {seed}"  # left for the next launch (a graph replays it as is)
    # a tie on the largest logit: W's rows 5 and vocab-1 are equal, and x = row 5 makes it the largest by far
    x = W[5:6].clone().repeat(batch, 1)
    _, nxt = head(x)
    assert nxt.tolist() == [5] * x.shape[0], f"seed {seed}: {nxt.tolist()}"
    # every logit negative (the argmax key's other branch): -|W| rows against a positive x and gain
    Wn = -W.abs()
    neg = lm_head.LMHead(gain.abs(), Wn, 1e-5, batch, build_dir=Path(tmp_path))
    x = torch.rand(batch, hidden, device="cuda", generator=g).to(dtype) + 0.1
    lg, nx = neg(x)
    assert (lg < 0).all() and torch.equal(nx, lg.argmax(-1)), f"seed {seed}"
    # a CUDA graph replays it with the same results
    x = torch.randn(batch, hidden, device="cuda", generator=g).to(dtype)
    want_l, want_n = head(x)
    lg, nx = torch.empty_like(want_l), torch.empty_like(want_n)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        head(x, lg, nx)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        head(x, lg, nx)
    for _ in range(3):
        lg.fill_(float("nan"))
        nx.fill_(-1)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(lg, want_l) and torch.equal(nx, want_n), f"seed {seed}: graph replay"
    # the served step's advance (lm_head.Advance), replayed in a graph as generator.serve does: each replay chooses
    # from the same x, so every history row written is that token, step and pos count the replays and x_next is the
    # token's embedding row
    embed = torch.randn(vocab + 3, hidden, device="cuda", generator=g).to(dtype)  # (more rows than the head's)
    hist = torch.full((4, batch), -1, dtype=torch.int64, device="cuda")
    step = torch.zeros(1, dtype=torch.int64, device="cuda")
    pos = torch.arange(batch, dtype=torch.int32, device="cuda") * 7
    x_next = torch.full((batch, hidden), float("nan"), device="cuda").to(dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        head(x, lg, nx, lm_head.Advance(hist, step, pos, embed, x_next))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(nx, want_n) and step.item() == 3, f"seed {seed}: advance {nx.tolist()} {want_n.tolist()}"
    assert torch.equal(hist[:3], want_n.repeat(3, 1)) and (hist[3] == -1).all(), \
        f"seed {seed}: rows 0-2 written, row 3 not"
    assert pos.tolist() == [7 * b + 3 for b in range(batch)], f"seed {seed}: {pos.tolist()}"
    assert torch.equal(x_next, embed[want_n]), f"seed {seed}: x_next is the chosen tokens' embedding rows"


@gpu
@needs_cuda
def test_gpu_head_refuses_bad_inputs_in_one_line(tmp_path):
    W = torch.randn(100, 64, device="cuda").to(torch.bfloat16)
    gain = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    head = lm_head.LMHead(gain, W, 1e-6, 1, build_dir=tmp_path)
    for x in (torch.randn(2, 64, device="cuda").to(torch.bfloat16), torch.randn(1, 64, device="cuda"),
              torch.randn(1, 2, 32, device="cuda").to(torch.bfloat16),
              torch.randn(1, 63, device="cuda").to(torch.bfloat16)):
        with pytest.raises(ValueError, match="LMHead: x must be"):
            head(x)
    with pytest.raises(ValueError, match="bf16/fp16 only"):
        lm_head.LMHead(gain.float(), W.float(), 1e-6, 1, build_dir=tmp_path)
    x = torch.randn(1, 64, device="cuda").to(torch.bfloat16)
    hist, step = torch.zeros(8, 1, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")
    pos = torch.zeros(1, dtype=torch.int32, device="cuda")
    embed, x_next = torch.randn(100, 64, device="cuda").to(torch.bfloat16), torch.empty_like(x)
    for adv in (lm_head.Advance(hist, step, pos.long(), embed, x_next), lm_head.Advance(hist, step, pos, embed[:99],
                x_next), lm_head.Advance(hist, step, pos, embed.float(), x_next),
                lm_head.Advance(hist, step, pos, embed, x), lm_head.Advance(hist[0], step, pos, embed, x_next),
                lm_head.Advance(hist, step.int(), pos, embed, x_next)):
        with pytest.raises(ValueError, match=r"^LMHead: advance \(hist \[steps, 1\] int64"):
            head(x, advance=adv)


def test_editing_the_head_leaves_layer_builds_current(tmp_path):
    """The head's objects are keyed by its own source: its template is not one of the layers' kernel sources."""
    import shutil
    from generator import manifest as gmanifest
    root = Path(__file__).resolve().parent.parent
    for rel in gmanifest.KERNEL_SOURCES:
        src, dst = root / rel, tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy(src, dst)
    before = gmanifest.kernel_sources_digest(tmp_path)
    for name in ("lm_head.cu", "sample.cu", "argmax.cuh"):  # (the draw's kernels, their shared argmax)
        (tmp_path / "templates" / name).write_text("// edited\n")
        assert gmanifest.kernel_sources_digest(tmp_path) == before
    (tmp_path / "templates" / "common.cuh").write_text("// edited\n")
    assert gmanifest.kernel_sources_digest(tmp_path) != before
