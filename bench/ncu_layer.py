"""One built decode or prefill variant's launches, for Nsight Compute (where the stage clocks are not enough).

    ncu --clock-control none --kernel-name regex:decoder_layer --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python3 bench/ncu_layer.py llama3.2-1b_decode_b1_s4096_bf16 --build-dir build

(`--clock-control none`: the device notes say to leave the clocks alone; ncu reads counters on the Firecracker
machines, e.g. nvidia-h200-x2, not on gVisor.) Launches the variant `--launches` times on random weights and a
random cache, every sequence at `--pos` (full: the last cache row, the benchmark's decode case; mixed: spread over
the cache; zero: a prompt's first chunk, the benchmark's prefill case), and prints its stage clocks of the last
launch. Builds nothing: `megakernel build --only NAME` first.

`--unfused` launches the same shape's unfused layer instead (generator.unfused: cuBLAS GEMMs, SDPA), the
benchmark's baseline, to profile its kernels beside ours (a prefill chunk's gate_up GEMM, e.g.):

    ncu --clock-control none --kernel-name regex:"gemm|sm90" --launch-skip 4 --launch-count 4 --set full \\
        python3 bench/ncu_layer.py llama3-8b_prefill_b1_s512_bf16 --pos zero --unfused
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: bench/ and generator/ from this tree
    sys.path.insert(0, str(ROOT))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("variant")
@click.option("--build-dir", default="build", show_default=True)
@click.option("--variants", "variants_file", default="variants.yaml", show_default=True,
              help="the file that declares VARIANT (bench/heldout.yaml for a held-out shape)")
@click.option("--launches", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--pos", type=click.Choice(["full", "mixed", "zero"]), default="full", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--cache-len", type=click.IntRange(min=1), default=None,
              help="KV rows per sequence of a prefill variant [max(4096, chunk), as gpu_check; a decode variant's is "
                   "its own]")
@click.option("--unfused", is_flag=True, help="launch the shape's unfused layer (cuBLAS + SDPA) instead")
def main(variant, build_dir, variants_file, launches, pos, seed, cache_len, unfused):
    """Launch built VARIANT --launches times (random weights and cache) for Nsight Compute to profile."""
    import torch

    from bench import fail
    from bench.measure import PREFILL_CACHE
    from generator import reference, variants as gvariants
    from generator.loader import LoadError, load
    try:  # (the input first: a misspelt name is said on a machine without a GPU too)
        v = next((v for v in gvariants.load(variants_file) if v.name == variant), None)
    except gvariants.VariantError as exc:
        fail(str(exc))
    if v is None:
        fail(f"{variants_file}: no variant {variant}")
    if not torch.cuda.is_available():
        fail("bench/ncu_layer.py launches a kernel: no CUDA GPU visible to torch")
    try:
        layer = load(variant, reference.random_weights(v.model, seed=seed, device="cuda"), build_dir=build_dir,
                     cache_len=(cache_len or max(PREFILL_CACHE, v.seq_len)) if v.mode == "prefill" else None)
    except LoadError as exc:
        fail(str(exc))
    for c in (layer.k_cache, layer.v_cache):
        c.normal_()
    B, m = v.batch, v.model
    last = layer.cache_len - (v.seq_len if v.mode == "prefill" else 1)
    p = {"full": [last] * B, "mixed": [(b + 1) * last // B for b in range(B)], "zero": [0] * B}[pos]
    p = torch.tensor(p, dtype=torch.int32, device="cuda")
    shape = (B, m.hidden) if v.mode == "decode" else (B, v.seq_len, m.hidden)
    x = torch.randn(shape, device="cuda").to(reference.TORCH_DTYPES[m.dtype])
    if unfused:  # the benchmark's baseline on the same weights and cache shape (gpu_check: check_prefill)
        from generator.unfused import UnfusedLayer
        base = UnfusedLayer(reference.random_weights(m, seed=seed, device="cuda"), m, layer.k_cache, layer.v_cache)
        if v.mode == "decode":  # the rows serve's step reads (generator.serve.kv_bucket)
            from generator.serve import kv_bucket
            kv_len = kv_bucket(int(p.max()) + 1, layer.cache_len)
        else:  # a first chunk reads only its own rows, as gpu_check times it
            kv_len = v.seq_len if pos == "zero" else None
        for _ in range(launches):
            (base.decode(x, p, kv_len) if v.mode == "decode" else base.prefill(x, p, kv_len=kv_len))
        torch.cuda.synchronize()
        print(variant, f"unfused layer launched {launches} times")
        return
    for _ in range(launches):
        (layer(x, p, validate=False) if v.mode == "decode" else layer.prefill(x, p, validate=False))
    torch.cuda.synchronize()
    print(variant, "stage clocks of the last launch (µs):", layer.stage_us())


if __name__ == "__main__":
    from bench import run_click
    run_click(main)  # (a usage error: one `error:` line, exit 2)
