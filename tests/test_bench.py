"""`megakernel bench` without a GPU: rows, speedups, layer counts, interleaving, writing, plots, the CLI."""
from __future__ import annotations

import csv
import fnmatch
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import measure, providers, results, run as brun  # noqa: E402
from bench.timing import layer_bytes, summarize  # noqa: E402
from generator import variants as gvariants  # noqa: E402

VARIANTS = ROOT / "variants.yaml"


def _variant(name_glob):
    return gvariants.select(gvariants.load(VARIANTS), (name_glob,))[0]


def _row(provider, us, *, variant="m_decode_b4_s4096_bf16", model="m", batch=4, seq_len=4096, nbytes=100_000_000,
         copy_gbps=4000.0, layers=32, status="ok", error=None):
    stats = {"median": us, "p10": 0.9 * us, "p90": 1.2 * us} if status == "ok" else None
    return results.make_row(variant, provider, model=model, batch=batch, seq_len=seq_len, model_layers=layers,
                         layers_timed=8, nbytes=nbytes, copy_gbps=copy_gbps, stats=stats, status=status, error=error)


# -- rows -----------------------------------------------------------------------------------------------------------

def test_field_names_are_what_report_reads():
    assert results.FIELDS[:13] == ["variant", "provider", "batch", "seq_len", "layers_timed", "us_median", "us_p10",
                                   "us_p90", "bytes", "gbps", "pct_bw", "floor_us", "tokens_per_s"]
    assert results.FIELDS[13:] == ["speedup_vs_best", "best_baseline",
                                   *[f"speedup_vs_{b}" for b in providers.BASELINES], "status", "error"]
    for name in ("speedup_vs_eager", "speedup_vs_torch_graph", "speedup_vs_compile"):  # generator/report.py's
        assert name in results.FIELDS
    r = _row("fused", 50.0)
    assert list(r)[:len(results.FIELDS)] == results.FIELDS


def test_row_figures_from_fake_timings():
    r = _row("fused", 50.0, nbytes=100_000_000, copy_gbps=4000.0, batch=4, layers=32)
    assert r["us_median"] == 50.0 and r["us_p10"] == pytest.approx(45.0) and r["us_p90"] == pytest.approx(60.0)
    assert r["bytes"] == 100_000_000
    assert r["gbps"] == pytest.approx(2000.0)             # 1e8 B in 50 µs
    assert r["pct_bw"] == pytest.approx(50.0)             # of 4000 GB/s
    assert r["floor_us"] == pytest.approx(25.0)           # 1e8 B at 4000 GB/s
    assert r["tokens_per_s"] == pytest.approx(4 * 1e6 / (50.0 * 32), rel=1e-4)
    assert r["status"] == "ok" and r["error"] is None
    assert r["batch"] == 4 and r["seq_len"] == 4096 and r["layers_timed"] == 8 and r["model"] == "m"


def test_untimed_row_keeps_the_floor_and_nothing_else():
    r = _row("compile", 0, status="skipped", error="not in --compile-subset")
    assert r["us_median"] is None and r["gbps"] is None and r["tokens_per_s"] is None
    assert r["floor_us"] == pytest.approx(25.0)
    assert (r["status"], r["error"]) == ("skipped", "not in --compile-subset")


def test_speedups_on_the_fused_row_only():
    rows = [_row("fused", 50.0), _row("eager", 400.0), _row("torch_graph", 100.0),
            _row("compile", 0, status="skipped", error="not in --compile-subset")]
    results.add_speedups(rows)
    fused = rows[0]
    assert fused["speedup_vs_eager"] == pytest.approx(8.0)
    assert fused["speedup_vs_torch_graph"] == pytest.approx(2.0)
    assert fused["speedup_vs_compile"] is None
    assert fused["best_baseline"] == "torch_graph" and fused["speedup_vs_best"] == pytest.approx(2.0)
    for r in rows[1:]:
        assert r["speedup_vs_eager"] is None and r["speedup_vs_torch_graph"] is None and r["speedup_vs_compile"] is None


def test_speedups_none_when_fused_failed_and_per_variant():
    rows = [_row("fused", 0, status="failed-check", error="rel_err 1e-1"), _row("eager", 400.0),
            _row("fused", 20.0, variant="v2"), _row("compile", 30.0, variant="v2")]
    results.add_speedups(rows)
    assert rows[0]["speedup_vs_eager"] is None
    assert rows[2]["speedup_vs_compile"] == pytest.approx(1.5)
    assert rows[2]["speedup_vs_eager"] is None                # eager not run for v2
    assert rows[0]["speedup_vs_best"] is None and rows[0]["best_baseline"] is None
    assert (rows[2]["best_baseline"], rows[2]["speedup_vs_best"]) == ("compile", pytest.approx(1.5))


def test_summarize_matches_time_replays_quantiles():
    s = summarize([float(i) for i in range(1, 101)])
    assert s["median"] == pytest.approx(50.5) and s["p10"] == 11.0 and s["p90"] == 91.0 and s["n"] == 100


def test_queued_samples_put_a_spin_kernel_before_each_start_event(monkeypatch):
    """time_samples(queued=True): the spin kernel is enqueued before each sample's start event (so the GPU reaches
    the event with the replay already queued); unqueued, none is; µs per layer from the events either way."""
    from bench import timing
    log = []

    class Event:
        def __init__(self, enable_timing):
            self.t = None

        def record(self):
            log.append("record")

        def synchronize(self):
            pass

        def elapsed_time(self, other):  # ms
            return 0.08
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("sleep", cycles)))
    got = timing.time_samples(lambda: log.append("run"), 8, 2, queued=True)
    assert got == [10.0, 10.0]
    assert log == [("sleep", timing.QUEUE_CYCLES), "record", "run", "record"] * 2
    log.clear()
    timing.time_samples(lambda: log.append("run"), 8, 2)
    assert log == ["record", "run", "record"] * 2


def test_check_output():
    ref = torch.randn(4, 64)
    assert measure.check_output(ref + 1e-3 * torch.randn(4, 64), ref)[0]
    ok, err = measure.check_output(ref * 1.1, ref)
    assert not ok and err == pytest.approx(0.1, rel=1e-3)
    bad = ref.clone()
    bad[0, 0] = float("nan")
    assert measure.check_output(bad, ref) == (False, math.inf)


# -- layer counts, memory -------------------------------------------------------------------------------------------

def test_layer_count_choice():
    mb = 2**20
    assert measure.n_layers_for(30 * mb) == 8                 # 8 x 30 MB = 240 MB = 4 x 60 MB
    assert measure.n_layers_for(500 * mb) == 8                # at least 8
    assert measure.n_layers_for(10 * mb) == 24                # small layers: more of them
    assert measure.n_layers_for(7 * mb) == math.ceil(240 / 7)
    for name in ("qwen2.5-0.5b_decode_b1_s1024_bf16", "llama3-8b_decode_b8_s32768_bf16"):
        v = _variant(name)
        nb = layer_bytes(v.model, v.batch, [v.seq_len - 1] * v.batch)
        n = measure.n_layers_for(nb)
        assert n >= 8 and n * nb >= 4 * measure.L2_BYTES


def test_layer_count_memory_cap():
    mb = 2**20
    assert measure.choose_layers(30 * mb) == (8, None)
    assert measure.choose_layers(30 * mb, requested=3) == (3, None)
    assert measure.choose_layers(30 * mb, mem_per_layer=10**9, mem_avail=100e9) == (8, None)
    n, note = measure.choose_layers(300 * mb, mem_per_layer=10**10, mem_avail=55e9)
    assert n == 5 and "memory" in note                     # 5 x 300 MB still >= 4 x L2
    with pytest.raises(measure.BudgetError):
        measure.choose_layers(30 * mb, mem_per_layer=10**10, mem_avail=55e9)  # 5 x 30 MB < 4 x L2
    with pytest.raises(measure.BudgetError):
        measure.choose_layers(30 * mb, requested=4, mem_per_layer=10**10, mem_avail=5e9)


def test_every_default_variant_fits_an_h200():
    """The biggest KV (8B, batch 8, seq 32768: 1.07 GB per layer) with the default layer count fits ~130 GB."""
    worst = 0
    for v in gvariants.load(VARIANTS):
        nb = layer_bytes(v.model, v.batch, [v.seq_len - 1] * v.batch)
        per_layer, per_variant = measure.memory_estimate(v.model, v.batch, v.seq_len)
        n, note = measure.choose_layers(nb, mem_per_layer=per_layer, mem_avail=0.9 * 139e9 - per_variant)
        assert n >= 8 and note is None, v.name
        worst = max(worst, n * per_layer + per_variant)
    assert worst < 100e9


def test_default_compile_subset():
    vs = [v for v in gvariants.load(VARIANTS) if v.mode == "decode" and v.tp == 1]
    assert len(vs) == 45
    chosen = [v for v in vs if measure.wants_compile(v.name, measure.DEFAULT_COMPILE_SUBSET, False)]
    assert sorted((v.batch, v.seq_len) for v in chosen) == [(1, 4096)] * 5
    assert not any(measure.wants_compile(v.name, measure.DEFAULT_COMPILE_SUBSET, True) for v in vs)
    assert all(measure.wants_compile(v.name, ("*",), False) for v in vs)


# -- interleaving ---------------------------------------------------------------------------------------------------

def test_interleave_round_robin_pools_samples():
    calls = []
    runs = {p: (lambda p=p: calls.append(("run", p))) for p in ("fused", "eager", "torch_graph")}

    def sample(run, k):
        run()
        name = calls[-1][1]
        calls.append(("sample", name))
        return [float(len(calls))] * k

    pooled = measure.interleave(runs, rounds=3, reps_per_round=2, sample=sample)
    assert {p: len(s) for p, s in pooled.items()} == {"fused": 6, "eager": 6, "torch_graph": 6}
    order = [name for kind, name in calls if kind == "sample"]
    assert order == ["fused", "eager", "torch_graph", "eager", "torch_graph", "fused",
                     "torch_graph", "fused", "eager"]
    # one untimed warm-up run before each provider's samples in every round
    assert calls[:3] == [("run", "fused"), ("run", "fused"), ("sample", "fused")]
    assert measure.interleave({}, rounds=2, reps_per_round=2, sample=sample) == {}


def test_compiled_step_is_shared_by_distinct_layers():
    """One torch.compile of the wrapping function serves every layer of a stack (weights differ, code does not):
    checked with the eager backend, whose guards are those of any backend."""
    from torch._dynamo.utils import counters
    from bench.baselines import TorchLayer
    from generator import reference
    v = _variant("qwen2.5-0.5b_decode_b1_s1024_bf16")
    m = v.model
    layers = [TorchLayer(reference.random_weights(m, seed=i), m, v.batch, 64, device="cpu") for i in range(3)]
    for L in layers:
        L.k_cache.normal_()
        L.v_cache.normal_()
    x = torch.randn(v.batch, m.hidden).to(torch.bfloat16)
    pos = torch.full((v.batch,), 63, dtype=torch.int32)
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = torch.compile(providers.torch_layer_step, backend="eager", dynamic=False)
        y = x
        for L in layers:
            y = compiled(L, y, pos)
        assert counters["stats"]["unique_graphs"] == 1
        assert torch.isfinite(y.float()).all()
    finally:
        torch._dynamo.reset()


