"""The ahead-of-time build on a machine without a GPU: layout, manifest, report, cache, shared objects, refusal of
over-budget variants, compile errors, and a killed or concurrent build never leaving a corrupt cubin.

Compiles are the expensive part (a tiny variant takes ~5 s of one core), so most tests reuse the session's tiny
build (conftest.tiny_build) or copy its content-addressed objects into a fresh build dir.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from generator.targets import ARCHS

from generator import compile as gcompile, render as grender, tune as gtune, variants as gvariants
SM90_SMEM = ARCHS["90"].smem_per_block

from conftest import ROOT, TINY_NAMES, WINDOW_YAML, cli_env, run_cli, sha256

ELF = b"\x7fELF"
RESOURCE_KEYS = ("cubin_bytes", "ptx_bytes", "registers", "spill_stores", "spill_loads", "stack_frame",
                 "static_smem", "dynamic_smem", "smem_total", "smem_pct", "blocks_per_sm", "compile_s", "cached")


def tiny_model_yaml(name: str, seq_lens, batch=(1,), **extra) -> str:
    fields = {"hidden": 64, "heads": 2, "kv_heads": 1, "head_dim": 32, "intermediate": 128, "layers": 1,
              "norm": "rmsnorm", "norm_eps": 1.0e-5, "rope_theta": 10000.0, "activation": "silu",
              "qkv_bias": False, "qk_norm": False, "dtype": "bf16", **extra}
    body = ", ".join(f"{k}: {json.dumps(v)}" for k, v in fields.items())
    return (f"matrix: {{mode: [decode], batch: {list(batch)}, seq_len: {list(seq_lens)}}}\n"
            f"models:\n  {name}: {{{body}}}\n")


def manifest(build_dir: Path) -> dict:
    return json.loads((Path(build_dir) / "manifest.json").read_text())


def assert_objects_intact(build_dir: Path) -> None:
    """Every complete object's cubin matches its meta.json and is an ELF file; every ok variant's cubin is its
    object's bytes."""
    build_dir = Path(build_dir)
    metas = list(build_dir.glob("objects/*/meta.json"))
    for meta_path in metas:
        meta = json.loads(meta_path.read_text())
        cubin = meta_path.parent / "kernel.cubin"
        data = cubin.read_bytes()
        assert data[:4] == ELF, f"{cubin} is not an ELF file"
        assert hashlib.sha256(data).hexdigest() == meta["cubin_sha256"], f"{cubin} does not match its meta.json"
        assert len(data) == meta["cubin_bytes"]
    if (build_dir / "manifest.json").exists():
        for name, e in manifest(build_dir)["variants"].items():
            if e["status"] != "ok":
                continue
            obj = build_dir / e["object"]
            assert gcompile.object_meta(obj) is not None, f"{name}: object {obj} incomplete or corrupt"
            assert (build_dir / e["cubin"]).read_bytes() == (obj / "kernel.cubin").read_bytes(), name


# ---------------------------------------------------------------- layout, manifest, report

def test_build_writes_source_cubin_and_manifest(tiny_build):
    d = tiny_build["dir"]
    m = manifest(d)
    assert set(m["variants"]) == set(TINY_NAMES)
    assert m["arch"] == "90" and m["compiler"] and m["package_version"]
    declared = {v.name: v for v in gvariants.load(tiny_build["variants"])}
    for name in TINY_NAMES:
        e = m["variants"][name]
        assert e["status"] == "ok", e
        assert e["name"] == name
        assert e["params"] == declared[name].params()
        assert e["source"] == f"{name}/kernel.cu" and e["cubin"] == f"{name}/kernel.cubin"
        assert e["object"] == f"objects/{e['key']}"
        src = (d / e["source"]).read_text()
        assert src == grender.render(declared[name])
        assert hashlib.sha256(src.encode()).hexdigest() == e["source_sha256"]
        assert "decoder_layer" in src
        cubin = (d / e["cubin"]).read_bytes()
        assert cubin[:4] == ELF
        obj = d / e["object"]
        for f in ("kernel.cubin", "kernel.ptx", "ptxas.log", "meta.json"):
            assert (obj / f).is_file(), obj / f
        assert "decoder_layer" in (obj / "ptxas.log").read_text()  # the ptxas -v log is kept
        r = e["resources"]
        assert set(RESOURCE_KEYS) <= set(r), set(RESOURCE_KEYS) - set(r)
        assert r["cubin_bytes"] == len(cubin)
        assert r["ptx_bytes"] == (obj / "kernel.ptx").stat().st_size
        assert 0 < r["registers"] <= 255
        assert r["dynamic_smem"] == e["plan"]["smem_bytes"]
        assert r["smem_total"] == r["dynamic_smem"] + r["static_smem"]
        assert r["smem_pct"] == round(100 * r["smem_total"] / SM90_SMEM, 1)
        assert r["blocks_per_sm"] >= 1 and r["compile_s"] > 0
        assert min(r["spill_stores"], r["spill_loads"], r["stack_frame"], r["static_smem"]) >= 0
        assert r["cached"] is False
    assert_objects_intact(d)


def test_build_files_are_readable_by_others(tiny_build):
    # atomic writes go through mkstemp (mode 0600): the final files must get an ordinary file's mode
    e = manifest(tiny_build["dir"])["variants"][TINY_NAMES[0]]
    for rel in ("manifest.json", "report.json", e["source"], e["cubin"]):
        mode = (tiny_build["dir"] / rel).stat().st_mode & 0o777
        assert mode == 0o666 & ~gcompile._UMASK, f"{rel}: mode {oct(mode)}"


