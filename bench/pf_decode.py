"""Experiment (session 61): a decode step at large batch run by a prefill variant of chunk 1 (the GEMM engine, X tiled
in shared memory) against the decode variant (the GEMVs), same shape, same positions, both verified, a stack of
distinct layers in a CUDA graph. Usage: python -m bench.pf_decode BUILD_DIR VARIANTS_YAML DECODE_NAME PREFILL_NAME..."""
import sys

import torch

from bench.measure import mixed_positions, n_layers_for
from bench.timing import graph_of, time_replays
from generator import reference, verify
from generator.loader import load
from generator.variants import load as load_variants


def main():
    build, yaml, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    vs = {v.name: v for v in load_variants(yaml)}
    dec = vs[names[0]]
    S = dec.seq_len
    m = dec.model
    B = dec.batch
    wb = sum(t.numel() for t in reference.random_weights(m, seed=0, device="cpu").values()) * 2
    n = n_layers_for(wb)
    for name in names:
        v = vs[name]
        W = reference.random_weights(m, seed=1, device="cuda")
        L = load(name, W, build_dir=build, cache_len=S)
        x, pos = verify.random_inputs(L, 1)
        if v.mode == "prefill":
            x = x.view(B, 1, -1) if x.dim() == 2 else x
        res = verify.check_step(L, x, pos, weights=W)
        print(name, "rel_err", res["rel_err"], "unwritten", res["unwritten"], "k_err", res["k_err"],
              "first_bad", res["first_bad_stage"], flush=True)
        del L
        layers = [load(name, reference.random_weights(m, seed=2 + i, device="cuda"), build_dir=build, cache_len=S)
                  for i in range(n)]
        for L in layers:
            L.k_cache.normal_(); L.v_cache.normal_()
        for label, p in (("full", [S - 1] * B), ("mix", mixed_positions(B, S))):
            pt = torch.tensor(p, dtype=torch.int32, device="cuda")
            xs = torch.randn(B, m.hidden, device="cuda").to(torch.bfloat16)
            if v.mode == "prefill":
                xs = xs.view(B, 1, -1)
                call = lambda L, y: L.prefill(y, pt, validate=False)  # noqa: E731
            else:
                call = lambda L, y: L(y, pt, validate=False)  # noqa: E731

            def step(layers=layers, call=call, xs=xs):
                y = xs
                for L in layers:
                    y = call(L, y)
                return y
            t = time_replays(graph_of(step).replay, n)
            print(f"{name} @ {label}: {t['median']:.1f} us/layer (p10 {t['p10']:.1f}, p90 {t['p90']:.1f})", flush=True)
        layers[0](xs, pt, validate=False) if v.mode == "decode" else layers[0].prefill(xs, pt, validate=False)
        print(name, "stages", {k: round(s, 1) for k, s in layers[0].stage_us().items()}, flush=True)
        del layers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
