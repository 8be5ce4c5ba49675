"""End-to-end benchmark on a GPU (one run): the served model (generator.serve: fused variants, CUDA-graph decode)
against the same model on the unfused layers in a CUDA graph, transformers `generate` eager, and transformers with a
static cache + torch.compile (as its docs recommend: cache_implementation="static", for which generate compiles
the forward itself).

Measured: time to first token for prompts of 128 and 2048 tokens (batch 1), ms per output token at batch 1 and 8
(128-token prompts), sampled at batch 1, and at batch 1 near the end of the cache (served model), a sampled step's
draw alone (torch's sample_tokens against the fused draw, µs, bench_draw), the bound a decode step is held to
(the batch-1 fused layers back to back in one graph + the LM head, and one layer's call from Python against its
kernel), and agreement with transformers in fp32 on the same checkpoint (greedy tokens until the first
divergence, logits ‖ours − fp32‖/‖fp32‖ teacher-forced on our tokens). The checkpoint: --ckpt, a model directory
of any shape `megakernel from-hf` maps; by default a Llama-3.2-1B-shaped config with random weights, saved (bf16) at
DEFAULT_CKPT where absent.

    python -m bench.e2e --build-dir build     # bench/results/e2e-<gpu>-<date>.json (in $OUT where set)
    python -m bench.e2e --ckpt path/to/model --seq-len 2048

(builds into --build-dir first, where not up to date, what it serves: variants_for, the declared variants of the
checkpoint's layer, else its own entry's decode variants with the default plans).

Prints a table and writes the JSON.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: bench/ and generator/ from this tree
    sys.path.insert(0, str(ROOT))

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}


DEFAULT_CKPT = "/tmp/megakernel-e2e-llama1b"


def make_checkpoint(path: Path, seed: int = 0) -> Path:
    """A Llama-3.2-1B-shaped checkpoint with random weights scaled like a trained model's, saved in bf16."""
    import transformers as T
    if (path / "config.json").exists():
        return path
    cfg = T.LlamaConfig(**LLAMA_1B, rope_parameters={**ROPE, "rope_theta": 500000.0}, dtype="bfloat16")
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.device("cuda"):
        model = T.LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g, device="cuda"))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda"))
            else:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda") / math.sqrt(p.shape[1]))
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def _median(f, n):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def prompts(batch, length, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def bench_served(model, args) -> dict:
    """TTFT and ms/token of a generator.serve.Model."""
    out = {}
    for L in (128, 2048):
        p = prompts(1, L, model.vocab).tolist()
        model.generate(p, 1, stop_tokens=[])
        out[f"ttft_ms_{L}"] = 1e3 * statistics.median(model.generate(p, 1, stop_tokens=[]).ttft_s
                                                      for _ in range(args.reps))
    for B in (1, 8):
        p = prompts(B, 128, model.vocab).tolist()
        model.generate(p, args.new_tokens, stop_tokens=[])  # graphs captured here
        runs = [model.generate(p, args.new_tokens, stop_tokens=[]) for _ in range(args.reps)]
        out[f"ms_per_token_b{B}"] = 1e3 * statistics.median(r.decode_s / (args.new_tokens - 1) for r in runs)
        out[f"decode_path_b{B}"] = runs[0].decode_choice.variant or "unfused"
    # sampled decoding as users run it, in the step's graph: temperature, top-k and top-p (the fused draw where the
    # model has it: draw_path), and top-p with top-k off (a sort of the vocabulary: torch's draw; transformers'
    # generate() would add its default top-k 50 to Llama-3's generation_config.json, a server with top-k off not)
    p = prompts(1, 128, model.vocab).tolist()
    for key, kw in (("sampled", dict(temperature=0.8, top_k=50, top_p=0.9)),
                    ("sampled_topp", dict(temperature=0.6, top_p=0.9))):
        kw = dict(kw, seed=1, stop_tokens=[])
        model.generate(p, args.new_tokens, **kw)
        runs = [model.generate(p, args.new_tokens, **kw) for _ in range(args.reps)]
        out[f"ms_per_token_b1_{key}"] = 1e3 * statistics.median(r.decode_s / (args.new_tokens - 1) for r in runs)
        out[f"draw_path_b1_{key}"] = model.draw_path(kw["temperature"], kw.get("top_k", 0), kw["top_p"])
    out["memory"] = model.memory()
    return out


def bench_long(model, args) -> float:
    """ms per output token at batch 1 near the end of the cache: a prompt that fills it up to new_tokens + 8 rows
    before its end (the published megakernel's 2.5 ms at position 4095 is the figure to stay ahead of)."""
    p = prompts(1, model.cache_len - args.new_tokens - 8, model.vocab).tolist()
    model.generate(p, args.new_tokens, stop_tokens=[])
    runs = [model.generate(p, args.new_tokens, stop_tokens=[]) for _ in range(args.reps)]
    return 1e3 * statistics.median(r.decode_s / (args.new_tokens - 1) for r in runs)


# the draw shapes timed alone (top_k, top_p): the served step's sampled figures, top-k alone, temperature alone, and
# top-p alone (on bench_draw's random logits a row's 256 largest hold ~0.8 of its probability on average: top-p 0.5's
# cut lies among them, 0.9's mostly past them, found over the whole row: the fused draw's two paths; each entry
# records its rows past the ranked)
DRAWS = {"top-k 50, top-p 0.9": (50, 0.9), "top-k 50": (50, 1.0), "temperature only": (0, 1.0),
         "top-p 0.5 only": (0, 0.5), "top-p 0.9 only": (0, 0.9)}


def bench_draw(model, batches=(1, 8), temperature: float = 0.8) -> dict:
    """A sampled step's draw alone, in a CUDA graph, on random logits [B, vocab] fp32: serve.sample_tokens (torch)
    against the model's fused draw (generator.sampler) where draw_path says it serves; µs {"b<B> <draw>": {"torch",
    "fused", "path", "same_tokens", "rows_past_ranked"}}. same_tokens: the two drew the same tokens on those logits
    (the fused draw's documented exceptions aside: a token at the top-p cut within an fp32 rounding, or tied with it);
    rows_past_ranked (top-k off, top-p < 1): rows whose `room` largest hold less than top_p of their probability,
    whose cut the fused draw finds over the whole row (its slow path)."""
    from bench.timing import graph_of, time_replays
    from generator import serve
    out = {}
    for B in batches:
        g = torch.Generator(device=model.device).manual_seed(B)
        logits = (torch.randn(B, model.vocab, device=model.device, generator=g) * 3).bfloat16().float()
        temp = torch.full((B,), temperature, device=model.device)
        seed = torch.arange(B, device=model.device) * 7919 + 1
        pos = torch.arange(B, dtype=torch.int32, device=model.device) + 9
        nxt = logits.argmax(-1)
        for name, (k, p) in DRAWS.items():
            tk, tp = torch.full((B,), k, device=model.device), torch.full((B,), p, device=model.device)
            cands, nucleus, room = model._draw_shape(*model._check_sampling(1, temperature, k, p)[:3])
            path = model.draw_path(temperature, k, p)
            row = {"path": path}
            if k == 0 and p < 1 and room:
                mass = (logits / temp[:, None]).softmax(-1).topk(min(room, model.vocab), dim=-1).values.sum(-1)
                row["rows_past_ranked"] = int((mass < tp).sum())
            want = serve.sample_tokens(logits, temp, tk, tp, seed, pos.long() + 1, candidates=cands, nucleus=nucleus)
            gr = graph_of(lambda: nxt.copy_(serve.sample_tokens(logits, temp, tk, tp, seed, pos.long() + 1,
                                                                candidates=cands, nucleus=nucleus)))
            row["torch"] = round(time_replays(gr.replay, 1, reps=50, queued=True)["median"], 1)
            draw = model._fused_sampler(serve.Draw(cands, nucleus, room)) if path == "fused" else None
            if draw is not None:
                got = draw(logits, temp, tk, tp, seed, pos, logits.argmax(-1), candidates=room, nucleus=nucleus)
                row["same_tokens"] = bool(torch.equal(got, want))
                gr = graph_of(lambda: draw(logits, temp, tk, tp, seed, pos, nxt, candidates=room, nucleus=nucleus))
                row["fused"] = round(time_replays(gr.replay, 1, reps=50, queued=True)["median"], 1)
            out[f"b{B} {name}"] = row
    return out


def kernel_bound(model, pos: int = 192) -> dict:
    """What a decode step cannot beat, measured on the same weights: the model's batch-1 fused layers replayed
    back to back in one CUDA graph (µs, at position `pos`) plus its head alone (final norm + [1, hidden] @
    lm_head^T + argmax, µs: the served one, and torch's for comparison), each as GPU time (a replay queued behind
    a spin kernel, bench.timing: the graph's launch from the host is no kernel's time), and the layer call from Python:
    `layer(x, pos)` in an eager loop, with and without the positions' check (µs per call, host included, and the
    host's own time) against its kernel in a graph."""
    from bench.timing import graph_of, time_replays
    name = model.decode_variants[1]
    layers = model.fused[name]
    x = torch.randn(1, model.shape.hidden, device=model.device).to(model.dtype)
    p = torch.full((1,), pos, dtype=torch.int32, device=model.device)

    def step():
        y = x
        for L in layers:
            y = L(y, p, validate=False)
        return y
    layers_us = time_replays(graph_of(step).replay, 1, queued=True)["median"]
    head = graph_of(lambda: model._logits(x))  # the served head (head_path(1)): the fused kernel where it serves
    lm_head_us = time_replays(head.replay, 1, queued=True)["median"]
    torch_head = graph_of(lambda: model._torch_logits(x).argmax(-1))  # torch's: norm, GEMM, cast, argmax
    lm_head_torch_us = time_replays(torch_head.replay, 1, queued=True)["median"]
    one = graph_of(lambda: layers[0](x, p, validate=False))
    kernel_us = time_replays(one.replay, 1, queued=True)["median"]
    for _ in range(20):
        layers[0](x, p)
    torch.cuda.synchronize()
    out = {"variant": name, "layers": len(layers), "layers_us": round(layers_us, 1),
           "lm_head_us": round(lm_head_us, 1), "head": model.head_path(1),
           "lm_head_torch_us": round(lm_head_torch_us, 1), "bound_ms": round((layers_us + lm_head_us) / 1e3, 4),
           "layer_kernel_us": round(kernel_us, 1)}
    n = 500
    for tag, call in (("", lambda: layers[0](x, p)), ("_unchecked", lambda: layers[0](x, p, validate=False))):
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        t1 = time.perf_counter()  # the host's time per call (the GPU queue absorbs the kernels)
        torch.cuda.synchronize()
        out[f"layer_call{tag}_host_us"] = round(1e6 * (t1 - t0) / n, 1)
        out[f"layer_eager_call{tag}_us"] = round(1e6 * (time.perf_counter() - t0) / n, 1)
    return out


def bench_hf(model, args) -> dict:
    """TTFT and ms/token of transformers generate (greedy)."""
    out = {}
    kw = dict(do_sample=False, pad_token_id=0, min_new_tokens=0)
    for L in (128, 2048):
        ids = prompts(1, L, model.config.vocab_size).cuda()
        f = lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, **kw)  # noqa: E731
        f()
        out[f"ttft_ms_{L}"] = 1e3 * _median(f, args.reps)
    for B in (1, 8):
        ids = prompts(B, 128, model.config.vocab_size).cuda()
        mask = torch.ones_like(ids)
        g1 = lambda: model.generate(ids, attention_mask=mask, max_new_tokens=1, **kw)  # noqa: E731
        gn = lambda: model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,  # noqa: E731
                                    min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        gn()
        t1, tn = _median(g1, args.reps), _median(gn, args.reps)
        out[f"ms_per_token_b{B}"] = 1e3 * (tn - t1) / (args.new_tokens - 1)
    return out