def test_report_json_and_csv_hold_the_figures(tiny_build):
    d = tiny_build["dir"]
    m = manifest(d)["variants"]
    rep = json.loads((d / "report.json").read_text())
    rows = {r["name"]: r for r in rep["rows"]}
    assert set(rows) == set(TINY_NAMES)
    with open(d / "report.csv", newline="") as f:
        csv_rows = {r["name"]: r for r in csv.DictReader(f)}
    assert set(csv_rows) == set(TINY_NAMES)
    for name in TINY_NAMES:
        res = m[name]["resources"]
        for k in RESOURCE_KEYS:
            if k == "cached":
                continue
            assert rows[name][k] == res[k], (name, k)
            assert csv_rows[name][k] == str(res[k]), (name, k)
        assert rows[name]["status"] == "ok"
    t = rep["totals"]
    assert t["variants"] == 3 and t["built"] == 3 and t["distinct_binaries"] == 2
    keys = {m[n]["key"]: m[n]["resources"]["cubin_bytes"] for n in TINY_NAMES}
    assert t["binary_bytes"] == sum(keys.values())
    assert t["load_ms"] is None  # no GPU here
    # the terminal table went to stdout
    for name in TINY_NAMES:
        assert name in tiny_build["stdout"]
    assert "distinct binaries" in tiny_build["stdout"]


def test_identical_sources_share_one_object(tiny_build):
    d = tiny_build["dir"]
    m = manifest(d)["variants"]
    a, b, c = (m[n] for n in TINY_NAMES)
    # same shape under two names (only `layers` differs, which the kernel does not see)
    assert a["params"]["layers"] != b["params"]["layers"]
    assert a["key"] == b["key"] != c["key"]
    assert (d / a["source"]).read_text() == (d / b["source"]).read_text()
    assert os.path.samefile(d / a["cubin"], d / b["cubin"])  # one binary, hard-linked under both names
    assert len(list(d.glob("objects/*/meta.json"))) == 2
    assert "3 variants:" in tiny_build["stderr"] and "2 distinct binaries" in tiny_build["stderr"]


def test_cache_key_covers_source_and_arch():
    k = gcompile.cache_key("int x;", "90")
    assert k == gcompile.cache_key("int x;", "90")
    assert k != gcompile.cache_key("int y;", "90")
    assert k != gcompile.cache_key("int x;", "80")
    # what nvcc is told: sm_90 compiles as sm_90a (the same cubin), so objects cached before that are not reused
    assert k == gcompile.cache_key("int x;", "90a")


def test_parse_ptxas():
    log = ("ptxas info    : Compiling entry function 'decoder_layer' for 'sm_90'\n"
           "ptxas info    : Function properties for decoder_layer\n"
           "    40 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 128 registers, used 1 barriers, 16 bytes smem, 448 bytes cmem[0]\n")
    assert gcompile.parse_ptxas(log) == {"registers": 128, "stack_frame": 40, "spill_stores": 8,
                                         "spill_loads": 12, "static_smem": 16, "barriers": 1, "wgmma_serialized": 0}
    advisory = ("ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
                "to program dependence on compiler-inserted WG.DP in divergent path in the function 'decoder_layer'\n")
    assert gcompile.parse_ptxas(advisory + log)["wgmma_serialized"] == 1


def test_report_flags_serialized_wgmma():
    from generator import report
    entry = {"status": "ok", "arch": "90", "resources": {
        "spill_stores": 0, "spill_loads": 0, "smem_total": 1024, "smem_limit": 227 * 1024, "blocks_per_sm": 1}}
    assert report.flags(entry) == []
    entry["resources"]["wgmma_serialized"] = 2
    assert report.flags(entry) == ["wgmma-serialized"]


def test_report_flags_little_l1_where_the_gpu_has_room_for_more():
    """L1<60KB (plan.L1_ENOUGH): the block's shared memory leaves so little L1 that the weight loads stream slower;
    on the H200 / A100 class (>= 192 KB of L1 + shared memory an SM), not on 128 KB parts where it is the norm."""
    from generator import report
    from generator.plan import l1_bytes
    from generator.targets import arch
    res = {"spill_stores": 0, "spill_loads": 0, "smem_total": 200 * 1024, "blocks_per_sm": 1}
    assert report.flags({"status": "ok", "arch": "90", "resources": dict(res, l1_bytes=l1_bytes(arch("90"),
                                                                                           200 * 1024))}) == ["L1<60KB"]
    assert report.flags({"status": "ok", "arch": "90", "resources": dict(res, smem_total=150 * 1024, l1_bytes=l1_bytes(
        arch("90"), 150 * 1024))}) == []
    assert report.flags({"status": "ok", "arch": "86", "resources": dict(res, smem_total=90 * 1024, l1_bytes=l1_bytes(
        arch("86"), 90 * 1024))}) == []
    assert report.flags({"status": "ok", "arch": "90", "resources": res}) == []  # an older build: no L1 recorded
    # prefill: its GEMM's operands come by bulk copies into shared memory, not through L1
    assert report.flags({"status": "ok", "arch": "90", "plan": {"mode": "prefill"}, "resources": dict(
        res, l1_bytes=l1_bytes(arch("90"), 200 * 1024))}) == []


