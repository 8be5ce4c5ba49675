"""The served model's sampled draw as one kernel (generator.sampler): it compiles without spills (CPU: nvcc), and on
a GPU it draws serve.sample_tokens' tokens (the reference: transformers' warpers, the Gumbel-max draw) for every
draw shape it serves, keeps the greedy token of temperature-0 rows, advances the step as the fused head does, and
replays in a CUDA graph."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from generator import compile as gcompile, lm_head, sampler, serve

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("hidden,dtype", [(2048, "bf16"), (896, "fp16"), (8192, "bf16")])
def test_sampler_compiles_without_spills(tmp_path, hidden, dtype):
    src = sampler.source(hidden, dtype)
    meta, _ = gcompile.compiled_object(src, gcompile.cache_key(src, "90"), "90", tmp_path)
    assert meta["spill_stores"] == 0 and meta["spill_loads"] == 0, meta
    assert f"constexpr int HIDDEN = {hidden};" in src


def test_which_draws_are_served():
    V = 128256
    assert sampler.supported(128, True, V) is None  # top-k (and top-p): the kernel's own selection
    assert sampler.supported(0, False, V) is None  # temperature only: the kernel over the vocabulary
    assert "top-p without candidates" in sampler.supported(0, True, V)  # (the caller ranks NUCLEUS_CANDIDATES)
    assert sampler.supported(sampler.NUCLEUS_CANDIDATES, True, V) is None  # top-p without top-k
    assert sampler.supported(sampler.MAX_CANDIDATES, True, V) is None
    assert sampler.supported(2 * sampler.MAX_CANDIDATES, False, V).startswith("top-k above 2048")
    assert sampler.supported(128, True, sampler.MAX_VOCAB) is None
    assert "vocabulary" in sampler.supported(128, True, sampler.MAX_VOCAB + 1)
    assert sampler.supported(0, False, 4 * sampler.MAX_VOCAB) is None


@pytest.fixture(scope="module")
def objects(tmp_path_factory) -> Path:
    """One build directory for the module's GPU tests: the sampler compiles once per (hidden, dtype), not once a
    test (40 draw shapes' compiles took most of a device call's 600 s)."""
    return tmp_path_factory.mktemp("sampler")


def _inputs(B, V, seed, *, ties=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(B, V, device="cuda", generator=g) * 3
    if ties:  # bf16 logits tie often (the k-th logit's ties are kept, as transformers keeps them)
        logits = logits.bfloat16().float()
    temp = 0.3 + torch.rand(B, device="cuda", generator=g) * 1.2
    temp[1] = 0.0  # a greedy row keeps the head's token
    s = torch.randint(0, 2 ** 62, (B,), device="cuda", generator=g)
    pos = torch.randint(0, 4000, (B,), device="cuda", generator=g, dtype=torch.int32)
    return logits, temp, s, pos


def left_clean(draw):
    """The kernels leave their counters at 0 (a graph replays them as captured)."""
    return draw.counter.item() == 0 and all(int(sc["rowmax"].abs().sum()) == 0 and int(sc["rowdone"].abs().sum()) == 0
                                            for sc in draw._scratch.values())


# (top_k, top_p, candidates, nucleus, room): the draw shapes generate() asks for (serve.Draw); top_k < 0: top-k
# -top_k in rows 0, 3, 5 and off in the others (a mixed batch)
NC = sampler.NUCLEUS_CANDIDATES
SHAPES = [(50, 0.9, 128, True, 128), (1, 1.0, 128, False, 128), (200, 0.5, 512, True, 512),
          (50, 1.0, 128, False, 128), (0, 1.0, 0, False, 0), (2000, 0.95, 4096, True, 4096),
          (0, 0.9, 0, True, NC), (0, 0.5, 0, True, NC), (-50, 0.9, 0, True, NC), (-1000, 1.0, 0, True, 2048)]


@gpu
@needs_cuda
@pytest.mark.parametrize("ties,V", [(False, 50000 + 17), (True, 50000 + 17), (False, 300), (False, 3 * 4096 + 100)])
@pytest.mark.parametrize("k,p,cands,nucleus,room", SHAPES)
def test_gpu_sampler_draws_sample_tokens_tokens(objects, k, p, cands, nucleus, room, ties, V):
    """V 50,017: 13 slices of 4,096 logits, the last short; V 300: one slice, fewer logits than candidates;
    V 12,388: a last slice of 100 logits (fewer than some top-k). Rows' top-k and top-p differ. Top-k off with
    top-p: temperatures 0.3-1.5 on these logits put the cut among the 256 ranked in some rows and past them in
    others (the whole row's cut, counted: both paths must run); a top-p-1 row with top-k off draws over the whole
    row."""
    B = 6
    cands, room = min(cands, V), min(room, V)
    draw = sampler.Sampler(64, torch.bfloat16, "cuda", build_dir=objects)
    differ, past = 0, 0
    for trial in range(30):
        logits, temp, s, pos = _inputs(B, V, 1000 * trial + 7, ties=ties)
        rows = torch.arange(B, device="cuda")
        topk = (abs(k) - rows % 3).clamp_min(1) if k else torch.zeros(B, dtype=torch.long, device="cuda")
        if k < 0:
            topk[torch.tensor([1, 2, 4], device="cuda")] = 0
        topp = torch.full((B,), p, device="cuda") if p == 1.0 else p - 0.1 * (rows % 2)
        if p < 1.0:
            topp[4] = 1.0  # a row with top-p off in a top-p batch: no cut (an fp32 sum can reach 1 early)
        if k > 0:
            topk[1] = 0  # the greedy row's top-k need not be in 1..candidates
        greedy = logits.argmax(-1)
        want = serve.sample_tokens(logits, temp, topk, topp, s, pos.long() + 1, candidates=cands, nucleus=nucleus)
        if nucleus and room != cands:  # rows whose cut lies past the ranked: the whole row's search ran
            probs = (logits / temp[:, None]).softmax(-1).topk(room, dim=-1).values.sum(-1)
            past += int(((topk <= 0) & (temp > 0) & (probs < topp)).sum())
        nxt = greedy.clone()
        got = draw(logits, temp, topk, topp, s, pos, nxt, candidates=room, nucleus=nucleus)
        torch.cuda.synchronize()
        assert got.data_ptr() == nxt.data_ptr() and got[1] == greedy[1], (trial, got.tolist(), greedy.tolist())
        # the same draw; the softmax's sum and the cumulative sum run in another order than torch's, so a token
        # within an fp32 rounding of the top-p cut may go either way, and bf16 logits tied at the cut are ranked by id
        # here, in torch.topk's order there (a CPU emulation: 28 of 12,000 draws, all such ties; a wrong mask, scale,
        # noise or index differs in most)
        differ += int((got != want).sum())
        assert left_clean(draw)
    assert differ <= (0 if not nucleus else 4 if ties else 1), f"{differ} of {30 * B} draws differ from sample_tokens'"
    if nucleus and room != cands and V > room and p < 1.0:
        assert past > 0, "no row's cut lay past the ranked logits: these inputs would not reach the whole row's search"


@gpu
@needs_cuda
def test_gpu_sampler_keeps_the_lowest_ids_of_too_many_ties(objects):
    """Where more logits tie at the k-th than the candidates hold, every larger logit is kept and the lowest ids of
    the tied ones (the same set every run; torch.topk(C) keeps some C of them): 3,000 logits tie (top-k 50 of 128
    candidates), so the draw is one of ids 0..127; ten larger logits in another slice are always kept."""
    V, B = 3 * 4096, 4
    draw = sampler.Sampler(64, torch.bfloat16, "cuda", build_dir=objects)
    logits = torch.full((B, V), -5.0, device="cuda")
    logits[:, :3000] = 2.0
    temp = torch.ones(B, device="cuda")
    topk, topp = torch.full((B,), 50, device="cuda"), torch.ones(B, device="cuda")
    seen = set()
    for seed in range(40):
        s = torch.full((B,), 1000 * seed, device="cuda") + torch.arange(B, device="cuda")  # (160 distinct seeds)
        pos = torch.full((B,), 7, dtype=torch.int32, device="cuda")
        a = draw(logits, temp, topk, topp, s, pos, torch.zeros(B, dtype=torch.long, device="cuda"), candidates=128,
                 nucleus=False).clone()
        b = draw(logits, temp, topk, topp, s, pos, torch.zeros(B, dtype=torch.long, device="cuda"), candidates=128,
                 nucleus=False)
        assert torch.equal(a, b) and (a < 128).all(), a.tolist()
        seen.update(a.tolist())
    assert len(seen) > 60, len(seen)  # drawn over the 128 (~91 distinct of 160 uniform draws), not a few
    logits[:, 5000:5010] = 20.0  # ten larger logits past the ties (another slice): always kept
    a = draw(logits, temp, topk, topp, s, pos, torch.zeros(B, dtype=torch.long, device="cuda"), candidates=128,
             nucleus=False)
    assert ((a >= 5000) & (a < 5010)).all(), a.tolist()  # (each e^18 times a tied one's probability)
    assert left_clean(draw)


@gpu
@needs_cuda
def test_gpu_sampler_cuts_a_flat_row_among_its_ties_by_id(objects):
    """Top-p without top-k where the ranked logits hold far less than top_p (the whole row's cut): id 5 at logit 5,
    20,000 ids tied at 0, the rest at -30. At top-p 0.5 the cut lies among the ties: id 5 (p 0.0074) and the
    lowest ~9,930 tied ids (p 4.96e-5 each) are kept, by the kernel's rule (lowest id first; torch's sort keeps
    some such set), and every draw over 300 seeds falls among them, spread up to the cut."""
    V, lo, n = 50000, 10000, 20000
    logits = torch.full((1, V), -30.0, device="cuda")
    logits[0, lo:lo + n] = 0.0
    logits[0, 5] = 5.0
    z = math.exp(5.0) + n + (V - n - 1) * math.exp(-30.0)
    need = math.ceil((0.5 - math.exp(5.0) / z) * z)  # the tied ids it takes to reach 0.5
    draw = sampler.Sampler(64, torch.bfloat16, "cuda", build_dir=objects)
    one = dict(device="cuda")
    temp, topk, topp = torch.ones(1, **one), torch.zeros(1, dtype=torch.long, **one), torch.full((1,), 0.5, **one)
    got = []
    for sd in range(300):
        nxt = torch.zeros(1, dtype=torch.long, **one)
        draw(logits, temp, topk, topp, torch.tensor([sd], **one), torch.tensor([7], dtype=torch.int32, **one), nxt,
             candidates=sampler.NUCLEUS_CANDIDATES, nucleus=True)
        got.append(int(nxt))
    tied = [t for t in got if t != 5]
    assert all(lo <= t < lo + need + 1 for t in tied), (need, min(tied), max(tied))
    assert max(tied) > lo + 0.9 * need and min(tied) < lo + 0.1 * need, (need, min(tied), max(tied))
    assert left_clean(draw)


@gpu
@needs_cuda
@pytest.mark.parametrize("cands,nucleus", [(128, True), (0, False)])
def test_gpu_sampler_advances_the_step_and_replays(objects, cands, nucleus):
    """With lm_head.Advance: hist[step] = the draw, pos += 1, x_next = embed[draw], step += 1 — as the fused head's
    greedy step does; a CUDA graph's replays chain steps (each draws from the new positions)."""
    B, V, H = 3, 30011, 256
    draw = sampler.Sampler(H, torch.bfloat16, "cuda", build_dir=objects)
    logits, temp, s, pos0 = _inputs(B, V, 5)
    topk, topp = torch.full((B,), 40, device="cuda"), torch.full((B,), 0.8 if nucleus else 1.0, device="cuda")
    embed = torch.randn(V + 5, H, device="cuda").bfloat16()
    hist = torch.full((7, B), -1, dtype=torch.int64, device="cuda")
    step = torch.zeros(1, dtype=torch.int64, device="cuda")
    pos = pos0.clone()
    x_next = torch.full((B, H), float("nan"), device="cuda").bfloat16()
    greedy = logits.argmax(-1)
    nxt = greedy.clone()
    adv = lm_head.Advance(hist, step, pos, embed, x_next)
    kw = dict(candidates=cands, nucleus=nucleus)

    def expected(i):  # step i's draw (its positions pos0 + i) from the reference
        return serve.sample_tokens(logits, temp, topk, topp, s, pos0.long() + i + 1, **kw)

    draw(logits, temp, topk, topp, s, pos, nxt, advance=adv, **kw)
    torch.cuda.synchronize()
    want = expected(0)
    want[1] = greedy[1]
    assert torch.equal(nxt, want) and torch.equal(hist[0], want) and hist[1:].eq(-1).all()
    assert step.item() == 1 and torch.equal(pos, pos0 + 1) and torch.equal(x_next, embed[want])
    # captured, then replayed: each replay is the next step (nxt is the head's greedy input again: reset it first)
    s_ = torch.cuda.Stream()
    s_.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s_):
        with torch.cuda.graph(graph, stream=s_):
            nxt.copy_(greedy)
            draw(logits, temp, topk, topp, s, pos, nxt, advance=adv, **kw)
    torch.cuda.current_stream().wait_stream(s_)
    for i in range(1, 5):
        graph.replay()
        torch.cuda.synchronize()
        want = expected(i)
        want[1] = greedy[1]
        assert torch.equal(hist[i], want), (i, hist[i].tolist(), want.tolist())
        assert step.item() == i + 1 and torch.equal(pos, pos0 + i + 1) and torch.equal(x_next, embed[want])
    assert left_clean(draw)
    # another draw shape (more rows, other candidates) made its own scratch: the captured graph's is still its own
    for B2, c2 in ((8, 512), (8, 0)):
        lg2, t2, s2, p2 = _inputs(B2, V, 9)
        draw(lg2, t2, torch.full((B2,), 100, device="cuda"), torch.full((B2,), 0.9, device="cuda"), s2, p2,
             lg2.argmax(-1), candidates=c2, nucleus=c2 > 0)
    junk = [torch.full((n,), -1, dtype=dt, device="cuda") for n in (B, B * 8 * 128, 8 * 16)  # (freed blocks'
            for dt in (torch.int32, torch.int64)]  # sizes: a scratch freed under the graph would be overwritten)
    graph.replay()
    torch.cuda.synchronize()
    want = expected(5)
    want[1] = greedy[1]
    assert torch.equal(hist[5], want) and step.item() == 6 and left_clean(draw) and junk


@gpu
@needs_cuda
def test_gpu_sampler_refuses_bad_inputs(objects):
    draw = sampler.Sampler(64, torch.bfloat16, "cuda", build_dir=objects)
    logits, temp, s, pos = _inputs(2, 1000, 1)
    k, p, nxt = torch.full((2,), 5, device="cuda"), torch.ones(2, device="cuda"), torch.zeros(2, dtype=torch.long,
                                                                                              device="cuda")
    with pytest.raises(ValueError, match="top-p without candidates"):
        draw(logits, temp, k, p, s, pos, nxt, candidates=0, nucleus=True)
    with pytest.raises(ValueError, match="pos \\[B\\] int32"):
        draw(logits, temp, k, p, s, pos.long(), nxt, candidates=128, nucleus=False)
    with pytest.raises(ValueError, match="Sampler: hidden 60"):
        sampler.Sampler(60, torch.bfloat16, "cuda", build_dir=objects)