def _against_fp32(tokens: list[int], logits: torch.Tensor, ids: torch.Tensor, ref_fp32, n_new: int) -> dict:
    """A model's greedy `tokens` (n_new) and its step `logits` [n_new, vocab] after the prompt `ids` [1, 32] against
    transformers fp32: tokens equal before the first divergence, logits rel. error and argmax agreement, fp32
    teacher-forced on those tokens; where they diverge, tie_gap_rms: fp32's logit gap between its token and ours at
    that step, in rms of its row (the prefixes are equal there; a near-tie reads ~0.1 or less, tests/hf_util.py's
    NEAR_TIE_RMS)."""
    dev = ref_fp32.device
    with torch.no_grad():
        ref_tokens = ref_fp32.generate(ids.to(dev), attention_mask=torch.ones_like(ids).to(dev), max_new_tokens=n_new,
                                       min_new_tokens=n_new, do_sample=False, pad_token_id=0)[0, 32:].tolist()
        seq = torch.tensor([ids[0].tolist() + tokens[:-1]], device=dev)
        ref_logits = ref_fp32(input_ids=seq).logits[0, 31:].float()
    ours = logits.float()
    same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), n_new)
    out = {"greedy_tokens_equal_before_divergence": same, "of": n_new,
           "logits_rel_err": float((ours - ref_logits).norm() / ref_logits.norm()),
           "argmax_agreement": float((ours.argmax(-1) == ref_logits.argmax(-1)).float().mean())}
    if same < n_new:
        r = ref_logits[same]
        out["tie_gap_rms"] = float((r[tokens[same]] - r[ref_tokens[same]]).abs() / r.pow(2).mean().sqrt())
    return out