def test_baseline_passes_the_reference_check_on_cpu():
    """The bf16 TorchLayer is within REL_TOL of the fp32 reference (random caches, pos = seq_len-1)."""
    from bench.baselines import TorchLayer
    from generator import reference
    for name in ("qwen2.5-0.5b_decode_b4_s1024_bf16", "qwen3-1.7b_decode_b1_s1024_bf16"):
        v = _variant(name)
        m, S = v.model, 256
        W = reference.random_weights(m, seed=1)
        L = TorchLayer(W, m, v.batch, S, device="cpu")
        L.k_cache.normal_()
        L.v_cache.normal_()
        x = torch.randn(v.batch, m.hidden).to(torch.bfloat16)
        pos = torch.full((v.batch,), S - 1, dtype=torch.int32)
        ref = reference.decoder_layer(x, pos, W, L.k_cache.clone(), L.v_cache.clone(), m)
        holder = {}
        measure.stack_step([L], lambda layer, y: layer(y, pos), x, holder)()
        ok, err = measure.check_output(holder["first"].float(), ref)
        assert ok, (name, err)


# -- writing --------------------------------------------------------------------------------------------------------

def _fake_doc():
    rows = []
    for model, layers in (("tiny-a", 24), ("tiny-b", 16)):
        for batch in (1, 4, 8):
            for seq in (1024, 4096, 32768):
                name = f"{model}_decode_b{batch}_s{seq}_bf16"
                nbytes = 30_000_000 + batch * seq * 2048
                base = nbytes / 3000e9 * 1e6         # 75% of the 4000 GB/s copy bandwidth
                vr = [results.make_row(name, p, model=model, batch=batch, seq_len=seq, model_layers=layers,
                                    layers_timed=8, nbytes=nbytes, copy_gbps=4000.0,
                                    stats={"median": base * f, "p10": base * f * 0.95, "p90": base * f * 1.1})
                      for p, f in (("fused", 1.0), ("eager", 6.0), ("torch_graph", 1.8))]
                if batch != 4 and seq == 4096:
                    vr.append(results.make_row(name, "compile", model=model, batch=batch, seq_len=seq,
                                            model_layers=layers, layers_timed=8, nbytes=nbytes, copy_gbps=4000.0,
                                            stats={"median": base * 1.5, "p10": base * 1.4, "p90": base * 1.7},
                                            compile_s=12.5, compile_graphs=1))
                else:
                    vr.append(results.make_row(name, "compile", model=model, batch=batch, seq_len=seq,
                                            model_layers=layers, layers_timed=8, nbytes=nbytes, copy_gbps=4000.0,
                                            status="skipped", error="not in --compile-subset"))
                rows += results.add_speedups(vr)
    rows[1].update(status="failed-check", error="rel_err 5.00e-02 > 2e-02 vs the fp32 reference",
                   us_median=None, us_p10=None, us_p90=None, gbps=None, pct_bw=None, tokens_per_s=None)
    results.add_speedups(rows)
    return {"gpu": "NVIDIA H200", "date": "2026-01-02", "copy_gbps": 4000.0, "torch": "2.11.0", "cupy": "14.2.0",
            "elapsed_s": 123.4, "complete": True,
            "settings": {"reps": 40, "rounds": 4, "compile_subset": list(measure.DEFAULT_COMPILE_SUBSET),
                         "no_compile": False, "seed": 1, "positions": "seq_len-1"},
            "rows": rows}