def test_report_flags_a_layer_no_gpu_of_its_arch_holds():
    import dataclasses
    from generator import report, variants as gvariants
    v = next(v for v in gvariants.load(ROOT / "variants.yaml") if v.name == "llama3.2-1b_prefill_b4_s2048_bf16")
    entry = {"status": "ok", "arch": "90", "params": v.params(), "plan": {"workspace": {"bytes": 10**9}},
             "resources": {"spill_stores": 0, "spill_loads": 0, "smem_total": 1024, "blocks_per_sm": 1}}
    assert report.flags(entry) == []
    huge = dataclasses.replace(v, batch=3, seq_len=1_000_000)  # a prompt chunk of a million tokens: ~147 GB
    entry.update(params=huge.params(), plan={"workspace": {"bytes": 147 * 10**9}})
    assert report.flags(entry) == ["mem>141GB"]


# ---------------------------------------------------------------- second build, --only

def test_second_build_recompiles_nothing(copy_build, tiny_build, tmp_path):
    d = copy_build()
    before = manifest(d)["variants"]
    files = {}
    for name in TINY_NAMES:
        e = before[name]
        for rel in (e["source"], f"{e['object']}/kernel.cubin", f"{e['object']}/meta.json",
                    f"{e['object']}/kernel.ptx"):
            st = (d / rel).stat()
            files[rel] = (st.st_ino, st.st_mtime_ns, sha256(d / rel))
    t0 = time.monotonic()
    r = run_cli(["build", "--variants", tiny_build["variants"], "--build-dir", d], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 60
    assert "0 binaries compiled, 3 up to date, 2 distinct binaries" in r.stderr
    # a rebuild where each variant's cubin already is its object's (hard-linked) leaves no temporary link behind
    assert run_cli(["build", "--variants", tiny_build["variants"], "--build-dir", d], cwd=tmp_path).returncode == 0
    assert not list(d.rglob("*.tmp")), list(d.rglob("*.tmp"))
    after = manifest(d)["variants"]
    for name in TINY_NAMES:
        assert after[name]["resources"]["cached"] is True
        assert after[name]["key"] == before[name]["key"]
        # the figures are carried over from the object, not re-measured
        for k in RESOURCE_KEYS:
            if k != "cached":
                assert after[name]["resources"][k] == before[name]["resources"][k]
    for rel, (ino, mtime, digest) in files.items():
        st = (d / rel).stat()
        assert (st.st_ino, st.st_mtime_ns, sha256(d / rel)) == (ino, mtime, digest), f"{rel} was rewritten"
    assert_objects_intact(d)
    rep = json.loads((d / "report.json").read_text())
    assert all(row["cached"] for row in rep["rows"])


def test_only_and_exclude_restrict_the_build(tiny_build, tmp_path):
    # a fresh build dir holding only the content-addressed objects: what --only selects is linked, not compiled
    d = tmp_path / "build"
    shutil.copytree(tiny_build["dir"] / "objects", d / "objects")
    r = run_cli(["build", "--variants", tiny_build["variants"], "--build-dir", d, "--only", "tiny-c*"],
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "1 variant: 0 binaries compiled, 1 up to date" in r.stderr
    assert set(manifest(d)["variants"]) == {TINY_NAMES[2]}
    assert not (d / TINY_NAMES[0]).exists() and not (d / TINY_NAMES[1]).exists()
    assert (d / TINY_NAMES[2] / "kernel.cubin").read_bytes()[:4] == ELF
    r = run_cli(["build", "--variants", tiny_build["variants"], "--build-dir", d, "--only", "tiny-*",
                 "--exclude", "*_fp16", "--exclude", "tiny-b*"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert set(manifest(d)["variants"]) == {TINY_NAMES[0], TINY_NAMES[2]}  # merged with the earlier build
    assert not (d / TINY_NAMES[1]).exists()
    rows = json.loads((d / "report.json").read_text())["rows"]
    assert {r["name"] for r in rows} == {TINY_NAMES[0], TINY_NAMES[2]}
    assert_objects_intact(d)


# ---------------------------------------------------------------- refusal and compile errors

OVER_BUDGET = """\
matrix: {mode: [decode], batch: [256], seq_len: [1024]}
models:
  huge:
    {hidden: 16384, heads: 128, kv_heads: 8, head_dim: 128, intermediate: 53248, layers: 126, norm: rmsnorm,
     norm_eps: 1.0e-5, rope_theta: 500000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
"""


def test_over_budget_variant_is_refused(tmp_path):
    f = tmp_path / "huge.yaml"
    f.write_text(OVER_BUDGET)
    v = gvariants.load(f)[0]
    with pytest.raises(grender.PlanError) as info:
        grender.plan(v)
    msg = str(info.value)
    assert "\n" not in msg and v.name in msg and "shared memory" in msg and "227 KB" in msg
    d = tmp_path / "build"
    r = run_cli(["build", "--variants", f, "--build-dir", d], cwd=tmp_path)
    # flagged; with nothing else selected nothing is built: exit 1 (a build with other variants exits 0)
    assert r.returncode == 1 and "error: nothing built: every selected variant was refused" in r.stderr, r.stderr
    assert f"warning: refused {v.name}: needs" in r.stderr and "227 KB" in r.stderr
    assert "1 variant: 0 binaries compiled, 0 up to date, 0 distinct binaries, 1 refused (below)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    e = manifest(d)["variants"][v.name]
    assert e["status"] == "refused" and "227 KB" in e["error"]
    assert not list(d.glob("objects/*")) and not (d / v.name / "kernel.cubin").exists()  # nothing compiled
    row = json.loads((d / "report.json").read_text())["rows"][0]
    assert row["flags"] == "refused"
    r = run_cli(["build", "--variants", f, "--build-dir", d, "--strict"], cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert f"refused {v.name}" in r.stderr
    r = run_cli(["report", "--build-dir", d, "--strict", "--no-gpu"], cwd=tmp_path)
    assert r.returncode == 1 and "1 flagged" in r.stdout


def test_compile_error_names_the_variant(copy_build, tiny_build, monkeypatch):
    d = copy_build()
    real_render = gcompile.render

    def broken(v, p=None):
        src = real_render(v, p)
        return src + "\n#error megakernel_test_broken\n" if v.model.name == "tiny-c" else src
    monkeypatch.setattr(gcompile, "render", broken)
    vs = gvariants.load(tiny_build["variants"])
    result = gcompile.build(vs, d, jobs=2)
    assert [e["name"] for e in result["errors"]] == [TINY_NAMES[2]]
    err = result["errors"][0]["error"]
    assert err.startswith(f"{TINY_NAMES[2]}: nvcc failed")
    assert "megakernel_test_broken" in err  # the compiler's own message
    ok = {e["name"]: e for e in result["entries"] if e["status"] == "ok"}
    assert set(ok) == set(TINY_NAMES[:2]) and all(e["resources"]["cached"] for e in ok.values())
    bad_key = next(e for e in result["entries"] if e["status"] == "error")["key"]
    assert gcompile.object_meta(d / "objects" / bad_key) is None  # a failed compile is not cached
    # nothing lost: the variant's good build from before stays, source, cubin and entry together, and that is said
    was = json.loads((Path(tiny_build["dir"]) / "manifest.json").read_text())["variants"][TINY_NAMES[2]]
    assert manifest(d)["variants"][TINY_NAMES[2]] == was
    assert (d / TINY_NAMES[2] / "kernel.cu").read_text() == \
        (Path(tiny_build["dir"]) / TINY_NAMES[2] / "kernel.cu").read_text()
    assert_objects_intact(d)
    assert [w for w in result["replaced"] if TINY_NAMES[2] in w and "previous build" in w and "kept" in w]
    # where there was none: the failure is recorded, and the loader will not use it
    fresh = d.parent / "fresh"
    result = gcompile.build([v for v in vs if v.name == TINY_NAMES[2]], fresh, jobs=2)
    assert manifest(fresh)["variants"][TINY_NAMES[2]]["status"] == "error" and not result["replaced"]
    from generator.loader import LoadError, find_entry
    with pytest.raises(LoadError, match="error"):
        find_entry(TINY_NAMES[2], fresh)
    # no build at all: the advice names the build command, and --variants for a file of one's own
    with pytest.raises(LoadError, match=r"no build in .*megakernel build --build-dir .* --only .* `--variants FILE`"):
        find_entry(TINY_NAMES[2], d / "none")
    # fixed source: the good object is still there
    monkeypatch.setattr(gcompile, "render", real_render)
    result = gcompile.build(vs, d, jobs=2)
    assert not result["errors"] and all(e["resources"]["cached"] for e in result["entries"])


def test_compile_error_through_the_cli(tiny_build, tmp_path):
    templates = tmp_path / "templates"
    shutil.copytree(grender.TEMPLATES, templates)
    with open(templates / "kernel.cu.j2", "a") as f:
        f.write("\nthis_is_not_cuda megakernel_test_broken;\n")
    code = ("import sys, pathlib, generator.render as r; r.TEMPLATES = pathlib.Path(sys.argv[1]); "
            "from generator.cli import main; main(sys.argv[2:], prog_name='megakernel')")
    d = tmp_path / "build"
    r = subprocess.run([sys.executable, "-c", code, templates, "build", "--variants", tiny_build["variants"],
                        "--build-dir", d, "--only", "tiny-a*"], cwd=tmp_path, env=cli_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert f"error: {TINY_NAMES[0]}: nvcc failed" in r.stderr
    assert "1 failed to compile" in r.stderr
    assert "megakernel_test_broken" in r.stderr and "error" in r.stderr.split("nvcc failed", 1)[1]
    assert "Traceback" not in r.stderr
    assert manifest(d)["variants"][TINY_NAMES[0]]["status"] == "error"


def test_report_keeps_the_compilers_error_line():
    from generator.report import error_line
    assert error_line("v: nvcc failed:\nk.cu(3): warning: w\nk.cu(9): error: bar is undefined\n1 error") == \
        "v: nvcc failed: k.cu(9): error: bar is undefined"
    assert error_line("v: refused: too big") == "v: refused: too big" and error_line(None) == "no reason recorded"


def test_a_signal_while_the_build_records_waits_for_the_record(copy_build, tiny_build, monkeypatch, request):
    """Ctrl-C (or SIGTERM) as the build writes its sources, cubins and manifest is held off until all are written:
    the directory is this build's, consistent (it had rewritten kernel.cu, then stopped before the manifest), and
    the build then stops with RecordedInterrupt."""
    # Ctrl-C's handler in place: a shell's background job inherits SIGINT ignored, and the build (rightly) keeps
    # that, so the signal would do nothing
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, prev))
    d = copy_build()
    real = gcompile.write_if_changed
    sent = []

    def write(path, text):
        if not sent:
            sent.append(path)
            os.kill(os.getpid(), signal.SIGINT)  # (held off: the write goes on)
        return real(path, text)
    monkeypatch.setattr(gcompile, "write_if_changed", write)
    real_render = gcompile.render
    monkeypatch.setattr(gcompile, "render", lambda v, p=None: real_render(v, p) + "\n// megakernel_test_changed\n")
    vs = gvariants.load(tiny_build["variants"])
    try:
        r = gcompile.build(vs, d, jobs=2)
    except gcompile.RecordedInterrupt:
        pass
    else:  # (once, under a loaded machine, no signal came: say why, e.g. a compile that failed kept the old build)
        pytest.fail(f"no RecordedInterrupt (signal sent at {sent}); entries: "
                    f"{[(e['name'], e['status'], str(e.get('error', ''))[-300:]) for e in r['entries']]}")
    assert sent
    m = manifest(d)["variants"]
    for v in vs:  # every variant's new source, its cubin and its entry: all this build's
        src = (d / v.name / "kernel.cu").read_text()
        assert "megakernel_test_changed" in src and m[v.name]["source_sha256"] == sha256(d / v.name / "kernel.cu")
    assert_objects_intact(d)
    with gcompile.uninterrupted():  # nothing pending: the block runs and returns
        pass
    # a block that fails as well raises its own error (its record is not whole), and the handlers are restored
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(OSError, match="disk full"):
        with gcompile.uninterrupted():
            os.kill(os.getpid(), signal.SIGINT)
            raise OSError("disk full")
    assert signal.getsignal(signal.SIGINT) is before


def test_build_reads_the_variants_file_once(tiny_build, tmp_path):
    """A variants file that cannot be read again (a pipe, an edit during the build) does not fail the build's end."""
    d = tmp_path / "build"
    text = Path(tiny_build["variants"]).read_text()
    r = subprocess.run(["bash", "-c", f"{shlex.quote(sys.executable)} -m generator.cli build --variants "
                        f"<(cat {shlex.quote(str(tiny_build['variants']))}) --build-dir {shlex.quote(str(d))} "
                        "--only 'tiny-a*' --no-report"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and text and manifest(d)["variants"][TINY_NAMES[0]]["status"] == "ok"


# ---------------------------------------------------------------- corruption, kill, concurrency

def test_corrupt_cubin_is_detected_and_rebuilt(copy_build, tiny_build, tmp_path):
    d = copy_build()
    e = manifest(d)["variants"][TINY_NAMES[2]]
    obj = d / e["object"]
    good = gcompile.object_meta(obj)
    assert good is not None
    data = bytearray((obj / "kernel.cubin").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (obj / "kernel.cubin").write_bytes(bytes(data))
    assert gcompile.object_meta(obj) is None
    # other incomplete states read as "rebuild" too
    other = d / manifest(d)["variants"][TINY_NAMES[0]]["object"]
    scratch = tmp_path / "scratch"
    shutil.copytree(other, scratch)
    (scratch / "meta.json").write_text("{\"cubin_sha256\": ")  # truncated
    assert gcompile.object_meta(scratch) is None
    (scratch / "meta.json").unlink()  # killed before the meta was written
    assert gcompile.object_meta(scratch) is None
    assert gcompile.object_meta(other) is not None

    r = run_cli(["build", "--variants", tiny_build["variants"], "--build-dir", d], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "1 binary compiled, 2 up to date" in r.stderr
    m = manifest(d)["variants"]
    assert m[TINY_NAMES[2]]["resources"]["cached"] is False
    assert m[TINY_NAMES[0]]["resources"]["cached"] is True
    assert gcompile.object_meta(obj) is not None  # (not byte-identical to the first: -lineinfo records a tmp path)
    assert_objects_intact(d)


def test_killed_build_then_rebuild_gives_correct_cubins(tmp_path):
    f = tmp_path / "kill.yaml"
    f.write_text(tiny_model_yaml("killme", seq_lens=(16, 32)))  # two distinct objects
    d = tmp_path / "build"
    args = [sys.executable, "-m", "generator.cli", "build", "--variants", str(f), "--build-dir", str(d), "-j", "1"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not list(d.glob("objects/*/meta.json")):  # the first object is complete: the second is compiling
            assert proc.poll() is None, "the build ended before it could be killed"
            assert time.monotonic() < deadline, "no object appeared"
            time.sleep(0.01)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the CLI and its nvcc children
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    complete = {p.parent.name for p in d.glob("objects/*/meta.json")}
    assert len(complete) == 1, "killed too late: both objects were complete"
    assert not (d / "manifest.json").exists()  # the manifest is written when the build ends
    assert_objects_intact(d)  # whatever is under a final name is whole

    r = run_cli(["build", "--variants", f, "--build-dir", d, "-j", "1"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "1 binary compiled, 1 up to date" in r.stderr
    m = manifest(d)["variants"]
    assert set(m) == {"killme_decode_b1_s16_bf16", "killme_decode_b1_s32_bf16"}
    assert {e["key"] for e in m.values() if e["resources"]["cached"]} == complete
    assert_objects_intact(d)
    for e in m.values():
        assert (d / e["cubin"]).read_bytes()[:4] == ELF


def test_two_builds_at_once_on_one_build_dir(tmp_path):
    # both start with the shared variant, so they race on compiling and writing the same object
    f1, f2 = tmp_path / "one.yaml", tmp_path / "two.yaml"
    f1.write_text(tiny_model_yaml("conc", seq_lens=(40, 24)))
    f2.write_text(tiny_model_yaml("conc", seq_lens=(40, 56)))
    d = tmp_path / "build"
    procs = [subprocess.Popen([sys.executable, "-m", "generator.cli", "build", "--variants", str(f), "--build-dir",
                               str(d), "-j", "1"], cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for f in (f1, f2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "Traceback" not in err
    # the shared object was compiled once: the second build waited for it and reused it
    compiled = [int(re.search(r"(\d+) binar(?:y|ies) compiled", err).group(1)) for _, err in outs]
    assert sum(compiled) == 3, [err for _, err in outs]
    m = manifest(d)["variants"]
    assert set(m) == {f"conc_decode_b1_s{s}_bf16" for s in (24, 40, 56)}  # the union
    assert all(e["status"] == "ok" for e in m.values())
    assert len(list(d.glob("objects/*/meta.json"))) == 3
    assert_objects_intact(d)
    r = run_cli(["report", "--build-dir", d, "--no-gpu"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads((d / "report.json").read_text())["rows"]
    assert len(rows) == 3 and all(row["status"] == "ok" for row in rows)


# ---------------------------------------------------------------- one real shape

def test_a_default_variant_compiles(tmp_path):
    name = "qwen3-1.7b_decode_b8_s32768_bf16"  # qk_norm, head_dim 128, the largest batch and cache
    d = tmp_path / "build"
    r = run_cli(["build", "--variants", ROOT / "variants.yaml", "--build-dir", d, "--only", name], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    e = manifest(d)["variants"][name]
    assert e["status"] == "ok"
    assert e["resources"]["blocks_per_sm"] >= 1
    assert e["resources"]["smem_total"] <= SM90_SMEM
    assert_objects_intact(d)


@pytest.mark.skipif(os.environ.get("MEGAKERNEL_FULL_BUILD") != "1",
                    reason="set MEGAKERNEL_FULL_BUILD=1 to build all 67 default variants (2-9 min on 2 cores; CI does)")
def test_every_default_variant_builds(tmp_path):
    d = tmp_path / "build"
    r = run_cli(["build", "--variants", ROOT / "variants.yaml", "--build-dir", d], cwd=tmp_path, timeout=3000)
    assert r.returncode == 0, r.stderr
    names = {v.name for v in gvariants.load(ROOT / "variants.yaml")}
    m = manifest(d)["variants"]
    assert set(m) == names and all(e["status"] == "ok" for e in m.values())
    rep = json.loads((d / "report.json").read_text())
    assert {row["name"] for row in rep["rows"]} == names
    for row in rep["rows"]:
        for k in RESOURCE_KEYS:
            if k != "cached":
                assert row[k] is not None, (row["name"], k)
        assert row["blocks_per_sm"] >= 1 and row["smem_total"] <= SM90_SMEM, row["name"]
        # no default variant spills, with the plans `build` takes (tuning/'s winners where it has one file), and
        # none had to be re-planned for it (a template change that makes a default spill fails here)
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, (row["name"], row["plan"])
        assert row["plan"] != "default (re-planned)", row["name"]
    assert rep["totals"]["built"] == len(names) == 67
    assert_objects_intact(d)
    r = run_cli(["build", "--variants", ROOT / "variants.yaml", "--build-dir", d], cwd=tmp_path)
    assert r.returncode == 0 and "67 variants: 0 binaries compiled, 67 up to date" in r.stderr, r.stderr


def test_stale_temp_files_are_removed_fresh_ones_kept(tmp_path):
    d = tmp_path / "b" / "objects" / "k"
    d.mkdir(parents=True)
    old, fresh = d / ".kernel.cubin.abc.tmp", d / ".kernel.cubin.def.tmp"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"being written")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert gcompile.remove_stale_temps(tmp_path / "b") == 1
    assert not old.exists() and fresh.exists()
    # object directories an interrupted compile left holding only their lock: removed once the lock is old and free;
    # a fresh lock (a compile waiting or running opened it) or one a compile holds is kept
    import fcntl
    objs = tmp_path / "b" / "objects"
    for name, age in (("dead", 7200), ("live", 0), ("held", 7200)):
        (objs / name).mkdir()
        (objs / name / ".lock").write_bytes(b"")
        os.utime(objs / name / ".lock", (time.time() - age, time.time() - age))
    with open(objs / "held" / ".lock") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        assert gcompile.remove_stale_temps(tmp_path / "b") == 1
    assert not (objs / "dead").exists() and (objs / "live").is_dir() and (objs / "held").is_dir()
    assert d.is_dir()  # holds a file being written


def test_an_object_lock_removed_while_waiting_for_it_is_taken_again(tmp_path, monkeypatch):
    """compiled_object compiles under the lock file that is the object's own: one that remove_stale_temps unlinked
    (with its directory) while this process waited for it no longer guards anything, so it locks the directory
    anew rather than compile beside another process."""
    obj = tmp_path / "b" / "objects" / "k"
    calls = []
    real_flock = gcompile.fcntl.flock

    def flock(f, op):  # the first time: a cleanup runs while this process waits for the lock
        real_flock(f, op)
        if not calls:
            calls.append("removed")
            (obj / ".lock").unlink()
            obj.rmdir()
    monkeypatch.setattr(gcompile.fcntl, "flock", flock)
    monkeypatch.setattr(gcompile, "_compile_object", lambda source, arch, o: calls.append(o.is_dir()) or {"ok": 1})
    assert gcompile.compiled_object("src", "k", "90", tmp_path / "b") == ({"ok": 1}, False)
    assert calls == ["removed", True] and (obj / ".lock").is_file()


def test_report_counts_tensor_core_instructions_in_the_sass(tiny_build):
    """Every built kernel runs its projections and attention on the tensor cores: HMMA in its SASS, counted."""
    from generator import toolchain
    if toolchain.find_cuda_tool("cuobjdump") is None or toolchain.find_cuda_tool("nvdisasm") is None:
        pytest.skip("cuobjdump/nvdisasm not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    m = manifest(tiny_build["dir"])
    for name in TINY_NAMES:
        sass = m["variants"][name]["resources"]["sass"]
        assert sass is not None and sass["HMMA"] > 0 and sass["LDSM"] > 0, (name, sass)
    from generator.report import build_report
    rep = build_report(tiny_build["dir"], gpu=False, write=False)
    assert all(r["mma_sass"] > 0 for r in rep["rows"])


def test_pdl_launch_structs_match_cuda_h():
    """The loader's ctypes mirror of cuLaunchKernelEx's CUlaunchConfig / CUlaunchAttribute (cuda.h, CUDA 12+):
    sizes and offsets as the driver reads them, and the attribute ids of a cooperative launch with programmatic
    stream serialization. A wrong layout would launch with garbage (the GPU tests would fail; this says why)."""
    import ctypes

    from generator import loader
    assert ctypes.sizeof(loader._LaunchAttr) == 72 and loader._LaunchAttr.value.offset == 8
    c = loader._LaunchConfig
    assert [getattr(c, f).offset for f in ("sharedMemBytes", "hStream", "attrs", "numAttrs")] == [24, 32, 40, 48]
    assert ctypes.sizeof(c) == 56
    assert (loader._ATTR_COOPERATIVE, loader._ATTR_PROGRAMMATIC_STREAM_SERIALIZATION) == (2, 6)
    cuda_h = Path("/usr/local/cuda/include/cuda.h")
    if cuda_h.exists():  # the ids as this machine's toolkit declares them
        text = cuda_h.read_text(errors="replace")
        assert re.search(r"CU_LAUNCH_ATTRIBUTE_COOPERATIVE\s*=\s*2\b", text)
        assert re.search(r"CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION\s*=\s*6\b", text)


def test_a_spilling_default_plan_is_replanned_spill_free_and_warned(tmp_path, tiny_variants_file, monkeypatch):
    """build(replan_spills=True): a default plan whose compile spills is replaced by the first tuner candidate
    that compiles without (warned, plan_source "default (re-planned)", its source and cubin in the build dir);
    the tuner's builds (replan_spills=False) keep the plan as given; a tuning entry that kept the default plan
    (overrides {}) is re-planned like it, one with overrides is not; where every tried candidate spills, the
    default stays, warned; so does a default that spills less than REPLAN_MIN_SPILL. Spills are simulated: X_FRAG 1
    (the tiny variants' default) "spills" (first 8 B, then 200 B of stores and as much of loads)."""
    real = gcompile._compile_object
    size = [8]

    def spilly(source, arch, obj):
        meta = real(source, arch, obj)
        if "constexpr int X_FRAG = 1;" in source:
            meta = {**meta, "spill_stores": size[0], "spill_loads": size[0]}
        return meta

    monkeypatch.setattr(gcompile, "_compile_object", spilly)
    v = next(v for v in gvariants.load(tiny_variants_file) if v.name == TINY_NAMES[0])
    assert grender.plan(v)["consts"]["X_FRAG"] == 1
    said = []  # 16 B in all: under REPLAN_MIN_SPILL, built as planned and warned, nothing re-planned
    r = gcompile.build([v], tmp_path / "s", jobs=2, notify=said.append)
    assert not said and r["entries"][0]["plan_source"] == "default", said
    assert r["entries"][0]["resources"]["spill_stores"] == 8
    assert any(v.name in w and "built as planned (spills under 256 B" in w for w in r["replans"]), r["replans"]
    size[0] = 200
    said = []  # the re-planning round is announced (the progress count is complete before it)
    r = gcompile.build([v], tmp_path / "a", jobs=2, variants_file=tiny_variants_file, notify=said.append)
    assert len(said) == 2 and "re-planning 1 variant(s)" in said[0] and v.name in said[0]
    assert said[1].startswith(f"re-planned {v.name} (1/1, ") and "X_FRAG" in said[1]  # each variant as it is done
    e = r["entries"][0]
    assert e["plan_source"] == "default (re-planned)" and e["replanned"]["overrides"].get("X_FRAG") == 0
    assert e["replanned"]["default_spills"] == [200, 200] and e["resources"]["spill_stores"] == 0
    assert e["plan"]["consts"]["X_FRAG"] == 0
    assert any(v.name in w and "compile without spills" in w for w in r["replans"]) and not r["warnings"]
    built = json.loads((tmp_path / "a" / "manifest.json").read_text())["variants"][v.name]
    assert built["plan_source"] == "default (re-planned)" and built["key"] == e["key"]
    assert "constexpr int X_FRAG = 0;" in (tmp_path / "a" / v.name / "kernel.cu").read_text()
    assert (tmp_path / "a" / v.name / "kernel.cubin").read_bytes() == \
        (tmp_path / "a" / "objects" / e["key"] / "kernel.cubin").read_bytes()
    r = gcompile.build([v], tmp_path / "b", jobs=2, replan_spills=False)
    assert r["entries"][0]["plan_source"] == "default" and r["entries"][0]["resources"]["spill_stores"] == 200
    # a tuning entry that kept the default plan (overrides {}) is the default: re-planned too; one with overrides
    # is built as given
    for ov, replanned in (({}, True), ({"ATT_STAGES": 3}, False)):
        tfile = tmp_path / f"t{len(ov)}.json"
        tfile.write_text(json.dumps({v.name: {"overrides": ov}}))
        r = gcompile.build([v], tmp_path / f"t{len(ov)}", jobs=2, tuning_file=tfile)
        e = r["entries"][0]
        assert (e["plan_source"] == "default (re-planned)") == replanned, (ov, e["plan_source"])
        assert (e["resources"]["spill_stores"] == 0) == replanned, ov
    monkeypatch.setattr(gcompile, "REPLAN_TRIES", 2)
    monkeypatch.setattr(gtune, "candidates",
                        lambda v, arch="90", limit=28: [{}, {"ATT_STAGES": 3}, {"GEMV_PF": 1}, {"X_FRAG": 0}])
    r = gcompile.build([v], tmp_path / "c", jobs=2)
    assert r["entries"][0]["plan_source"] == "default", r["entries"][0].get("replanned")
    assert r["entries"][0]["resources"]["spill_stores"] == 200
    assert any("none of the tuner's first 2 candidates spills less" in w for w in r["replans"])
    # none compiles without, one spills less than the default: that one, warned as such
    real_spilly = gcompile._compile_object

    def less(source, arch, obj):
        meta = real_spilly(source, arch, obj)
        if "constexpr int GEMV_PF = 1;" in source:
            meta = {**meta, "spill_stores": 20, "spill_loads": 20}
        return meta

    monkeypatch.setattr(gcompile, "_compile_object", less)
    r = gcompile.build([v], tmp_path / "d", jobs=2)
    e = r["entries"][0]
    assert e["plan_source"] == "default (re-planned)" and e["replanned"]["overrides"] == {"GEMV_PF": 1}, e
    assert e["resources"]["spill_stores"] == 20 and any("the least spilling" in w for w in r["replans"])


def test_large_query_groups_keep_their_fragments_in_shared_memory_and_do_not_spill(tmp_path):
    """ATT_QSMEM (the decode planner): the queries' B fragments live in shared memory exactly where n-tiles x
    k-steps >= 16 (e.g. a GQA group of more than 8 at head_dim >= 128, or head_dim 256) and the packed copy fits beside
    the ring (else registers, as before: a 99 KB GPU), where 2 x that many registers held through attention's walk
    spilled 184-364 B (Mistral-Large- and Llama-3.1-405B-like groups of 12 and 16); a group of 12 at head_dim 128
    (batch 8, the worst of them) compiles for sm_90 with no spill."""
    text = """
matrix: {mode: [decode], batch: [8], seq_len: [1024]}
models:
  qs-g12: {hidden: 1024, heads: 24, kv_heads: 2, head_dim: 128, intermediate: 2048, layers: 2, norm: rmsnorm,
           norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
  qs-g8: {hidden: 1024, heads: 16, kv_heads: 2, head_dim: 128, intermediate: 2048, layers: 2, norm: rmsnorm,
          norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
  qs-g16-hd64: {hidden: 1024, heads: 32, kv_heads: 2, head_dim: 64, intermediate: 2048, layers: 2, norm: rmsnorm,
                norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
  qs-hd256: {hidden: 1024, heads: 4, kv_heads: 2, head_dim: 256, intermediate: 2048, layers: 2, norm: rmsnorm,
             norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
"""
    vs = {v.model.name: v for v in gvariants.parse(text, "qs.yaml")}
    got = {n: grender.plan(v)["consts"]["ATT_QSMEM"] for n, v in vs.items()}
    assert got == {"qs-g12": 1, "qs-g8": 0, "qs-g16-hd64": 0, "qs-hd256": 1}
    c = grender.plan(vs["qs-g12"])["consts"]
    assert c["SMEM_PT"] - c["SMEM_QP"] >= 2 * (128 // 16) * 32 * 8  # [n-tiles][k-steps][32 lanes] uint2
    assert c["SMEM_QP"] >= (12 + 1) * 128 * 4  # past the queries and the new key (fp32)
    # where the packed copy would not fit beside the ring (a 99 KB GPU), registers as before: the shape still plans
    small = gvariants.parse(text.replace("head_dim: 128, intermediate: 2048", "head_dim: 256, intermediate: 2048", 1),
                            "qs.yaml")[0]
    assert small.model.head_dim == 256 and small.model.heads // small.model.kv_heads == 12
    assert grender.plan(small, "90")["consts"]["ATT_QSMEM"] == 1
    assert grender.plan(small, "86")["consts"]["ATT_QSMEM"] == 0
    r = gcompile.build([vs["qs-g12"]], tmp_path / "b", jobs=2, replan_spills=False)
    e, = r["entries"]
    assert e["status"] == "ok", e.get("error")
    assert e["resources"]["spill_stores"] == 0 and e["resources"]["spill_loads"] == 0, e["resources"]


def test_sliding_window_variants_compile_without_spills(tmp_path):
    """The sliding-window shapes of the GPU test (tests/test_gpu.py test_sliding_window_matches_the_reference) compile
    for sm_90 with WINDOW set, no spill and the shared memory within the block's limit."""
    vs = gvariants.parse(WINDOW_YAML, "window.yaml")
    res = gcompile.build(vs, tmp_path)
    assert not res["errors"], res["errors"][0]["error"][:500]
    for e in res["entries"]:
        assert e["plan"]["consts"]["WINDOW"] == e["params"]["sliding_window"], e["name"]
        r = e["resources"]
        assert r["spill_stores"] == r["spill_loads"] == 0 and r["smem_total"] <= r["smem_limit"], (e["name"], r)