def agreement(served, ref_fp32, n_new: int) -> dict:
    """Greedy tokens of `served` against transformers fp32 (tokens equal before the first divergence, of n_new)
    and logits rel. error, teacher-forced on our tokens."""
    ids = prompts(1, 32, served.vocab, seed=5)
    got = served.generate(ids.tolist(), n_new, stop_tokens=[], output_logits=True)
    return _against_fp32(got.tokens[0], torch.stack([lg[0] for lg in got.logits]), ids, ref_fp32, n_new)


def agreement_hf(hf_model, ref_fp32, n_new: int) -> dict:
    """transformers' own `hf_model` (bf16) against transformers fp32, measured as `agreement` measures the served
    model: its greedy tokens and the logits of each of its steps (the prompt's, then every decode step's with its
    KV cache: generate's output_logits). The yardstick for the served bf16 model's figures (a bf16 forward's
    rounding through every layer, not a kernel's)."""
    ids = prompts(1, 32, ref_fp32.config.vocab_size, seed=5)
    with torch.no_grad():
        out = hf_model.generate(ids.cuda(), attention_mask=torch.ones_like(ids).cuda(), max_new_tokens=n_new,
                                min_new_tokens=n_new, do_sample=False, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
    return _against_fp32(out.sequences[0, 32:].tolist(), torch.stack([lg[0] for lg in out.logits]), ids, ref_fp32,
                         n_new)


BATCHES = (1, 4, 8)  # the decode variants served (ms per token is timed at batch 1 and 8)


def variants_for(ckpt: Path, seq_len: int, build_dir: str) -> tuple[list, Path]:
    """The variants the served model uses for checkpoint `ckpt`, built into build_dir where not up to date, and the
    variants file they come from. A model of variants.yaml that computes the checkpoint's layer (every field
    generator.serve compares, and its dtype) with decode variants of batch 1, 4 and 8 at seq_len: those and its
    prefill variants (the plans `megakernel build` takes: tuning/'s winners). Otherwise (a shape or a seq_len the
    project does not declare, as a user's checkpoint is) the checkpoint's own entry (`megakernel from-hf`'s) with
    decode batch 1, 4 and 8 at seq_len, written to <build_dir>/e2e-variants.yaml and built with the default plans;
    prompts then run unfused (no prefill variant). Exits 2 with one line where the config cannot be mapped or a
    build fails."""
    from generator import compile as gcompile, hf, tune as gtune, variants as gvariants
    from generator.manifest import build_dir_flag
    vf = ROOT / "variants.yaml"
    try:
        mapped = hf.map_config(ckpt)
        want = mapped.model()
        hf.check_window(mapped.window, seq_len, f"{mapped.cfg_path}: --seq-len", want.layers, None,
                        want.sliding_window)  # (as serve would)
        hf.check_positions(mapped.limit, seq_len, f"{mapped.cfg_path}: --seq-len")
        same = [v for v in gvariants.load(vf) if v.tp == 1 and v.model.dtype == want.dtype
                and gvariants.same_layer(v.model, want)]
        vs = [v for v in same if v.mode == "decode" and v.seq_len == seq_len and v.batch in BATCHES]
        if sorted(v.batch for v in vs) == list(BATCHES):
            vs += [v for v in same if v.mode == "prefill" and v.seq_len <= seq_len]
        else:  # ("e2e-" before the name: no declared variant's name, nor its tuned plan)
            name = mapped.name if mapped.name.startswith("e2e-") else f"e2e-{mapped.name}"
            text = hf.variant_entry_yaml(ckpt, name, matrix=[
                {"mode": ["decode"], "batch": list(BATCHES), "seq_len": [seq_len]}])
            text = (f"# bench/e2e.py: {ckpt}'s layer, which variants.yaml does not declare at seq_len {seq_len}\n"
                    f"models:\n{text}")
            vs = gvariants.parse(text, str(Path(build_dir) / "e2e-variants.yaml"))
            vf = Path(build_dir) / "e2e-variants.yaml"
            vf.parent.mkdir(parents=True, exist_ok=True)
            vf.write_text(text)
    except (hf.HFConfigError, gvariants.VariantError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    res = gcompile.build(vs, build_dir, variants_file=vf, tuning_file=gtune.default_tuning_file())
    if bad := [e for e in res["entries"] if e["status"] != "ok"]:
        print(f"error: {bad[0]['name']} did not build ({bad[0]['status']}): `megakernel build --variants {vf} "
              f"--only '{bad[0]['name']}'{build_dir_flag(build_dir)}` says why", file=sys.stderr)
        sys.exit(2)
    return vs, vf


def main(argv=None):
    from bench import ScriptParser
    ap = ScriptParser(description=__doc__.split("\n\n")[0] + " Needs a CUDA GPU.")
    ap.add_argument("--build-dir", default="build", help="where the served variants are built (variants_for: first, "
                                                         "where not up to date) [build]")
    ap.add_argument("--ckpt", default=DEFAULT_CKPT,
                    help=f"checkpoint directory, any shape from-hf maps [{DEFAULT_CKPT}: a random Llama-3.2-1B-shaped "
                         "one, made there where absent]")
    ap.add_argument("--seq-len", type=int, default=4096, help="cache length: the decode variants' seq_len [4096]")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per timed run [128]")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per figure, the median kept [3]")
    ap.add_argument("--skip", action="append", default=[], choices=["served", "unfused", "hf", "hf-compile"],
                    help="a provider to skip (repeatable): served, unfused, hf, hf-compile")
    ap.add_argument("--out", default=None, help="JSON file [e2e-<gpu>-<date>.json, the name `megakernel report` "
                                                "reads, in $OUT, else bench/results/]")
    args = ap.parse_args(argv)
    if args.new_tokens < 2 or args.reps < 1:  # (ms per token: over new_tokens - 1 steps; a median of reps runs)
        ap.error(f"--new-tokens {args.new_tokens} / --reps {args.reps}: at least 2 / 1")
    if args.seq_len < (need := max(2048, args.new_tokens + 9)):  # (a 2,048-token prompt's TTFT; bench_long's prompt)
        ap.error(f"--seq-len {args.seq_len}: at least {need} (the 2,048-token prompt's TTFT, --new-tokens + 9 rows for "
                 "the long-context run)")
    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").exists() and args.ckpt != DEFAULT_CKPT:  # (a typo must not benchmark a random model)
        ap.error(f"--ckpt {args.ckpt}: no config.json there (leave --ckpt out for a random Llama-3.2-1B-shaped one)")
    if (ckpt / "config.json").exists():  # (a config it cannot serve: said before any GPU is asked for)
        from generator import hf, variants as gvariants
        try:
            hf.map_config(ckpt).model()
        except (hf.HFConfigError, gvariants.VariantError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
    if not torch.cuda.is_available():
        print("error: bench/e2e.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    import transformers as T

    from generator import reference, serve
    ckpt = make_checkpoint(ckpt)
    res = {"gpu": torch.cuda.get_device_name(), "arch": "%d%d" % torch.cuda.get_device_capability(),
           "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"),
           "torch": torch.__version__, "transformers": T.__version__,
           "checkpoint": str(ckpt), "new_tokens": args.new_tokens, "providers": {},
           "timing": "graph replays (kernel_bound, draws) as GPU time, queued (bench.timing); ms per token as served"}
    # the decode variants and any declared prefill ones: dispatch plans each prompt's pieces by their measured routes
    vs, vfile = variants_for(ckpt, args.seq_len, args.build_dir)
    names = [v.name for v in vs]
    res["variants_file"] = str(vfile)
    dtype = reference.TORCH_DTYPES[vs[0].model.dtype]  # transformers' own runs in the served dtype
    res["dtype"] = vs[0].model.dtype
    from bench.results import result_stem
    res_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    out = Path(args.out) if args.out else \
        res_dir / f"{result_stem(res_dir, res['gpu'], res['date'], prefix='e2e-')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():  # after every provider: a run cut short keeps what it measured
        out.write_text(json.dumps(res, indent=1, default=str))
    if "served" not in args.skip:
        m = serve.Model.from_hf(ckpt, build_dir=args.build_dir, variants=names)
        served = res["providers"]["served (fused, graph)"] = bench_served(m, args)
        save()
        try:  # a failure here is reported in the results, not a lost run
            served["ms_per_token_b1_long"] = bench_long(m, args)
            res["kernel_bound"] = kernel_bound(m)
            res["kernel_bound"]["ratio"] = round(served["ms_per_token_b1"] / res["kernel_bound"]["bound_ms"], 3)
        except Exception as exc:  # noqa: BLE001
            res["kernel_bound"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        try:
            res["draw_us"] = bench_draw(m)
        except Exception as exc:  # noqa: BLE001
            res["draw_us"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        res["served_prefill_pieces"] = {L: [(pc.start, pc.length, pc.choice.variant or "unfused")
                                            for pc in m.paths(1, min(L, m.cache_len))["prefill"]]
                                        for L in (128, 2048)}
        save()
        res["agreement_fused_bf16_vs_hf_fp32"] = None  # ("bf16": the served dtype, res["dtype"]; the keys report reads)
        ref32 = T.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).cuda().eval()
        res["agreement_fused_bf16_vs_hf_fp32"] = agreement(m, ref32, 32)
        del m
        m32 = serve.Model.from_hf(ckpt, build_dir=args.build_dir, variants=[], cache_len=256, dtype=torch.float32)
        with warnings.catch_warnings():  # (unfused by design: no variants.yaml entry to suggest)
            warnings.simplefilter("ignore", serve.MissingVariantWarning)
            res["agreement_unfused_fp32_vs_hf_fp32"] = agreement(m32, ref32, 32)
        del m32
        hf16 = T.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).cuda().eval()
        res["agreement_hf_bf16_vs_hf_fp32"] = agreement_hf(hf16, ref32, 32)  # the yardstick for the fused bf16 row
        del hf16, ref32
        torch.cuda.empty_cache()
    if "unfused" not in args.skip:
        m = serve.Model.from_hf(ckpt, build_dir=args.build_dir, variants=[], cache_len=args.seq_len, max_batch=8)
        m.fused_head = False  # the unfused baseline is torch's all through
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", serve.MissingVariantWarning)
            res["providers"]["unfused layers (graph)"] = bench_served(m, args)
        save()
        del m
        torch.cuda.empty_cache()
    if "hf" not in args.skip:
        hfm = T.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).cuda().eval()
        res["providers"]["transformers eager"] = bench_hf(hfm, args)
        save()
        if "hf-compile" not in args.skip:
            # transformers' recipe (docs: "Static cache and torch.compile"): a static cache, for which generate
            # compiles the forward itself (generation_config.compile_config)
            hfm.generation_config.cache_implementation = "static"
            try:  # a failure here is reported in the results, not a lost run
                res["providers"]["transformers static + compile"] = bench_hf(hfm, args)
            except Exception as exc:  # noqa: BLE001
                res["providers"]["transformers static + compile"] = {"error": f"{type(exc).__name__}: "
                                                                              f"{str(exc).splitlines()[0][:200]}"}
            save()
        del hfm
    cols = ("ttft_ms_128", "ttft_ms_2048", "ms_per_token_b1", "ms_per_token_b8", "ms_per_token_b1_sampled",
            "ms_per_token_b1_sampled_topp")
    print(f"{'provider':32} " + " ".join(f"{c:>16}" for c in cols))
    for name, r in res["providers"].items():
        if "error" in r:
            print(f"{name:32} error: {r['error']}")
            continue
        print(f"{name:32} " + " ".join(f"{r.get(c, float('nan')):16.3f}" for c in cols))
    if res.get("kernel_bound") and "error" not in res["kernel_bound"]:
        kb, served = res["kernel_bound"], res["providers"]["served (fused, graph)"]
        print(f"served b1 long context: {served['ms_per_token_b1_long']:.3f} ms/token; bound (its {kb['layers']} "
              f"fused layers in one graph {kb['layers_us']} us + LM head {kb['lm_head_us']} us, {kb.get('head')}; "
              f"torch's head {kb.get('lm_head_torch_us')} us) = {kb['bound_ms']} ms:"
              f" x{kb['ratio']}; one layer from Python: {kb['layer_eager_call_us']} us a call "
              f"({kb['layer_call_host_us']} us host; validate=False: {kb['layer_eager_call_unchecked_us']} us, "
              f"{kb['layer_call_unchecked_host_us']} us host), kernel {kb['layer_kernel_us']} us")
    for k in ("agreement_fused_bf16_vs_hf_fp32", "agreement_unfused_fp32_vs_hf_fp32", "agreement_hf_bf16_vs_hf_fp32"):
        if res.get(k):
            print(f"{k}: {res[k]}")
    for name, row in (res.get("draw_us") or {}).items():  # the draw alone, µs
        print(f"draw {name}: {row}")
    save()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
