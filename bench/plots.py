"""PNG plots of a `megakernel bench` or `bench/e2e.py` results file (matplotlib, Agg: no display needed).

    python -m bench.plots bench/results/<gpu>-<date>.json [e2e-<gpu>-<date>.json ...] [--out-dir DIR]

Per model of a `megakernel bench` file, two figures, each with µs per layer (p10-p90 bars, the copy-bandwidth floor
dashed) and % of the copy bandwidth, one line per provider:
  <stem>-<model>-batch.png   vs batch, at a fixed seq_len (4096 where measured)
  <stem>-<model>-kvlen.png   vs KV length (= seq_len: every sequence at pos = seq_len-1), at a fixed batch (1)
An end-to-end file (bench/e2e.py's, told by its "providers" key) gives one figure, <stem>.png: time to first token
and ms per output token, grouped bars per provider.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

PROVIDERS = ("fused", "eager", "torch_graph", "compile")
STYLE = {"fused": ("tab:red", "o", "fused (this kernel)"), "eager": ("tab:gray", "s", "eager PyTorch"),
         "torch_graph": ("tab:blue", "^", "PyTorch in a CUDA graph"),
         "compile": ("tab:green", "D", "torch.compile + CUDA graph")}
PREFERRED_SEQ_LEN = 4096
PREFERRED_BATCH = 1
_NAME_RE = re.compile(r"^(?P<model>.+)_[a-z]+_b\d+_s\d+_[a-z0-9]+$")


def model_of(row: dict) -> str:
    if row.get("model"):
        return row["model"]
    m = _NAME_RE.match(row["variant"])
    return m.group("model") if m else row["variant"]


def _pick(values, preferred):
    """The preferred value where it was measured, else the most common one (ties: the smallest)."""
    values = list(values)
    if preferred in values:
        return preferred
    counts = Counter(values)
    return min(counts, key=lambda v: (-counts[v], v))


def _load(source) -> tuple[dict, str | None]:
    if isinstance(source, dict):
        return source, None
    path = Path(source)
    return json.loads(path.read_text()), path.stem


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", str(text).lower()).strip("-")


def _figure(rows: list[dict], xkey: str, title: str, xlabel: str, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_us, ax_bw) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs_all = sorted({r[xkey] for r in rows})
    providers = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    providers += sorted({r["provider"] for r in rows} - set(providers))
    for p in providers:
        pts = sorted((r for r in rows if r["provider"] == p), key=lambda r: r[xkey])
        if not pts:
            continue
        color, marker, label = STYLE.get(p, (None, "x", p))
        xs = [r[xkey] for r in pts]
        med = [r["us_median"] for r in pts]
        lo = [max(0.0, r["us_median"] - (r.get("us_p10") if r.get("us_p10") is not None else r["us_median"]))
              for r in pts]
        hi = [max(0.0, (r.get("us_p90") if r.get("us_p90") is not None else r["us_median"]) - r["us_median"])
              for r in pts]
        ax_us.errorbar(xs, med, yerr=[lo, hi], color=color, marker=marker, label=label, capsize=3)
        if any(r.get("pct_bw") is not None for r in pts):
            ax_bw.plot([r[xkey] for r in pts if r.get("pct_bw") is not None],
                       [r["pct_bw"] for r in pts if r.get("pct_bw") is not None],
                       color=color, marker=marker, label=label)
    floor = {}
    for r in rows:
        if r.get("floor_us") is not None:
            floor.setdefault(r[xkey], r["floor_us"])
    if floor:
        fx = sorted(floor)
        ax_us.plot(fx, [floor[x] for x in fx], "k--", marker="_", markersize=14, linewidth=1,
                   label="floor: bytes / copy bandwidth")
    ax_bw.axhline(100, color="k", linestyle=":", linewidth=1)
    for ax in (ax_us, ax_bw):
        if len(xs_all) > 1 and min(xs_all) > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs_all)
        ax.set_xticklabels([str(x) for x in xs_all])
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
    ax_us.set_ylabel("µs per layer (median, p10-p90)")
    ax_us.set_ylim(bottom=0)
    ax_bw.set_ylabel("% of copy bandwidth")
    pcts = [r["pct_bw"] for r in rows if r.get("pct_bw") is not None]
    ax_bw.set_ylim(0, max([110.0] + [1.1 * p for p in pcts]))
    ax_us.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_results(source, out_dir=None, stem: str | None = None) -> list[Path]:
    """source: a results JSON path (or its loaded dict). Writes the PNGs next to it (or into out_dir) and returns
    their paths. Only rows with status ok and a median are drawn; a model without any gives no figure."""
    doc, file_stem = _load(source)
    stem = stem or file_stem or f"{_slug(doc.get('gpu', 'gpu'))}-{doc.get('date', 'results')}"
    if out_dir is None:
        out_dir = Path(source).parent if file_stem is not None else Path(".")
    out_dir = Path(out_dir)
    rows = [r for r in doc.get("rows", []) if r.get("status") == "ok" and r.get("us_median") is not None]
    gpu = doc.get("gpu", "")
    written = []
    for model in sorted({model_of(r) for r in rows}):
        mrows = [r for r in rows if model_of(r) == model]
        seq = _pick((r["seq_len"] for r in mrows), PREFERRED_SEQ_LEN)
        sel = [r for r in mrows if r["seq_len"] == seq]
        written.append(_figure(
            sel, "batch", f"{model} decode: per layer vs batch, KV length {seq} (pos = seq_len-1) — {gpu}",
            "batch", out_dir / f"{stem}-{_slug(model)}-batch.png"))
        batch = _pick((r["batch"] for r in mrows), PREFERRED_BATCH)
        sel = [r for r in mrows if r["batch"] == batch]
        written.append(_figure(
            sel, "seq_len", f"{model} decode: per layer vs KV length, batch {batch} — {gpu}",
            "KV length (tokens; every sequence at pos = seq_len-1)", out_dir / f"{stem}-{_slug(model)}-kvlen.png"))
    return written


# bench/e2e.py's figures per provider (ms) and their bar labels; a figure a provider lacks is left out
E2E_TTFT = (("ttft_ms_128", "128-token prompt"), ("ttft_ms_2048", "2,048-token prompt"))
E2E_DECODE = (("ms_per_token_b1", "batch 1"), ("ms_per_token_b8", "batch 8"),
              ("ms_per_token_b1_long", "batch 1, near the end of the cache"))
_DATE_RE = re.compile(r"\d{4}-\d{2}-\d{2}")


def plot_e2e(source, out_dir=None) -> list[Path]:
    """source: a bench/e2e.py results JSON path (or its loaded dict). Writes one PNG, <stem>.png next to it (or
    into out_dir), and returns [its path]: time to first token (ms, 128- and 2,048-token prompts) and ms per output
    token (batch 1, batch 8, batch 1 near the end of the cache where measured), bars per provider, values labelled.
    Providers that recorded an error are left out; none left: nothing written, []."""
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc, file_stem = _load(source)
    gpu = doc.get("gpu", "")
    date = doc.get("date") or (_DATE_RE.search(file_stem or "") or [None])[0]
    stem = file_stem or f"e2e-{_slug(gpu or 'gpu')}" + (f"-{date}" if date else "")
    if out_dir is None:
        out_dir = Path(source).parent if file_stem is not None else Path(".")
    provs = {n: r for n, r in (doc.get("providers") or {}).items() if isinstance(r, dict) and "error" not in r}
    if not provs:
        return []
    names = list(provs)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    panels = ((axes[0], E2E_TTFT, "time to first token, ms (batch 1)"),
              (axes[1], E2E_DECODE, "ms per output token (greedy decode)"))
    for ax, metrics, ylabel in panels:
        metrics = [(k, label) for k, label in metrics if any(provs[n].get(k) is not None for n in names)]
        width = 0.8 / max(1, len(metrics))
        for i, (k, label) in enumerate(metrics):
            xs = [j + (i - (len(metrics) - 1) / 2) * width for j, n in enumerate(names) if provs[n].get(k) is not None]
            ys = [provs[n][k] for n in names if provs[n].get(k) is not None]
            bars = ax.bar(xs, ys, width, label=label)
            ax.bar_label(bars, labels=[f"{y:.{2 if y < 10 else 1 if y < 100 else 0}f}" for y in ys], fontsize=7,
                         padding=2)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([textwrap.fill(n, 16) for n in names], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, 1.15 * max([provs[n][k] for k, _ in metrics for n in names
                                   if provs[n].get(k) is not None] or [1.0]))
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    ckpt = Path(str(doc.get("checkpoint", ""))).name
    failed = [n for n, r in (doc.get("providers") or {}).items() if n not in provs]
    fig.suptitle(f"end to end{f' ({ckpt})' if ckpt else ''}: time to first token and per output token"
                 f" — {gpu}{f', {date}' if date else ''}"
                 + (f"\nnot shown (error): {', '.join(failed)}" if failed else ""), fontsize=11)
    fig.tight_layout()
    path = Path(out_dir) / f"{stem}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="results JSON written by `megakernel bench` or bench/e2e.py")
    ap.add_argument("--out-dir", default=None, help="where the PNGs go [next to each JSON]")
    args = ap.parse_args(argv)
    for src in args.results:
        try:
            doc = json.loads(Path(src).read_text())
            plot = plot_e2e if isinstance(doc, dict) and "providers" in doc else plot_results
            paths = plot(src, args.out_dir)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"error: {src}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        for p in paths:
            print(p)
        if not paths:
            print(f"{src}: no timed rows, nothing to plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
