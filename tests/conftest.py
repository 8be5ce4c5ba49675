"""Shared fixtures of the CPU suite (no GPU needed: nvcc compiles for an explicit arch without a device).

Nothing here is autouse and nothing changes global state, so the GPU tests (tests/test_gpu.py, marked `gpu` and
skipped by their own module where CUDA is absent) see none of it.

The one session-wide compile: `tiny_build`, three tiny variants built once by the real CLI into a temporary build
directory. Two of them have the same shape under different names (one shared object), so the session pays for two
compiles. Tests that change a build work on a copy (`copy_build`).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# tiny-a and tiny-b: the same shape (only `layers`, which the kernel does not see, differs) -> identical source.
# tiny-c: every option the other templates' branches take: layernorm, gelu, qkv bias, qk norm, fp16, llama3 RoPE.
TINY_YAML = """\
matrix:
  mode: [decode]
  batch: [1]
  seq_len: [64]
models:
  tiny-a:
    {hidden: 64, heads: 2, kv_heads: 1, head_dim: 32, intermediate: 128, layers: 1, norm: rmsnorm,
     norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
  tiny-b:
    {hidden: 64, heads: 2, kv_heads: 1, head_dim: 32, intermediate: 128, layers: 7, norm: rmsnorm,
     norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
  tiny-c:
    {hidden: 128, heads: 4, kv_heads: 2, head_dim: 32, intermediate: 256, layers: 2, norm: layernorm,
     norm_eps: 1.0e-6, rope_theta: 500000.0, activation: gelu, qkv_bias: true, qk_norm: true, dtype: fp16,
     rope_scaling: {rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0,
                    original_max_position_embeddings: 64},
     matrix: {mode: [decode], batch: [2], seq_len: [128]}}
"""
TINY_NAMES = ("tiny-a_decode_b1_s64_bf16", "tiny-b_decode_b1_s64_bf16", "tiny-c_decode_b2_s128_fp16")

# sliding-window shapes (Mistral's): static splits with the LL hand-offs (b1), fp16 head_dim 96 (b3), ATT_TMA (b16), the
# run-time split (b4 at KV 32768), prefill chunks shorter and longer than the window
WINDOW_YAML = """
models:
  user-window:
    {hidden: 1024, heads: 16, kv_heads: 4, head_dim: 64, intermediate: 2816, layers: 4, norm: rmsnorm,
     norm_eps: 1.0e-5, rope_theta: 1000000.0, sliding_window: 1000, activation: silu, qkv_bias: false,
     qk_norm: false, dtype: bf16,
     matrix: [{mode: [decode], batch: [1, 16], seq_len: [4096]}, {mode: [decode], batch: [4], seq_len: [32768]},
              {mode: [prefill], batch: [2], seq_len: [64, 1200]}]}
  user-window-fp16:
    {hidden: 512, heads: 8, kv_heads: 2, head_dim: 96, intermediate: 1376, layers: 4, norm: layernorm,
     norm_eps: 1.0e-5, rope_theta: 10000.0, sliding_window: 100, activation: gelu, qkv_bias: true, qk_norm: false,
     dtype: fp16, matrix: {mode: [decode], batch: [3], seq_len: [300]}}
"""


def cli_env() -> dict:
    """Environment for CLI subprocesses: the repository importable even without `pip install -e .`, no colour."""
    env = {k: v for k, v in os.environ.items()  # (COLUMNS: the tables' width is each test's own choice)
           if k not in ("FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE", "COLUMNS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["NO_COLOR"] = "1"
    return env


def run_cli(args, cwd, timeout=300, **kw) -> subprocess.CompletedProcess:
    """`megakernel ARGS` as a user runs it (python -m generator.cli: the interpreter running the tests)."""
    env = {**cli_env(), **kw.pop("env", {})}  # (env: variables set on top, e.g. COLUMNS)
    return subprocess.run([sys.executable, "-m", "generator.cli", *map(str, args)], cwd=str(cwd), env=env,
                          capture_output=True, text=True, timeout=timeout, **kw)


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def snapshot(root: Path) -> dict | None:
    """Every entry under root: type, and for files size, sha256, mode and mtime (so a rewrite with equal bytes shows
    too). None when root does not exist."""
    root = Path(root)
    if not root.exists():
        return None
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", st.st_mode)
            else:
                out[rel] = ("file", st.st_size, sha256(p), st.st_mode, st.st_mtime_ns)
    return out


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def tiny_variants_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("variants") / "tiny.yaml"
    p.write_text(TINY_YAML)
    return p


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory, tiny_variants_file):
    """`megakernel build` of the tiny variants into a fresh build dir, once per session. Read-only for tests."""
    work = tmp_path_factory.mktemp("tiny_build")
    build_dir = work / "build"
    r = run_cli(["build", "--variants", tiny_variants_file, "--build-dir", build_dir, "-j", "2"], cwd=work)
    assert r.returncode == 0, f"tiny build failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}"
    return {"dir": build_dir, "variants": tiny_variants_file, "stdout": r.stdout, "stderr": r.stderr}


@pytest.fixture
def copy_build(tiny_build, tmp_path):
    """copy_build(dst=None) -> a private copy of the tiny build that a test may change (hard links become copies)."""
    def make(dst: Path | None = None) -> Path:
        dst = Path(dst) if dst is not None else tmp_path / "build"
        shutil.copytree(tiny_build["dir"], dst, symlinks=True)
        return dst
    return make


def steps_track_the_reference(layer, weights, v, seed: int, steps: int = 3) -> None:
    """`steps` decode steps of `layer` (variant `v`, HF-named `weights` on the GPU) launched back to back, no host work
    between (each launch may overlap the previous one's tail), from random positions (`seed`); then each step's output
    against the fp32 reference from the previous step's output and the caches as they were."""
    import torch

    from generator import reference, verify
    x, _ = verify.random_inputs(layer, seed)
    pos = torch.randint(0, v.seq_len - steps, (v.batch,), generator=torch.Generator().manual_seed(seed),
                        dtype=torch.int32)
    kc, vc = layer.k_cache.clone(), layer.v_cache.clone()
    poss = [(pos + s).cuda() for s in range(steps)]
    torch.cuda.synchronize()
    outs, xi = [], x
    for p in poss:
        xi = layer(xi, p, validate=False)
        outs.append(xi)
    torch.cuda.synchronize()
    xi = x
    for step, (p, out) in enumerate(zip(poss, outs)):
        ref = reference.decoder_layer(xi, p, weights, kc, vc, v.model)
        assert verify.rel_err(out, ref) <= verify.REL_TOL[v.model.dtype], f"seed {seed} {v.name} step {step}"
        xi = out