def test_write_json_and_csv(tmp_path):
    doc = _fake_doc()
    jpath, cpath = results.write_results(doc, tmp_path / "results", "nvidia-h200-2026-01-02")
    assert jpath.name == "nvidia-h200-2026-01-02.json" and cpath.name == "nvidia-h200-2026-01-02.csv"
    back = json.loads(jpath.read_text())
    assert back["rows"] == doc["rows"] and back["gpu"] == "NVIDIA H200" and back["copy_gbps"] == 4000.0
    with open(cpath, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames[:len(results.FIELDS)] == results.FIELDS
        rows = list(reader)
    assert len(rows) == len(doc["rows"])
    assert rows[0]["provider"] == "fused" and float(rows[0]["us_median"]) == pytest.approx(doc["rows"][0]["us_median"])
    assert rows[1]["status"] == "failed-check" and rows[1]["us_median"] == ""     # None -> empty cell


def test_report_reads_the_bench_rows(tmp_path):
    """generator/report.py's latest_bench joins on these names."""
    from generator.report import latest_bench
    doc = _fake_doc()
    results.write_results(doc, tmp_path, "nvidia-h200-2026-01-02")
    got = latest_bench(tmp_path)
    fused = next(r for r in doc["rows"] if r["variant"] == "tiny-a_decode_b1_s4096_bf16" and r["provider"] == "fused")
    assert got["tiny-a_decode_b1_s4096_bf16"]["fused_us"] == fused["us_median"]
    assert got["tiny-a_decode_b1_s4096_bf16"]["speedup_compile"] == fused["speedup_vs_compile"] is not None
    assert got["tiny-a_decode_b1_s4096_bf16"]["speedup_torch_graph"] == pytest.approx(1.8)


def test_result_stem(tmp_path):
    assert results.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert results.result_stem(tmp_path, "NVIDIA H200", "2026-01-02") == "nvidia-h200-2026-01-02"
    (tmp_path / "nvidia-h200-2026-01-02.json").write_text("{}")
    again = results.result_stem(tmp_path, "NVIDIA H200", "2026-01-02")
    assert again.startswith("nvidia-h200-2026-01-02-") and again != "nvidia-h200-2026-01-02"
    # bench/e2e.py's default name: one `megakernel report` reads (report.latest_e2e: e2e-*.json)
    e2e = results.result_stem(tmp_path, "NVIDIA H200", "2026-01-02", prefix="e2e-")
    assert e2e == "e2e-nvidia-h200-2026-01-02" and Path(tmp_path / f"{e2e}.json").match("e2e-*.json")


def test_table_prints(tmp_path):
    from rich.console import Console
    con = Console(record=True, width=250)
    brun.print_table(_fake_doc(), con)
    text = " ".join(con.export_text().split())  # the caption may wrap
    assert "tiny-a_decode_b1_s4096_bf16" in text and "WRONG" in text and "elapsed 123 s" in text


# -- plots ----------------------------------------------------------------------------------------------------------

def test_plots_from_a_results_file(tmp_path):
    pytest.importorskip("matplotlib")
    from bench import plots
    jpath, _ = results.write_results(_fake_doc(), tmp_path, "nvidia-h200-2026-01-02")
    paths = plots.plot_results(jpath)
    names = sorted(p.name for p in paths)
    assert names == ["nvidia-h200-2026-01-02-tiny-a-batch.png", "nvidia-h200-2026-01-02-tiny-a-kvlen.png",
                     "nvidia-h200-2026-01-02-tiny-b-batch.png", "nvidia-h200-2026-01-02-tiny-b-kvlen.png"]
    for p in paths:
        assert p.parent == tmp_path and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_plots_module_command_line(tmp_path):
    pytest.importorskip("matplotlib")
    jpath, _ = results.write_results(_fake_doc(), tmp_path / "res", "x")
    out = tmp_path / "png"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "bench.plots", str(jpath), "--out-dir", str(out)], cwd=tmp_path,
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.glob("*.png")) == ["x-tiny-a-batch.png", "x-tiny-a-kvlen.png",
                                                         "x-tiny-b-batch.png", "x-tiny-b-kvlen.png"]
    r = subprocess.run([sys.executable, "-m", "bench.plots", str(tmp_path / "missing.json")], cwd=tmp_path,
                       env=env, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error:")


def test_plots_skip_untimed_models(tmp_path):
    pytest.importorskip("matplotlib")
    from bench import plots
    doc = _fake_doc()
    for r in doc["rows"]:
        if r["model"] == "tiny-b":
            r["status"] = "error"
    paths = plots.plot_results(doc, tmp_path, stem="s")
    assert sorted(p.name for p in paths) == ["s-tiny-a-batch.png", "s-tiny-a-kvlen.png"]
    assert plots.model_of({"variant": "llama3.2-1b_decode_b1_s4096_bf16"}) == "llama3.2-1b"


def _e2e_config(d: Path, **over) -> Path:
    """A config.json alone (what bench/e2e.variants_for reads): the e2e checkpoint's Llama-3.2-1B shape, `over`
    changed."""
    import transformers as T
    from bench import e2e
    kw = {**e2e.LLAMA_1B, "rope_parameters": {**e2e.ROPE, "rope_theta": 500000.0}, "dtype": "bfloat16", **over}
    T.LlamaConfig(**kw).save_pretrained(d)
    return d


def test_e2e_agreement_names_the_tie_gap_where_greedy_tokens_diverge():
    """bench/e2e.py's agreement with transformers fp32 (`_against_fp32`, CPU, a stub model): tokens equal before the
    first divergence, and there `tie_gap_rms`, fp32's gap between its token and ours at that step in rms of its row
    (teacher-forced on our tokens: the prefix is shared up to it); no gap where all agree."""
    import types
    from bench import e2e
    V, n = 8, 4
    base = torch.arange(V, dtype=torch.float32)  # the argmax is V - 1 at every step but the divergent one

    class Stub:
        device = torch.device("cpu")

        def __init__(self, diverge_at, ref_pick):
            self.at, self.pick = diverge_at, ref_pick

        def _row(self, t):
            r = base.clone()
            if t == self.at:  # fp32 picks ref_pick by a margin of 0.25 over token 6
                r[self.pick], r[6] = 10.0, 9.75
            return r

        def generate(self, ids, **kw):
            return torch.cat([ids, torch.tensor([[int(self._row(t).argmax()) for t in range(n)]])], 1)

        def __call__(self, input_ids):
            # (logits of every position; step t's, after the prompt of 32, at position 31 + t)
            return types.SimpleNamespace(logits=torch.stack([self._row(t - 31) if t >= 31 else base
                                                             for t in range(input_ids.shape[1])])[None])
    ids = torch.zeros(1, 32, dtype=torch.long)
    ours = [7, 7, 6, 7]  # diverges at step 2 (fp32: token 5)
    got = e2e._against_fp32(ours, torch.stack([base] * n), ids, Stub(2, 5), n)
    rms = float(torch.tensor([0, 1, 2, 3, 4, 10.0, 9.75, 7]).pow(2).mean().sqrt())
    assert got["greedy_tokens_equal_before_divergence"] == 2 and got["tie_gap_rms"] == pytest.approx(0.25 / rms)
    same = e2e._against_fp32([7] * n, torch.stack([base] * n), ids, Stub(-1, 5), n)
    assert same["greedy_tokens_equal_before_divergence"] == n and "tie_gap_rms" not in same


def test_e2e_serves_a_checkpoints_declared_variants_else_its_own_entry(tmp_path, monkeypatch, capsys):
    """bench/e2e.py builds what it serves first (a fresh machine needs no build step of its own): for its own
    Llama-3.2-1B-shaped checkpoint the declared decode b1/4/8 and prefill variants; for a checkpoint whose layer (or
    seq_len) variants.yaml does not declare, the checkpoint's from-hf entry at decode b1/4/8 in
    <build-dir>/e2e-variants.yaml; a config it cannot map is one error line, exit 2, nothing built."""
    from bench import e2e
    from generator import compile as gcompile
    built = []

    def fake_build(vs, build_dir, **kw):  # (the compiles themselves are the build tests')
        built.append(([v.name for v in vs], Path(kw["variants_file"]).name))
        return {"entries": [{"name": v.name, "status": "ok"} for v in vs]}
    monkeypatch.setattr(gcompile, "build", fake_build)
    one_b = _e2e_config(tmp_path / "1b")
    vs, vf = e2e.variants_for(one_b, 4096, str(tmp_path / "b"))
    dec = sorted(v.name for v in vs if v.mode == "decode")
    assert dec == [f"llama3.2-1b_decode_b{b}_s4096_bf16" for b in (1, 4, 8)] and vf.name == "variants.yaml"
    assert len([v for v in vs if v.mode == "prefill"]) == 10 and built[-1][1] == "variants.yaml"
    # a seq_len not declared for it, and a shape not declared at all (hidden 1024): the checkpoint's own entry
    for ckpt, seq in ((one_b, 2048), (_e2e_config(tmp_path / "half", hidden_size=1024, intermediate_size=2816,
                                                  num_attention_heads=16, num_key_value_heads=4), 4096)):
        vs, vf = e2e.variants_for(ckpt, seq, str(tmp_path / "b"))
        assert vf == tmp_path / "b" / "e2e-variants.yaml" and built[-1][1] == "e2e-variants.yaml"
        assert sorted((v.mode, v.batch, v.seq_len) for v in vs) == [("decode", b, seq) for b in (1, 4, 8)]
        assert vs[0].model.hidden == (2048 if ckpt == one_b else 1024)
        assert all(v.model.name.startswith("e2e-") for v in vs)  # (never a declared name, nor its tuned plan)
    from generator import manifest
    assert manifest.foreign_entries(tmp_path / "b") == []  # (`megakernel clean` takes the directory)
    n = len(built)
    mistral = tmp_path / "sw"  # a sliding window shorter than the cache that is not computed (llama's): one line
    _e2e_config(mistral)
    cfg = json.loads((mistral / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps({**cfg, "sliding_window": 1024}))
    for ckpt, word in ((_e2e_config(tmp_path / "bad", hidden_act="relu"), "hidden_act"), (mistral, "sliding_window")):
        with pytest.raises(SystemExit) as exc:
            e2e.variants_for(ckpt, 4096, str(tmp_path / "b2"))
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and len(err.splitlines()) == 1 and word in err and len(built) == n, err
        assert not (tmp_path / "b2").exists()
    # the options a run could not serve, refused before anything is built or made (on a GPU or not)
    for argv, word in ((["--seq-len", "1024"], "--seq-len 1024: at least 2048"),
                       (["--seq-len", "2048", "--new-tokens", "4000"], "--seq-len 2048: at least 4009"),
                       (["--new-tokens", "1"], "--new-tokens 1 / --reps 3: at least 2 / 1"),
                       (["--skip", "hf_compile"], "invalid choice: 'hf_compile'"),
                       (["--ckpt", str(tmp_path / "bad")], "hidden_act"),
                       (["--ckpt", str(tmp_path / "typo")], "no config.json there")):
        with pytest.raises(SystemExit) as exc:
            e2e.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and word in err[-1] and not (tmp_path / "typo").exists()


E2E_RESULT = ROOT / "bench" / "results" / "e2e-h200-2026-11-30-1.json"
PNG = b"\x89PNG\r\n\x1a\n"


def _e2e_doc(**extra) -> dict:
    """An e2e result without the optional keys (no long-context figure, kernel bound, layer call times, agreement),
    one provider failed."""
    return {"gpu": "NVIDIA H200", "providers": {
        "served (fused, graph)": {"ttft_ms_128": 3.1, "ttft_ms_2048": 12.0, "ms_per_token_b1": 0.9,
                                  "ms_per_token_b8": 1.1},
        "transformers eager": {"ttft_ms_128": 16.2, "ttft_ms_2048": 16.4, "ms_per_token_b1": 11.3,
                               "ms_per_token_b8": 11.2},
        "transformers static + compile": {"error": "RuntimeError: boom"}}, **extra}


def test_plot_e2e_from_the_committed_result(tmp_path):
    pytest.importorskip("matplotlib")
    from bench import plots
    paths = plots.plot_e2e(E2E_RESULT, tmp_path)
    assert [p.name for p in paths] == ["e2e-h200-2026-11-30-1.png"] and paths[0].parent == tmp_path
    assert paths[0].read_bytes()[:8] == PNG and paths[0].stat().st_size > 10000
    (tmp_path / "next").mkdir()
    copy = tmp_path / "next" / E2E_RESULT.name
    copy.write_text(E2E_RESULT.read_text())
    assert plots.plot_e2e(copy) == [tmp_path / "next" / "e2e-h200-2026-11-30-1.png"]  # next to the JSON by default
    assert (ROOT / "bench" / "results" / "e2e-h200-2026-11-30-1.png").read_bytes()[:8] == PNG  # the committed plot


def test_plot_e2e_without_optional_keys_and_a_failed_provider(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.axes import Axes
    from bench import plots
    drawn = []
    real_bar = Axes.bar
    monkeypatch.setattr(Axes, "bar", lambda self, x, h, *a, **kw: drawn.append((kw.get("label"), list(h)))
                        or real_bar(self, x, h, *a, **kw))
    paths = plots.plot_e2e(_e2e_doc(), tmp_path)
    assert [p.name for p in paths] == ["e2e-nvidia-h200.png"] and paths[0].read_bytes()[:8] == PNG
    assert dict(drawn) == {"128-token prompt": [3.1, 16.2], "2,048-token prompt": [12.0, 16.4],
                           "batch 1": [0.9, 11.3], "batch 8": [1.1, 11.2]}  # the failed provider: no bar
    drawn.clear()
    doc = _e2e_doc(date="2026-12-01")
    doc["providers"]["served (fused, graph)"]["ms_per_token_b1_long"] = 1.9
    assert [p.name for p in plots.plot_e2e(doc, tmp_path)] == ["e2e-nvidia-h200-2026-12-01.png"]
    assert dict(drawn)["batch 1, near the end of the cache"] == [1.9]
    failed = {"gpu": "x", "providers": {"a": {"error": "no"}}}
    assert plots.plot_e2e(failed, tmp_path) == []


def test_plots_command_line_tells_e2e_files(tmp_path):
    pytest.importorskip("matplotlib")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    bench_json, _ = results.write_results(_fake_doc(), tmp_path / "res", "x")
    r = subprocess.run([sys.executable, "-m", "bench.plots", str(E2E_RESULT), str(bench_json), "--out-dir",
                        str(tmp_path / "png")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "e2e-h200-2026-11-30-1.png" in {p.name for p in (tmp_path / "png").glob("*.png")}
    assert "x-tiny-a-batch.png" in {p.name for p in (tmp_path / "png").glob("*.png")}


def test_report_shows_the_newest_e2e_result(tmp_path):
    """`megakernel report`'s end-to-end section: the newest e2e-*.json of the build's architecture, optional keys
    absent or present."""
    from rich.console import Console
    from generator.report import latest_e2e, print_e2e
    assert latest_e2e(tmp_path) is None
    (tmp_path / "e2e-h200-2026-11-30-1.json").write_text(E2E_RESULT.read_text())
    newer = _e2e_doc(kernel_bound={"layers_us": 700.0, "lm_head_us": 60.0, "bound_ms": 0.76, "ratio": 1.18})
    newer["providers"]["served (fused, graph)"]["ms_per_token_b1_long"] = 1.9
    (tmp_path / "e2e-h200-2026-12-02.json").write_text(json.dumps(newer))
    a100 = _e2e_doc(gpu="NVIDIA A100-SXM4-80GB")
    (tmp_path / "e2e-a100-2026-12-05.json").write_text(json.dumps(a100))
    (tmp_path / "gpu_check-h200-2026-12-09.json").write_text(json.dumps(_e2e_doc()))  # not an e2e-*.json
    (tmp_path / "e2e-broken-2026-12-09.json").write_text("{not json")
    assert latest_e2e(tmp_path)["file"] == "e2e-a100-2026-12-05.json"        # no arch: the newest
    e2e = latest_e2e(tmp_path, {"90"})
    assert e2e["file"] == "e2e-h200-2026-12-02.json" and e2e["agreement"] == {} and "layer_call_us" not in e2e
    assert e2e["providers"]["transformers static + compile"] == {"error": "RuntimeError: boom"}
    assert e2e["providers"]["served (fused, graph)"]["ms_per_token_b1_long"] == 1.9
    con = Console(width=100, record=True, color_system=None)
    print_e2e(e2e, con)
    text = con.export_text()
    for must in ("e2e-h200-2026-12-02.json", "b1 long", "1.900", "11.300", "error: RuntimeError: boom", "1.18 ×"):
        assert must in text, (must, text)
    assert "before divergence" not in text                                    # no agreement recorded
    (tmp_path / "e2e-h200-2026-12-02.json").unlink()
    e2e = latest_e2e(tmp_path, {"90a"})
    assert e2e["file"] == "e2e-h200-2026-11-30-1.json" and e2e["kernel_bound"] is None
    con = Console(width=80, record=True, color_system=None)
    print_e2e(e2e, con)
    text = " ".join(con.export_text().split())
    assert "fused bf16 32 of 32 (logits 1.1e-02), unfused fp32 32 of 32 (logits 1.7e-06)" in text  # rel. errors
    assert "b1 long" not in text and "0.891" in text
    # transformers' own bf16 against fp32 (the yardstick, session 33); an agreement without a logits error
    yard = _e2e_doc(agreement_hf_bf16_vs_hf_fp32={"greedy_tokens_equal_before_divergence": 30, "of": 32,
                                                   "logits_rel_err": 0.0141},
                    agreement_fused_bf16_vs_hf_fp32={"greedy_tokens_equal_before_divergence": 32, "of": 32})
    (tmp_path / "e2e-h200-2026-12-10.json").write_text(json.dumps(yard))
    con = Console(width=200, record=True, color_system=None)
    print_e2e(latest_e2e(tmp_path, {"90"}), con)
    text = " ".join(con.export_text().split())
    assert "fused bf16 32 of 32, transformers bf16 30 of 32 (logits 1.4e-02)" in text, text
    assert "×" not in text
    # every figure column (the sampled ones too) at a narrow terminal: a cut figure ends in "…", never a shorter
    # number; a figure that is no number (hand-edited) is left out, not a traceback
    full = _e2e_doc()
    full["providers"]["served (fused, graph)"].update(ms_per_token_b1_long=0.827, ms_per_token_b1_sampled=0.821,
                                                      ms_per_token_b1_sampled_topp="nan")
    (tmp_path / "e2e-h200-2026-12-11.json").write_text(json.dumps(full))
    e2e = latest_e2e(tmp_path, {"90"})
    assert "ms_per_token_b1_sampled_topp" not in e2e["providers"]["served (fused, graph)"]
    for width in (60, 80, 90, 200):  # (narrow: the columns over several tables, every figure whole)
        con = Console(width=width, record=True, color_system=None)
        print_e2e(e2e, con)
        text = con.export_text()
        assert all(len(line) <= width for line in text.splitlines()), (width, text)
        for must in ("0.821", "0.827", "b1 sampled", "e2e-h200-2026-12-11.json"):
            assert must in text, (width, must, text)


def test_report_json_carries_the_e2e_section(copy_build, tmp_path):
    from rich.console import Console
    from generator import report as greport
    d = copy_build(tmp_path / "build")
    bench_dir = tmp_path / "results"
    bench_dir.mkdir()
    rep = greport.build_report(d, bench_dir=bench_dir, gpu=False)
    assert rep["e2e"] is None
    con = Console(width=120, record=True, color_system=None)
    greport.print_report(rep, con)
    assert "end to end" not in con.export_text()
    # a run of another model (the benchmark's Llama-3.2-1B variants): in report.json, not printed (a user's own
    # build is not the benchmark's checkpoint: a new user's trial read the line as noise)
    (bench_dir / E2E_RESULT.name).write_text(E2E_RESULT.read_text())
    rep = greport.build_report(d, bench_dir=bench_dir, gpu=False)
    assert rep["e2e"] is not None
    con = Console(width=120, record=True, color_system=None)
    greport.print_report(rep, con)
    text = con.export_text()
    assert "end to end" not in text and "transformers eager" not in text
    # a run that served one of this report's variants: tabled
    doc = json.loads(E2E_RESULT.read_text())
    doc["providers"]["served (fused, graph)"]["decode_path_b1"] = rep["rows"][0]["name"]
    (bench_dir / E2E_RESULT.name).write_text(json.dumps(doc))
    greport.build_report(d, bench_dir=bench_dir, gpu=False)
    rep = json.loads((d / "report.json").read_text())
    assert rep["e2e"]["file"] == E2E_RESULT.name
    assert rep["e2e"]["providers"]["transformers eager"]["ms_per_token_b8"] == pytest.approx(11.160217559055077)
    con = Console(width=120, record=True, color_system=None)
    greport.print_report(rep, con)
    text = con.export_text()
    assert "end to end" in text and "transformers eager" in text and "e2e-h200-2026-11-30-1.json" in text
    # the benchmark's own checkpoint is named: its figures are not the variants file's model's
    ck = Path(json.loads(E2E_RESULT.read_text())["checkpoint"]).name
    assert rep["e2e"]["checkpoint"] and f"checkpoint {ck}" in text


def test_report_says_when_the_figures_were_timed_with_another_plan(copy_build, tmp_path):
    """gpu_check rows record the knobs of the plan they timed; the report says "timed: other plan" where the build
    plans otherwise (a tuned entry refused or edited, --no-tuned, a planner change), and nothing where they agree."""
    from rich.console import Console
    from generator import report as greport
    from generator.compile import read_manifest
    from generator.tune import knob_dict
    d = copy_build(tmp_path / "build")
    name, e = next((n, e) for n, e in read_manifest(d)["variants"].items() if e["plan"]["mode"] == "decode")
    knobs = knob_dict(e["plan"])
    bench_dir = tmp_path / "results"
    bench_dir.mkdir()
    for i, k in enumerate((knobs, {**knobs, "X_FRAG": 1 - knobs["X_FRAG"]})):
        (bench_dir / "gpu_check.json").write_text(json.dumps({"gpu": "NVIDIA H200", "date": f"2026-12-0{i + 1}", "rows": [
            {"variant": name, "us": 10.0, "pct_bw": 50.0, "speedup": 2.0, "pass": True, "knobs": k}]}))
        rep = greport.build_report(d, bench_dir=bench_dir, gpu=False, write=False)
        row = next(r for r in rep["rows"] if r["name"] == name)
        assert row["timed_plan"] == ("same", "other")[i] and "timed_knobs" not in row
        con = Console(width=200, record=True, color_system=None)
        greport.print_report(rep, con, wide=True)
        assert ("timed: other plan" in con.export_text()) == (i == 1)
        narrow = Console(width=80, record=True, color_system=None)  # the plan column dropped: the footer says it
        greport.print_report(rep, narrow)
        assert ("timed with another plan than the one built: " + name in narrow.export_text().replace("\n", " ")) \
            == (i == 1)


def test_report_names_rows_timed_on_another_gpu(copy_build, tmp_path):
    """Each variant's figures are its newest run's: where a later check of a few rows ran on another GPU, the report
    marks those rows' µs with † and names them and their GPU under the table (one GPU for every row: neither)."""
    from rich.console import Console
    from generator import report as greport
    from generator.compile import read_manifest
    d = copy_build(tmp_path / "build")
    names = [n for n, e in read_manifest(d)["variants"].items() if e["plan"]["mode"] == "decode"][:2]
    bench_dir = tmp_path / "results"
    bench_dir.mkdir()
    for i, (gpu, rows) in enumerate((("NVIDIA H200", names), ("NVIDIA H100 80GB HBM3", names[:1]))):
        (bench_dir / f"gpu_check-{i}.json").write_text(json.dumps({"gpu": gpu, "date": f"2026-12-0{i + 1}", "rows": [
            {"variant": n, "us": 10.0, "pct_bw": 50.0, "speedup": 2.0, "pass": True} for n in rows]}))
        rep = greport.build_report(d, bench_dir=bench_dir, gpu=False, write=False)
        con = Console(width=300, record=True, color_system=None)
        greport.print_report(rep, con, wide=True)
        raw = con.export_text()  # (export_text clears the record: read once)
        text = raw.replace("\n", " ")
        assert ("† timed on NVIDIA H100 80GB HBM3, not NVIDIA H200 as the others: " + names[0] in text) == (i == 1)
        assert "timed on" not in text or i == 1
        # the row itself is marked in the table (its fused µs), the others not
        rows = [line for line in raw.splitlines() if "timed on" not in line]
        marks = {n: next(line for line in rows if n in line).count("10.0†") for n in names}
        assert marks == {names[0]: int(i == 1), names[1]: 0}, marks


def test_queued_ab_cases_each_plan_a_kernel_of_their_own():
    """bench/queue.sh's A/B parts (the next device calls): every `--case NAME OVERRIDES` names a decode variant the
    planner accepts with those overrides on top of the plan `build` gives it, and plans a kernel other than that base
    (bench/ab.py refuses a case equal to its base, which stops the whole part: a device call lost when a planner
    default moves under a queued case, as session 50's review found)."""
    import re
    from bench import find_decode
    from generator import render
    from generator.tune import knob_dict
    text = (ROOT / "bench" / "queue.sh").read_text()
    shell = {"B1": "", "HALF": ""}
    shell.update(re.findall(r"^(B1|HALF)=(\S+)$", text, re.M))
    for m in re.finditer(r"(\w+)='(\{[^']*\})'", text):  # local off='{...}' l='{...}' o='{...}'
        shell[m.group(1)] = m.group(2)
    cases = re.findall(r"--case (\S+) ('\{[^']*\}'|\"\$\w+\")", text)
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())  # (a comment may name --case)
    assert len(cases) == code.count("--case ")  # (the regexes above still find every queued case; none is legal)
    for name, ov in cases:
        name = re.sub(r"\$(\w+)", lambda m: shell[m.group(1)], name)
        ov = json.loads(ov.strip("'") if ov.startswith("'") else shell[ov.strip('"$')])
        v, base, _ = find_decode(name, [str(ROOT / "bench" / "queue-variants.yaml"),
                                        str(ROOT / "bench" / "results" / "gpu_check-s60-variants.yaml")], "--case")
        planned = knob_dict(render.plan(v, overrides={**base, **ov}))
        assert planned != knob_dict(render.plan(v, overrides=base)), (name, ov)


# -- command line ---------------------------------------------------------------------------------------------------

def test_bench_cli_help():
    r = CliRunner().invoke(brun.cli, ["--help"], prog_name="megakernel bench")
    assert r.exit_code == 0, r.output
    for opt in ("--variants", "--only", "--build-dir", "--out-dir", "--layers", "--reps", "--compile-subset",
                "--no-compile", "--seed"):
        assert opt in r.output


def test_megakernel_bench_help_forwards(monkeypatch):
    """What `megakernel bench --help` prints once generator/cli.py's bench command leaves --help to bench.run."""
    from generator.cli import main
    monkeypatch.setattr(main.commands["bench"], "add_help_option", False)
    r = CliRunner().invoke(main, ["bench", "--help"])
    assert r.exit_code == 0, r.output
    assert "megakernel bench" in r.output and "--compile-subset" in r.output


def test_megakernel_bench_help():
    from generator.cli import main
    r = CliRunner().invoke(main, ["bench", "--help"])
    assert r.exit_code == 0, r.output
    if "--compile-subset" not in r.output:
        pytest.xfail("generator/cli.py's bench command answers --help itself (needs add_help_option=False)")


def test_megakernel_bench_without_gpu_exits_2(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from generator.cli import main
    r = CliRunner().invoke(main, ["bench", "--variants", str(VARIANTS), "--out-dir", str(tmp_path / "res")])
    assert r.exit_code == 2, (r.output, r.exception)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "CUDA GPU" in lines[0], r.output
    assert not (tmp_path / "res").exists()


def test_bench_rejects_bad_options():
    r = CliRunner().invoke(brun.cli, ["--layers", "0"])
    assert r.exit_code == 2


# -- one variant end to end, on the CPU -----------------------------------------------------------------------------

def _small_variant(batch=2, seq_len=96):
    import dataclasses
    v = _variant("qwen2.5-0.5b_decode_b1_s1024_bf16")
    return dataclasses.replace(v, batch=batch, seq_len=seq_len)


def test_bench_variant_end_to_end_on_cpu(tmp_path):
    """The whole per-variant flow (stacks, reference check, compile once, interleaved timing, rows) with the CPU
    backend; the fused provider reports its load error (nothing is built in tmp_path) instead of being timed."""
    v = _small_variant()
    logs = []
    rows, info = measure.bench_variant(v, build_dir=str(tmp_path / "build"), fused_error=None, layers=2, seed=3,
                                    rounds=2, reps=4, compile_mode="yes", copy_gbps=100.0, log=logs.append,
                                    backend=measure.cpu_backend())
    by = {r["provider"]: r for r in rows}
    assert list(by) == list(providers.PROVIDER_NAMES)
    assert by["fused"]["status"] == "error" and "LoadError" in by["fused"]["error"]
    assert by["fused"]["speedup_vs_eager"] is None
    for p in ("eager", "torch_graph", "compile"):
        r = by[p]
        assert r["status"] == "ok", (p, r["error"])
        assert r["layers_timed"] == 2 and r["us_median"] > 0 and r["us_p10"] <= r["us_median"] <= r["us_p90"]
        assert r["rel_err"] is not None and r["rel_err"] <= measure.REL_TOL
        assert r["bytes"] == layer_bytes(v.model, v.batch, [v.seq_len - 1] * v.batch)
    assert by["compile"]["compile_graphs"] == 1 and info["compile_s"] is not None
    assert not logs


def test_bench_variant_reports_a_wrong_provider(tmp_path, monkeypatch):
    """A provider whose layer-0 output is off is reported (failed-check), not timed; skipped compile says why."""
    from bench.baselines import TorchLayer
    real = TorchLayer.__call__
    monkeypatch.setattr(TorchLayer, "__call__", lambda self, x, pos: real(self, x, pos) * 1.5)
    rows, _ = measure.bench_variant(_small_variant(batch=1), build_dir=str(tmp_path), fused_error="build refused: x",
                                 layers=2, seed=1, rounds=1, reps=2, compile_mode="not in --compile-subset",
                                 copy_gbps=100.0, log=lambda m: None, backend=measure.cpu_backend())
    by = {r["provider"]: r for r in rows}
    assert (by["fused"]["status"], by["fused"]["error"]) == ("error", "build refused: x")
    for p in ("eager", "torch_graph"):
        assert by[p]["status"] == "failed-check" and by[p]["us_median"] is None and "rel_err" in by[p]["error"]
    assert (by["compile"]["status"], by["compile"]["error"]) == ("skipped", "not in --compile-subset")


def test_bench_variant_memory_skip(tmp_path):
    rows, _ = measure.bench_variant(_small_variant(), build_dir=str(tmp_path), fused_error=None, layers=None, seed=1,
                                 rounds=1, reps=1, compile_mode="yes", copy_gbps=100.0, log=lambda m: None,
                                 backend=measure.cpu_backend(mem_free=1e6))
    assert all(r["status"] == "skipped" and r["error"].startswith("memory:") for r in rows)


TINY = """
matrix: {mode: [decode], batch: [1, 2], seq_len: [64, 128]}
models:
  tiny:
    hidden: 128
    heads: 4
    kv_heads: 2
    head_dim: 32
    intermediate: 256
    layers: 4
    norm: rmsnorm
    norm_eps: 1.0e-6
    rope_theta: 10000.0
    activation: silu
    qkv_bias: false
    qk_norm: false
    dtype: bf16
"""


def _fake_gpu(monkeypatch, built_status="ok"):
    import bench.timing
    from generator import compile as gcompile
    monkeypatch.setattr(brun, "require_cuda", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU 80GB")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench.timing, "copy_bandwidth", lambda *a, **k: 100.0)
    monkeypatch.setattr(brun, "cuda_backend", measure.cpu_backend)
    from generator import toolchain
    monkeypatch.setattr(toolchain, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(gcompile, "build", lambda vs, build_dir, **k: {
        "entries": [{"name": v.name, "status": built_status,
                     **({} if built_status == "ok" else {"error": f"{v.name}: too big\nmore"})} for v in vs],
        "distinct": len(vs), "errors": []})


def test_cli_end_to_end_with_a_fake_gpu(tmp_path, monkeypatch):
    """The command's whole flow on the CPU backend: files, plots, the table last, the elapsed time."""
    import importlib.util
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    _fake_gpu(monkeypatch)
    (tmp_path / "v.yaml").write_text(TINY)
    out = tmp_path / "results"
    r = CliRunner().invoke(brun.cli, ["--variants", str(tmp_path / "v.yaml"), "--build-dir", str(tmp_path / "b"),
                                      "--out-dir", str(out), "--layers", "2", "--reps", "2", "--rounds", "2",
                                      "--compile-subset", "*_b1_s64_*", "--seed", "7"],
                           prog_name="megakernel bench")
    assert r.exit_code == 0, (r.output, r.exception)
    assert "pos = seq_len-1" in r.output and "torch.compile" in r.output and "1 of 4 variants" in r.output
    assert "elapsed" in r.output.split("megakernel bench: µs per layer")[-1]       # the table (and its caption) last
    date = __import__("time").strftime("%Y-%m-%d")
    stem = f"fake-gpu-80gb-{date}"
    doc = json.loads((out / f"{stem}.json").read_text())
    assert doc["complete"] and doc["gpu"] == "Fake GPU 80GB" and doc["copy_gbps"] == 100.0
    assert doc["settings"]["seed"] == 7 and doc["elapsed_s"] > 0 and doc["torch"] == torch.__version__
    assert len(doc["rows"]) == 4 * len(providers.PROVIDERS)
    by = {(r["variant"], r["provider"]): r for r in doc["rows"]}
    assert by[("tiny_decode_b1_s64_bf16", "compile")]["status"] == "ok"
    assert by[("tiny_decode_b2_s128_bf16", "compile")]["status"] == "skipped"
    assert all(by[(v, "eager")]["status"] == "ok" for v, _ in by)
    assert all(by[(v, "fused")]["status"] == "error" for v, _ in by)      # nothing built for real
    assert (out / f"{stem}.csv").exists()
    if has_mpl:
        assert sorted(p.name for p in out.glob("*.png")) == [f"{stem}-tiny-batch.png", f"{stem}-tiny-kvlen.png"]
    else:
        assert "warning: plots not written" in r.output


def test_cli_time_budget_and_refused_builds(tmp_path, monkeypatch):
    _fake_gpu(monkeypatch, built_status="refused")
    (tmp_path / "v.yaml").write_text(TINY)
    out = tmp_path / "results"
    r = CliRunner().invoke(brun.cli, ["--variants", str(tmp_path / "v.yaml"), "--out-dir", str(out), "--layers", "1",
                                      "--reps", "1", "--rounds", "1", "--no-compile", "--no-plots", "--seed", "1",
                                      "--time-budget", "0.001"])
    assert r.exit_code == 0, (r.output, r.exception)
    doc = json.loads(next(out.glob("*.json")).read_text())
    assert {r["status"] for r in doc["rows"]} == {"skipped"}
    assert all("time budget" in r["error"] for r in doc["rows"])
    assert not list(out.glob("*.png"))


def test_cli_bad_only(tmp_path, monkeypatch):
    _fake_gpu(monkeypatch)
    r = CliRunner().invoke(brun.cli, ["--variants", str(VARIANTS), "--only", "nope*"])
    assert r.exit_code == 2 and "no single-GPU variant matches --only nope*" in r.output
    r = CliRunner().invoke(brun.cli, ["--variants", str(VARIANTS), "--only", "*_tp2"])  # tp_check's, not bench's
    assert r.exit_code == 2 and "bench/tp_check.py" in r.output


# -- the split: registry, best baseline, help, imports ----------------------------------------------------------------

def test_bench_help_states_the_default_compile_subset():
    r = CliRunner().invoke(brun.cli, ["--help"], prog_name="megakernel bench", terminal_width=200)
    text = " ".join(r.output.split())
    assert "batch 1 and 8" not in text
    assert "batch 1 at seq_len 4096" in text
    assert all(g in text for g in measure.DEFAULT_COMPILE_SUBSET)           # show_default prints the globs
    chosen = [v for v in gvariants.load(VARIANTS) if measure.wants_compile(v.name, measure.DEFAULT_COMPILE_SUBSET,
                                                                             False)]
    assert {(v.batch, v.seq_len) for v in chosen} == {(1, 4096)}             # what the help says
    assert len(chosen) == len({v.model.name for v in gvariants.load(VARIANTS)})  # one variant per model


def test_registry_is_a_list_of_providers():
    names = [p.name for p in providers.PROVIDERS]
    assert names == ["fused", "eager", "torch_graph", "compile", "serving", "flashinfer"]
    assert providers.PROVIDER_NAMES == tuple(names)
    assert providers.BASELINES == ("eager", "torch_graph", "compile", "serving", "flashinfer")
    assert [p.graph for p in providers.PROVIDERS] == [True, False, True, True, True, True]
    assert providers.by_name("compile").compile_mode == "default"
    assert providers.by_name("serving").compile_mode == "max-autotune-no-cudagraphs"
    # the torch baselines share one stack; the fused layer has its own
    keys = {p.name: p.stack_key for p in providers.PROVIDERS}
    assert keys["eager"] is keys["torch_graph"] is keys["compile"] and keys["fused"] != keys["eager"]
    src = (ROOT / "bench" / "providers.py").read_text()
    assert "ServingLayer" in src and "FlashInferLayer" in src and "flashinfer_available" in src  # the marked place


def test_best_baseline_is_the_fastest_one_present():
    rows = [_row("fused", 50.0), _row("eager", 400.0), _row("torch_graph", 100.0), _row("compile", 80.0)]
    results.add_speedups(rows)
    assert (rows[0]["best_baseline"], rows[0]["speedup_vs_best"]) == ("compile", pytest.approx(1.6))
    rows = [_row("fused", 50.0), _row("eager", 400.0), _row("torch_graph", 100.0),
            _row("compile", 0, status="error", error="x"), _row("newbase", 60.0)]  # not registered: still a baseline
    results.add_speedups(rows)
    assert (rows[0]["best_baseline"], rows[0]["speedup_vs_best"]) == ("newbase", pytest.approx(1.2))
    assert rows[0]["speedup_vs_newbase"] == pytest.approx(1.2) and rows[0]["speedup_vs_compile"] is None


def test_table_shows_the_best_baseline():
    from rich.console import Console
    con = Console(record=True, width=250)
    brun.print_table(_fake_doc(), con)
    text = con.export_text()
    assert "× best" in text and "compile" in text and "graph µs" in text
    line = next(ln for ln in text.splitlines() if "tiny-a_decode_b1_s4096_bf16" in ln)
    assert "1.50" in line and "compile" in line                               # compile is 1.5x, graph 1.8x


def test_a_new_provider_is_one_class(tmp_path):
    """A provider added to the list is built, checked, timed and compared like the others (CPU backend)."""
    from bench.baselines import TorchLayer

    class Slow(TorchLayer):
        def __call__(self, x, pos):
            for _ in range(3):
                out = super().__call__(x, pos)
            return out

    class SlowProvider(providers.TorchEager):
        name, label = "slow", "slow"
        layer_class = Slow

    class Missing(providers.TorchEager):
        name, label = "missing", "missing"

        def unavailable(self, v):
            return "library not installed"

    regs = [*providers.PROVIDERS, SlowProvider(), Missing()]
    rows, _ = measure.bench_variant(_small_variant(batch=1), build_dir=str(tmp_path), fused_error="build refused: x",
                                    layers=2, seed=1, rounds=1, reps=2, compile_mode="not in --compile-subset",
                                    copy_gbps=100.0, log=lambda m: None, backend=measure.cpu_backend(),
                                    providers=regs)
    by = {r["provider"]: r for r in rows}
    assert list(by) == [p.name for p in regs]
    assert by["slow"]["status"] == "ok" and by["slow"]["rel_err"] <= measure.REL_TOL and by["slow"]["us_median"] > 0
    assert (by["missing"]["status"], by["missing"]["error"]) == ("skipped", "library not installed")


def test_library_never_imports_the_cli_or_bench():
    import ast
    for path in sorted((ROOT / "generator").glob("*.py")):
        if path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [("." * node.level) + (node.module or "")] + [f".{a.name}" for a in node.names
                                                                    if node.level and not node.module]
            for mod in mods:
                assert not mod.startswith("bench") and mod not in (".cli", "generator.cli") \
                    and not mod.startswith(".cli"), f"{path.name} imports {mod}"
    # and the bench modules each hold one idea: no CLI in the providers, measurement or results
    for name in ("providers", "measure", "results"):
        src = (ROOT / "bench" / f"{name}.py").read_text()
        assert "import click" not in src and "bench.run" not in src, name


def test_report_reads_gpu_check_rows_newest_first(tmp_path):
    """`megakernel report` shows the newest measured figures, gpu_check's decode and prefill rows included."""
    from generator.report import latest_bench
    old = {"date": "2026-11-29", "rows": [{"variant": "a_decode_b1_s64_bf16", "us": 50.0, "pct_bw": 60.0,
                                           "speedup": 3.0, "speedup_vs_best": 1.5, "best_baseline": "flashinfer"},
                                          {"variant": "a_prefill_b1_s128_bf16", "mode": "prefill", "us": 200.0,
                                           "tflops": 80.0, "speedup": 0.9, "route": "unfused", "pass": True}]}
    new = {"date": "2026-11-30", "time": "10:00:00", "rows": [
        {"variant": "a_decode_b1_s64_bf16", "us": 40.0, "pct_bw": 70.0, "speedup": 3.5, "speedup_vs_best": 1.6,
         "best_baseline": "torch_graph"},
        {"variant": "a_prefill_b1_s16_bf16", "mode": "prefill", "us": 140.0, "tflops": 13.9, "speedup": 1.1,
         "route": "fused"},
        {"variant": "a_prefill_b1_s64_bf16", "mode": "prefill", "error": "not built"},
        {"variant": "a_prefill_b1_s128_bf16", "mode": "prefill", "us": 150.0, "tflops": 99.0, "speedup": 1.2,
         "route": "fused", "pass": False}]}
    (tmp_path / "gpu_check-old.json").write_text(json.dumps(old))
    (tmp_path / "gpu_check-new.json").write_text(json.dumps(new))
    b = latest_bench(tmp_path)
    assert b["a_decode_b1_s64_bf16"]["fused_us"] == 40.0 and b["a_decode_b1_s64_bf16"]["best_baseline"] == "torch_graph"
    assert b["a_prefill_b1_s16_bf16"]["tflops"] == 13.9 and b["a_prefill_b1_s16_bf16"]["route"] == "fused"
    assert "a_prefill_b1_s64_bf16" not in b
    assert b["a_prefill_b1_s128_bf16"]["fused_us"] == 200.0  # the newer run failed its check: not shown


def test_report_joins_tp_rows_and_only_figures_of_the_builds_architecture(tmp_path):
    from generator.report import latest_bench
    h200 = {"gpu": "NVIDIA H200", "gpus": 2, "date": "2026-11-30", "rows": [
        {"variant": "m_decode_b1_s64_bf16_tp2", "tp": 2, "us": 237.4, "pct_bw": 92.6, "speedup": 1.17,
         "best_baseline": "flashinfer"}]}
    a100 = {"gpu": "NVIDIA A100-SXM4-80GB", "date": "2026-12-01", "rows": [
        {"variant": "m_decode_b1_s64_bf16_tp2", "tp": 2, "us": 400.0, "pct_bw": 80.0, "speedup": 1.0,
         "best_baseline": "unfused"}]}
    (tmp_path / "tp_check-h200.json").write_text(json.dumps(h200))
    (tmp_path / "tp_check-a100.json").write_text(json.dumps(a100))
    fig = latest_bench(tmp_path, "90")["m_decode_b1_s64_bf16_tp2"]
    assert (fig["fused_us"], fig["speedup_best"], fig["best_baseline"]) == (237.4, 1.17, "flashinfer")
    assert latest_bench(tmp_path, "80")["m_decode_b1_s64_bf16_tp2"]["fused_us"] == 400.0
    assert latest_bench(tmp_path)["m_decode_b1_s64_bf16_tp2"]["fused_us"] == 400.0  # no arch: the newest


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU refusal")
def test_ncu_layer_script_refuses_without_a_gpu_in_one_line():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "ncu_layer.py"), "llama3.2-1b_decode_b1_s4096_bf16"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == ("error: bench/ncu_layer.py launches a kernel: no CUDA GPU "
                                                      "visible to torch")
    h = subprocess.run([sys.executable, str(ROOT / "bench" / "ncu_layer.py"), "--help"], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert h.returncode == 0 and "--launch-skip" not in h.stdout and "--pos" in h.stdout
    # the input is checked first: a misspelt name is said as such, not as a missing GPU
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "ncu_layer.py"), "llama3.2-1b_decode_b1_s4096"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == "error: variants.yaml: no variant llama3.2-1b_decode_b1_s4096"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU refusal")
def test_barrier_and_draw_benches_refuse_without_a_gpu_in_one_line():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "barrier_bench.py")], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "error: bench/barrier_bench.py launches kernels: no CUDA GPU"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "draw_bench.py")], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == ("error: bench/draw_bench.py launches kernels: no CUDA GPU "
                                                      "visible to torch")


def test_prefill_rows_print_and_the_report_reads_them(tmp_path):
    """megakernel bench's prefill rows (bench.measure.check_prefill's, under the results file's "prefill" key): the
    table prints them, a failed one with its error, and the report takes the passing one's figures and route."""
    from rich.console import Console
    from generator.report import latest_bench
    ok = {"variant": "tiny-a_prefill_b1_s64_bf16", "mode": "prefill", "pass": True, "rel_err": 2e-3, "us": 80.0,
          "tflops": 90.0, "unfused_us": 150.0, "unfused_tflops": 48.0, "speedup": 1.88, "route": "fused"}
    bad = {"variant": "tiny-a_prefill_b4_s64_bf16", "mode": "prefill", "status": "skipped", "error": "build refused"}
    doc = {**_fake_doc(), "prefill": [ok, bad]}
    results.write_results(doc, tmp_path, "nvidia-h200-2026-01-02")
    con = Console(record=True, width=250)
    brun.print_prefill(doc["prefill"], con)
    text = con.export_text()
    assert "tiny-a_prefill_b1_s64_bf16" in text and "1.88" in text and "build refused" in text
    got = latest_bench(tmp_path)
    assert got[ok["variant"]]["fused_us"] == 80.0 and got[ok["variant"]]["route"] == "fused"
    assert bad["variant"] not in got


def test_bench_prefill_rows_routes_and_exit_rule(tmp_path, monkeypatch):
    """bench.run.bench_prefill with check_prefill stubbed: an unbuilt variant and a spent budget are "skipped" rows, a
    raising one an "error" row (none of them timed: the exit rule counts only timed rows that failed their check),
    and routes.record_checked routes a variant that failed its check unfused whatever its timing."""
    from bench import measure
    from generator import routes
    from generator.variants import parse
    vs = parse("""
matrix: {mode: [prefill], batch: [1], seq_len: [16, 32, 48, 64, 80]}
models:
  t: {hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, intermediate: 96, layers: 1, norm: rmsnorm, norm_eps: 1.0e-5,
      rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
""", "t.yaml")
    names = [v.name for v in vs]
    built = {n: {"status": "ok"} for n in names[1:]}  # names[0] not built

    def fake(v, build_dir, seed):
        if v.name == names[1]:
            raise RuntimeError("CUDA error: an illegal memory access")
        return {"variant": v.name, "mode": "prefill", "pass": v.name != names[3], "rel_err": 1e-3, "us": 10.0,
                "unfused_us": 20.0, "speedup": 2.0, "tflops": 1.0, "unfused_tflops": 0.5, "route": "fused"}
    monkeypatch.setattr(measure, "check_prefill", fake)

    class Budget:  # the last variant finds the budget spent
        seconds = 60.0
        def allows_variant(self):
            return len(doc["prefill"]) < 4
        def record(self, *a):
            pass
    doc = {**_fake_doc(), "rows": []}
    rows = brun.bench_prefill(vs, built, "build", 1, doc, tmp_path, "x", Budget(), lambda m: None)
    assert [r.get("status") for r in rows] == ["skipped", "error", None, None, "skipped"]
    assert "build missing" in rows[0]["error"] and "time budget (60 s)" in rows[4]["error"]
    assert json.loads((tmp_path / "x.json").read_text())["prefill"] == rows  # written as it goes
    failed_timed = [r for r in rows if "us" in r and not r["pass"]]
    assert [r["variant"] for r in failed_timed] == [names[3]]
    (tmp_path / "routes").mkdir()
    routes.record(NAME_GPU, {names[3]: {"fused_us": 1.0, "unfused_us": 9.0}}, tmp_path / "routes")  # an old route
    routes.record_checked(NAME_GPU, rows, tmp_path / "routes")
    got = routes.read_routes(NAME_GPU, tmp_path / "routes")
    assert set(got) == {names[2], names[3]} and got[names[2]]["path"] == "fused"
    assert got[names[3]]["path"] == "unfused" and got[names[3]]["fused_us"] is None
    monkeypatch.setenv("MEGAKERNEL_ROUTE", "")
    assert routes.route(names[3], NAME_GPU, tmp_path / "routes") == \
        ("unfused", f"measured on {NAME_GPU}: the fused kernel failed its reference check")


NAME_GPU = "NVIDIA H200"


def test_a_recorded_route_flips_only_beyond_the_margin(tmp_path):
    """routes.record: a first measurement takes the faster path; later ones keep the recorded path while the two
    are within ROUTE_MARGIN (a tie), and flip when the other is clearly faster; the timings are always the newest."""
    from generator import routes
    d, name = tmp_path / "r", "v_prefill_b4_s64_bf16"

    def rec(f, u):
        routes.record(NAME_GPU, {name: {"fused_us": f, "unfused_us": u}}, d)
        return routes.read_routes(NAME_GPU, d)[name]
    assert rec(343.8, 344.3)["path"] == "fused"
    tie = rec(347.2, 345.0)  # unfused faster by 0.6 %: the route stays
    assert tie["path"] == "fused" and tie["fused_us"] == 347.2
    assert rec(360.0, 345.0)["path"] == "unfused"  # 4 % slower fused: it flips
    assert rec(345.0, 346.0)["path"] == "unfused"  # and a tie keeps that
    assert rec(None, 346.0)["path"] == "unfused"


@pytest.mark.parametrize("extra, want", [((), "default"), (("--no-tuned",), None)])
def test_megakernel_bench_builds_the_tuned_plans(monkeypatch, tmp_path, extra, want):
    """bench builds what `megakernel build` builds: the only file in tuning/ (or --tuned-for's), none with
    --no-tuned; the build is stopped here (no GPU) once its arguments are seen."""
    from generator import compile as gcompile, tune as gtune
    monkeypatch.setattr(brun, "require_cuda", lambda: None)
    seen = {}

    def fake_build(vs, build_dir, **kw):
        seen.update(kw)
        raise SystemExit(3)
    monkeypatch.setattr(gcompile, "build", fake_build)
    r = CliRunner().invoke(brun.cli, ["--variants", str(VARIANTS), "--only", "llama3.2-1b_decode_b8_s4096_bf16",
                                      "--build-dir", str(tmp_path / "b"), *extra])
    assert r.exit_code == 3, (r.output, r.exception)
    want = gtune.default_tuning_file() if want == "default" else None
    assert seen["tuning_file"] == want and seen["variants_file"] == str(VARIANTS)


def test_record_checked_starts_from_the_committed_routes_and_rows_show_the_recorded_path(tmp_path):
    """gpu_check records into an empty $OUT seeded from routes/: a tie keeps the committed path there too, and the
    rows' route becomes the path recorded (what the tables print and the runtime takes)."""
    from generator import routes
    seed, out, name = tmp_path / "routes", tmp_path / "out", "v_prefill_b4_s64_bf16"
    routes.record(NAME_GPU, {name: {"fused_us": 343.8, "unfused_us": 344.3}, "other": {"fused_us": 1.0,
                                                                                      "unfused_us": 2.0}}, seed)
    rows = [{"variant": name, "pass": True, "us": 347.2, "unfused_us": 345.0, "route": "unfused"}]
    path = routes.record_checked(NAME_GPU, rows, out, "2026-12-01", seed_dir=seed)
    got = routes.read_routes(NAME_GPU, out)
    assert path.parent == out and got[name]["path"] == "fused" and rows[0]["route"] == "fused"
    assert set(got) == {name, "other"}  # the file to commit holds every route
    (seed / "nvidia-h200.json").write_text('{"routes": {"x": null, "y": 5}}')  # malformed entries: ignored
    assert routes.read_routes(NAME_GPU, seed) == {}


def test_report_skips_a_results_file_of_another_shape_with_one_warning(tmp_path):
    """A results file whose rows are not a list of rows, a figure that is not a number, or JSON that does not parse:
    each is skipped with one warning naming the file (they were tracebacks in `megakernel report`); a good file
    beside them is still read."""
    import warnings

    from generator import report as greport
    good = {"gpu": "NVIDIA H200", "date": "2026-12-01", "rows": [
        {"variant": "m_decode_b1_s64_bf16", "us": 10.0, "pct_bw": 50.0, "speedup": 2.0, "pass": True}]}
    (tmp_path / "gpu_check-a.json").write_text(json.dumps(good))
    (tmp_path / "gpu_check-b.json").write_text(json.dumps({"rows": "x"}))
    (tmp_path / "gpu_check-c.json").write_text(json.dumps({"gpu": "NVIDIA H200", "rows": [
        {"variant": "m_decode_b1_s64_bf16", "us": "fast", "pass": True}]}))
    (tmp_path / "gpu_check-d.json").write_text("{bad")
    (tmp_path / "gpu_check-e.json").write_text(json.dumps({"rows": [3]}))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        figs = greport.latest_bench(tmp_path, "90")
    assert figs["m_decode_b1_s64_bf16"]["fused_us"] == 10.0
    said = sorted(str(w.message) for w in rec)
    assert len(said) == 4 and all("\n" not in m and m.endswith("skipped") for m in said), said
    assert [m.split(":")[0] for m in said] == [str(tmp_path / f"gpu_check-{c}.json") for c in "bcde"]
    assert "'fast' is not a number" in said[1] and '"rows" is str' in said[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_gpu_check_refuses_on_a_cpu_before_building(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--build-dir", str(tmp_path / "b")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: bench/gpu_check.py verifies") \
        and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "b").exists() and not (tmp_path / "b-heldout").exists()


@pytest.mark.parametrize("argv", [["bench/gpu_check.py", "--bogus"], ["bench/tp_check.py", "--bogus"],
                                  ["-m", "bench.e2e", "--bogus"], ["-m", "bench.e2e", "--reps", "x"],
                                  ["-m", "bench.e2e", "stray"], ["bench/barrier_bench.py", "--bogus"],
                                  ["bench/draw_bench.py", "--bogus"], ["bench/ab.py"],
                                  ["bench/ab.py", "--case", "x", "{bad"], ["bench/ab.py", "--case", "x", "[1]"],
                                  ["bench/ab.py", "--case", "x", '{"ATT_LL": 1}', "--rows", "full,last"],
                                  ["bench/timeline.py"], ["bench/timeline.py", "--variant", "x", "--overrides", "[]"],
                                  ["bench/timeline.py", "--variant", "x", "--row", "-1"],
                                  ["bench/timeline.py", "--variant", "x", "--row", "\u00b2"],
                                  ["bench/ab.py", "--case", "x", '{"ATT_LL": 1}', "--rows", "\u00b2"],
                                  ["bench/ncu_layer.py"], ["bench/ncu_layer.py", "x", "--bogus"]])
def test_bench_scripts_usage_errors_are_one_line(argv):
    """The device scripts' usage errors are one `error:` line, exit 2, as `megakernel`'s commands give them (click's
    and argparse's own are usage blocks); -h is help, as in `megakernel`."""
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    if argv[0].endswith("gpu_check.py"):
        h = subprocess.run([sys.executable, argv[0], "-h"], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert h.returncode == 0 and "--no-tests" in h.stdout, h.stderr


def test_ab_refuses_bad_cases_in_one_line_and_compiles_on_a_cpu(tmp_path, tiny_variants_file):
    """bench/ab.py: an undeclared variant, a refused plan, a row past the cache and a case that plans its base's kernel
    (nothing to compare) are one `error:` line (exit 2, as `megakernel` and gpu_check.py) before anything is built;
    --compile-only builds the default and each override set and prints their resources."""
    from conftest import cli_env
    ab = [sys.executable, str(ROOT / "bench" / "ab.py"), "--build-dir", str(tmp_path / "b")]
    one = "llama3.2-1b_decode_b1_s4096_bf16"
    (tmp_path / "afile").write_text("")
    cases = [(["--case", "nope", '{"ATT_LL": 1}'], "error: --case nope: no variant of that name", {}),
             (["--case", "llama3.2-1b_prefill_b1_s128_bf16", '{"ATT_LL": 1}'], "a prefill variant; this script", {}),
             (["--case", one, '{"ATT_LL": 3}'], "must be 0, 1 or 2", {}),
             (["--case", one, '{"ATT_LL": 0}', "--rows", "4096"], "error: --rows 4096: past", {}),
             # (its plan has ATT_LL 1 already: the LL rule)
             (["--case", one, '{"ATT_LL": 1}'], '{"ATT_LL": 1}: plans the same kernel as its base (the ', {}),
             (["--case", one, '{"ATT_LL": 0}', "--compile-only", "--build-dir", str(tmp_path / "afile")],
              "exists and is not a directory", {}),
             (["--case", one, '{"ATT_LL": 0}', "--compile-only"], "is not an executable file",
              {"NVCC": str(tmp_path / "no-nvcc")})]
    if not torch.cuda.is_available():  # (no GPU: said before anything is compiled)
        cases.append((["--case", one, '{"ATT_LL": 0}'], "no CUDA GPU visible to torch", {}))
    for extra, want, env in cases:
        r = subprocess.run([*ab, *extra], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                           env={**cli_env(), **env})
        assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
        assert want in r.stderr, r.stderr
        assert not (tmp_path / "b").exists()
    r = subprocess.run([*ab, "--variants", str(tiny_variants_file), "--case", "tiny-a_decode_b1_s64_bf16",
                        '{"QKV_FLOW": 0}', "--rows", "full", "--compile-only"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=600, env=cli_env())
    assert r.returncode == 0, r.stderr
    first, *built = r.stdout.splitlines()
    assert first == "tiny-a_decode_b1_s64_bf16: from its default plan", r.stdout  # (tuning/ has no entry for it)
    assert len(built) == 2 and all(": ok, " in x and "spills 0 / 0 B" in x for x in built), r.stdout
    assert " {}: ok" in built[0] and " {'QKV_FLOW': 0}: ok" in built[1], r.stdout  # (each plan's overrides)
    from bench.ab import parse
    assert parse(["--case", one, '{"ATT_LL": 1}', "--rows", "full,mix,191"])[2] == ["full", "mix", 191]


def test_timeline_names_its_stamps_and_refuses_in_one_line(tmp_path):
    """bench/timeline.py: the TIMELINE slots' names follow templates/kernel.cu.j2's order (entry, after the wait,
    each step's end and barrier; a repeated step numbered), the summary is µs from the earliest entry over the blocks
    launched; an undeclared variant, a tensor-parallel one, a refused plan and a row past the cache are one `error:`
    line, and on a machine without a GPU it says so before building anything."""
    from bench.timeline import stamp_names, summarize
    from conftest import cli_env
    names = stamp_names(["norm", "qkv_proj", "attention", "o_proj", "norm", "gate_up", "down_proj"])
    assert names[:4] == ["entry", "after wait", "norm end", "norm barrier"] and len(names) == 24
    assert names[16] == "attention: task start" and names[23] == "attention: task end"  # (interface.TIMELINE_ATT)
    assert names[10:12] == ["norm (2) end", "norm (2) barrier"]
    stamps = [[1000, 1200, 3000, 0], [1500, 1600, 5000, 0], [0, 0, 0, 0]]  # (a block not launched: zeros)
    rows = summarize(stamps, ["entry", "after wait", "qkv_proj end", "qkv_proj barrier"])
    assert [r["stamp"] for r in rows] == ["entry", "after wait", "qkv_proj end"]
    assert rows[2] == {"stamp": "qkv_proj end", "min_us": 2.0, "median_us": 3.0, "max_us": 4.0, "last_block": 1,
                       "blocks": 2}
    # the launch boundary against the previous layer's stamps: from its last (and first) block's last step stamp
    # (attention's phase slots are not a block's end)
    from bench.timeline import launch_gap
    prev = [[1000, 1100] + [0] * 22, [1000, 1100, 5000] + [0] * 13 + [9000] * 8, [0] * 24]
    cur = [[6000, 6500] + [0] * 22, [6200, 6600] + [0] * 22]
    assert launch_gap(prev, cur) == {"first_entry_after_last_us": 1.0, "first_entry_after_first_us": 4.9,
                                     "first_wait_after_last_us": 1.5}
    tl = [sys.executable, str(ROOT / "bench" / "timeline.py"), "--build-dir", str(tmp_path / "b")]
    cases = [(["--variant", "nope"], "error: --variant nope: no variant of that name"),
             (["--variant", "llama3-70b_decode_b8_s4096_bf16_tp2"], "of one GPU"),
             (["--variant", "llama3.2-1b_decode_b1_s4096_bf16", "--overrides", '{"ATT_LL": 3}'], "must be 0, 1 or 2"),
             (["--variant", "llama3.2-1b_decode_b1_s4096_bf16", "--row", "4096"], "error: --row 4096: past")]
    cases += ([] if torch.cuda.is_available() else
              [(["--variant", "llama3.2-1b_decode_b1_s4096_bf16"], "no CUDA GPU visible to torch")])
    for extra, want in cases:
        r = subprocess.run([*tl, *extra], capture_output=True, text=True, cwd=tmp_path, timeout=120, env=cli_env())
        assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
        assert want in r.stderr, r.stderr
        assert not (tmp_path / "b").exists()
    # --compile-only: the stamped plan built (no GPU needed), so a device call reuses it from the build directory
    r = subprocess.run([*tl, "--variant", "qwen2.5-0.5b_decode_b1_s1024_bf16", "--overrides", '{"COOP": 0}',
                        "--compile-only"], capture_output=True, text=True, cwd=tmp_path, timeout=600, env=cli_env())
    assert r.returncode == 0, r.stderr
    assert "'COOP': 0" in r.stdout and "'TIMELINE': 1" in r.stdout and "spills 0 / 0 B" in r.stdout, r.stdout
    assert (tmp_path / "b" / "qwen2.5-0.5b.tl_decode_b1_s1024_bf16" / "kernel.cu").is_file()


def test_timeline_knob_stamps_only_where_asked(tmp_path):
    """TIMELINE (decode, one GPU): its build stamps every step's end and each grid barrier that remains (none after
    a step whose flow constant drops it), compiles without spills; the default plan's source has no stamps and no
    buffer; tensor parallel is refused."""
    from bench.tune import renamed
    from generator import compile as gcompile, interface, render
    from generator.plan import PlanError
    from generator import variants as gvariants
    v = next(x for x in gvariants.load(ROOT / "variants.yaml") if x.name == "llama3.2-1b_decode_b1_s4096_bf16")
    on = render.plan(v, overrides={"TIMELINE": 1, "ATT_LL": 1, "QKV_FLOW": 1, "H_LL": 0})
    src = render.render(v, on)
    # entry, wait; 7 step ends; one barrier (o_proj's: NORM_LOCAL, QKV_FLOW, ATT_LL, NORM2_LOCAL, DOWN_FLOW drop
    # the others)
    assert src.count("tl_row[") == 2 + 7 + 1 and "tl_row[9] = " in src and "tl_row[7] = " not in src
    assert on["workspace"]["buffers"]["timeline"]["bytes"] == 132 * interface.TIMELINE_SLOTS * 8
    assert src.count("tl(") >= 9  # attention's phases (interface.TIMELINE_ATT_PHASES)
    off = render.plan(v)
    assert "tl_row" not in render.render(v, off) and off["workspace"]["buffers"]["timeline"]["bytes"] == 0
    with pytest.raises(PlanError, match="TIMELINE=1: one GPU only"):
        render.plan(next(x for x in gvariants.load(ROOT / "variants.yaml") if x.tp > 1), overrides={"TIMELINE": 1})
    c = renamed(v, "tl")
    e, = gcompile.build([c], tmp_path, overrides={c.name: {"TIMELINE": 1}}, replan_spills=False)["entries"]
    assert e["status"] == "ok" and e["resources"]["spill_stores"] == e["resources"]["spill_loads"] == 0, e


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_timeline_reads_a_launch(tmp_path):
    """bench/timeline.py on Llama-3.2-1B b1 at row 191: every launched block stamps its entry, the wait and each step's
    end; per block the stamps run forward; the 8 blocks that walk rows (one task a KV head at ATT_C 256) stamp
    attention's phases in order, between qkv's end and attention's; the launch lasts between 10 and 1000 µs."""
    from generator.interface import TIMELINE_ATT, TIMELINE_ATT_PHASES
    from bench import timeline
    out = tmp_path / "t.json"
    timeline.main(["--variant", "llama3.2-1b_decode_b1_s4096_bf16", "--build-dir", str(tmp_path / "b"),
                   "--out", str(out)])
    d = json.loads(out.read_text())
    per = [r for r in d["per_block_ns"] if r[0] > 0]
    assert len(per) >= 100
    walked = 0
    for r in per:
        got = [t for t in r[:TIMELINE_ATT] if t > 0]
        assert got == sorted(got) and len(got) >= 2 + 7, r
        att = r[TIMELINE_ATT:TIMELINE_ATT + len(TIMELINE_ATT_PHASES)]
        if any(att):
            walked += 1
            assert all(att) and att == sorted(att) and r[4] <= att[0] and att[-1] <= r[6], r  # (qkv end, attn end)
    assert walked == 8, walked
    # PDL: this launch's blocks pass their wait only once the previous layer's launch is done
    assert d["launch_gap"]["first_wait_after_last_us"] >= 0, d["launch_gap"]
    last = max(x["max_us"] for x in d["stamps"])
    assert 10 < last < 1000, d["stamps"]


def test_gpu_check_table_has_the_serving_baseline_and_says_why_a_row_lacks_one(capsys):
    """bench/gpu_check.py's decode table: the serving-style compiled layer's µs in its own column where it was timed,
    "-" elsewhere, and one line a reason under the table (a row of an older run without the field: no line)."""
    from bench.gpu_check import SERVING_ROWS, print_tables
    common = {"pass": True, "rel_err": 3e-3, "pct_bw": 70.0, "torch_graph_us": 150.0, "flashinfer": "ok",
              "stage_us": {"qkv": 5.0}}
    rows = [{**common, "variant": "m_decode_b1_s4096_bf16", "us": 44.5, "serving": "ok", "serving_us": 58.2,
             "flashinfer_us": 74.1, "speedup_vs_best": 1.31},
            {**common, "variant": "m_decode_b4_s4096_bf16", "us": 52.0, "serving": "not timed (--serving, "
             "--serving-budget)", "serving_us": None, "flashinfer_us": 80.0, "speedup_vs_best": 1.54},
            {**common, "variant": "old_decode_b1_s4096_bf16", "us": 40.0, "flashinfer_us": None,
             "speedup_vs_best": 3.75}]
    print_tables({"gpu": "NVIDIA H200", "date": "2026-12-05", "seed": 1, "copy_gbps": 4200.0, "tests": "skipped",
                  "rows": rows})
    out = capsys.readouterr().out.splitlines()
    head = next(ln for ln in out if ln.startswith("variant"))
    assert head.split()[8:11] == ["torch_g", "serving", "flashinf"]
    cells = {ln.split()[0]: ln.split() for ln in out if "_decode_" in ln}
    assert cells["m_decode_b1_s4096_bf16"][6:9] == ["58.2", "74.1", "1.31"]
    assert cells["m_decode_b4_s4096_bf16"][6] == "-" and cells["old_decode_b1_s4096_bf16"][6:8] == ["-", "-"]
    assert "serving: not timed (--serving, --serving-budget) (1 rows)" in out
    assert not any(ln.startswith("flashinfer:") for ln in out)
    assert any(fnmatch.fnmatchcase("m_decode_b1_s4096_bf16", g) for g in SERVING_ROWS)
    assert not any(ln.startswith("timing: queued") for ln in out)


def test_gpu_check_table_names_a_queued_time_over_the_unqueued(capsys):
    """A row whose queued (GPU-only) time exceeds its host-launched one by more than QUEUED_OVER_UNQUEUED is named
    under the table (session 60: 54.6 against 49.7 µs on one H100 row); within it, nothing is said."""
    from bench.gpu_check import print_tables
    common = {"pass": True, "rel_err": 3e-3, "pct_bw": 70.0, "torch_graph_us": 150.0, "flashinfer": "ok",
              "flashinfer_us": 80.0, "speedup_vs_best": 1.5, "stage_us": {"qkv": 5.0}}
    rows = [{**common, "variant": "a_decode_b2_s4096_bf16", "us": 54.6, "us_unqueued": 49.7},
            {**common, "variant": "b_decode_b2_s4096_bf16", "us": 50.5, "us_unqueued": 49.7}]
    print_tables({"gpu": "NVIDIA H100", "date": "2026-12-06", "seed": 1, "copy_gbps": 3000.0, "tests": "skipped",
                  "rows": rows})
    out = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("timing: queued")]
    assert len(out) == 1 and "on 1 rows" in out[0] and "a_decode_b2_s4096_bf16 54.6 / 49.7" in out[0], out
    assert "b_decode" not in out[0]


def test_gpu_check_markdown_renders_the_readme_tables(tmp_path):
    """`bench/gpu_check.py --markdown FILE` (no GPU): the decode rows as the README's table, a baseline not timed as
    "–", the best baseline named, held-out rows marked, a failed row with its error; the prefill table after; a file
    that is not a gpu_check result is one `error:` line, exit 2."""
    from bench.gpu_check import markdown_tables
    ok = {"pass": True, "rel_err": 3.3e-3, "us": 44.5, "pct_bw": 69.9, "torch_graph_us": 155.4, "serving_us": 58.2,
          "flashinfer_us": 74.1, "speedup_vs_best": 1.31, "best_baseline": "serving"}
    doc = {"rows": [{**ok, "variant": "a_decode_b1_s4096_bf16"},
                    {**ok, "variant": "h_decode_b4_s4096_bf16", "heldout": True, "serving_us": None,
                     "us_mixed": 40.0, "flashinfer_us_mixed": 60.0, "best_baseline": "flashinfer",
                     "knobs": {"NORM_GLOBAL": 1, "QKV_TM": 2, "ATT_LL": 1, "QKV_FLOW": 2, "H_LL": 1},
                     "plan_source": "tuned (nvidia-h200)"},
                    {**ok, "variant": "w_decode_b2_s8192_bf16", "knobs": {"ATT_LL": 1}, "path": "LL WINDOW=4096",
                     "plan_source": "default"},
                    {**ok, "variant": "n_decode_b2_s8192_bf16", "knobs": {"ATT_LL": 0}, "path": "",
                     "plan_source": "default"},
                    {"variant": "x_decode_b1_s64_bf16", "pass": False, "error": "not built"},
                    {"variant": "p_prefill_b1_s64_bf16", "mode": "prefill", "pass": True, "rel_err": 1.9e-3,
                     "us": 79.6, "tflops": 98.0, "unfused_us": 159.1, "unfused_tflops": 49.0, "speedup": 2.0,
                     "route": "fused"}]}
    md = markdown_tables(doc).splitlines()
    assert md[2] == ("| a_decode_b1_s4096_bf16 | 3.3e-03 | 44.5 | 69.9 | 155.4 | 58.2 | 74.1 | 1.31 | serving | – | "
                     "– | ? |")  # (a row that recorded no plan)
    assert md[3] == ("| h_decode_b4_s4096_bf16 (held out) | 3.3e-03 | 44.5 | 69.9 | 155.4 | – | 74.1 | 1.31 | "
                     "flashinfer | 40.0 | 1.50 | NORM_GLOBAL TM=2 LL tuned |")  # (from its knobs: before session 66)
    assert md[4].endswith("| LL WINDOW=4096 |") and md[5].endswith("| – |")  # (its recorded path; none)
    whole, md = md, md[:4] + md[6:]
    assert md[4].startswith("| x_decode_b1_s64_bf16 | not built |") and md[4].count("|") == md[0].count("|")
    assert md[-1] == "| p_prefill_b1_s64_bf16 | 1.9e-03 | 79.6 | 98.0 | 159.1 | 49.0 | 2.00 | fused |"
    f = tmp_path / "g.json"
    f.write_text(json.dumps(doc))
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--markdown", str(f)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.splitlines() == whole
    for bad, says in (('{"rows": 3}', "not a gpu_check result"), ("[1]", "not a gpu_check result"),
                      ("{", "not JSON"), ('{"rows": [{"variant": "x", "pass": true}]}', "lacks 'rel_err'")):
        f.write_text(bad)
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--markdown", str(f)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
        assert says in r.stderr and "Error:" not in r.stderr, r.stderr  # no raw exception class name


def test_gpu_check_serving_rows_largest_batch_1_first_declared_before_held_out():
    """The rows that get the serving-style layer's compile while --serving-budget lasts: batch 1 before batch 8, the
    largest weights first, declared before held out (so a short budget still covers the 8B-class batch-1 rows)."""
    import fnmatch as fm

    from bench.gpu_check import SERVING_ROWS, serving_order
    vs = [v for v in gvariants.load(VARIANTS) if v.mode == "decode" and v.tp == 1
          and any(fm.fnmatchcase(v.name, g) for g in SERVING_ROWS)]
    held = [v for v in gvariants.load(ROOT / "bench" / "heldout.yaml") if v.mode == "decode" and v.tp == 1
            and any(fm.fnmatchcase(v.name, g) for g in SERVING_ROWS)]
    got = [v.name for v in serving_order(vs + held, held)]
    assert got[:2] == ["qwen2.5-7b_decode_b1_s4096_bf16", "llama3-8b_decode_b1_s4096_bf16"], got
    assert got.index("qwen2.5-0.5b_decode_b1_s4096_bf16") < got.index("ho-hd80-mha_decode_b1_s4096_bf16")
    assert all(v.batch == 1 for v in serving_order(vs + held, held)[:len(got) // 2]) and "b8" in got[-1]
    assert sorted(got) == sorted(v.name for v in vs + held)


def test_report_says_above_and_below_its_table_that_timings_are_a_device_runs(copy_build, tmp_path):
    """On a machine without a GPU the timing columns are a device run's: said above the table (a quick reader) and
    named below it."""
    from rich.console import Console
    from generator import report as greport
    d = copy_build(tmp_path / "build")
    bench_dir = tmp_path / "results"
    bench_dir.mkdir()
    rep = greport.build_report(d, bench_dir=bench_dir, gpu=False)
    name = rep["rows"][0]["name"]
    run = {"date": "2026-11-30", "rows": [{"variant": name, "us": 40.0, "pct_bw": 70.0, "speedup": 3.5,
                                           "speedup_vs_best": 1.6, "best_baseline": "flashinfer"}]}
    (bench_dir / "gpu_check-h200-2026-11-30.json").write_text(json.dumps(run))
    rep = greport.build_report(d, bench_dir=bench_dir, gpu=False)
    con = Console(width=200, record=True, color_system=None)
    greport.print_report(rep, con)
    lines = con.export_text().splitlines()
    above = next(i for i, line in enumerate(lines) if "from a device run" in line)
    below = next(i for i, line in enumerate(lines) if "measured in gpu_check-h200-2026-11-30.json" in line)
    table = next(i for i, line in enumerate(lines) if name in line)
    assert above < table < below and len(lines[above]) <= 80
