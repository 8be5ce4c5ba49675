"""The `megakernel` command line as a user runs it (a subprocess): bad input is one `error:` line on stderr, exit 2,
no traceback, and build/ left exactly as it was; the other commands do what they say."""
from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from generator import compile as gcompile, render as grender, variants as gvariants

from conftest import ROOT, TINY_NAMES, cli_env, run_cli, snapshot
from test_variants import BAD_CASES, GOOD_TEXT

DEFAULT_NAMES = [v.name for v in gvariants.load(ROOT / "variants.yaml")]


def assert_bad_input(r: subprocess.CompletedProcess, *expect: str) -> str:
    assert r.returncode == 2, f"exit {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    lines = r.stderr.splitlines()
    assert len(lines) == 1, f"stderr is not one line: {r.stderr!r}"
    assert lines[0].startswith("error: "), lines[0]
    for s in expect:
        assert s in lines[0], f"{s!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture(params=["no-build", "previous-build"])
def workdir(request, tmp_path, copy_build):
    """A working directory whose build/ is absent or holds a previous (complete) build."""
    if request.param == "previous-build":
        copy_build(tmp_path / "build")
    return tmp_path


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_variants_file_exits_2_and_leaves_build_untouched(case, workdir):
    text, expect = BAD_CASES[case]
    (workdir / "variants.yaml").write_text(text)
    before = snapshot(workdir / "build")
    # the defaults: ./variants.yaml and ./build
    r = run_cli(["build"], cwd=workdir)
    line = assert_bad_input(r, *expect)
    assert line.startswith("error: variants.yaml")
    assert snapshot(workdir / "build") == before


@pytest.mark.parametrize("case", ["unknown-key", "yaml-syntax-tab", "duplicate-variant-name", "hidden-zero"])
@pytest.mark.parametrize("command", [["list"], ["render", "tiny_decode_b1_s64_bf16"], ["build", "--strict"]])
def test_every_command_rejects_a_bad_file(case, command, workdir):
    text, expect = BAD_CASES[case]
    bad = workdir / "bad.yaml"
    bad.write_text(text)
    before = snapshot(workdir / "build")
    r = run_cli([*command, "--variants", bad], cwd=workdir)
    assert_bad_input(r, str(bad), *expect)
    assert snapshot(workdir / "build") == before


def test_missing_variants_file(workdir):
    before = snapshot(workdir / "build")
    r = run_cli(["build", "--variants", "nope.yaml"], cwd=workdir)
    assert_bad_input(r, "nope.yaml", "no such variants file", "--write nope.yaml")
    assert snapshot(workdir / "build") == before


def test_model_directory_given_as_variants_file(workdir):
    """A Hugging Face model directory or its config.json passed as --variants is named as such, with from-hf's
    command (a trial got "Is a directory" and "unknown top-level field 'architectures'"); nothing is built."""
    model = workdir / "llama-model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    (workdir / "empty").mkdir()
    before = snapshot(workdir / "build")
    for command in ("build", "report"):
        for arg, want in ((model, "a Hugging Face model directory"), (model / "config.json", "a Hugging Face config.json"),
                          (workdir / "empty", "a directory, not a variants file")):
            r = run_cli([command, "--variants", arg], cwd=workdir)
            assert_bad_input(r, str(arg), want, *(["from-hf"] if "Hugging" in want else []))
    assert snapshot(workdir / "build") == before


def test_bad_arch(workdir):
    (workdir / "variants.yaml").write_text(GOOD_TEXT)
    before = snapshot(workdir / "build")
    r = run_cli(["build", "--arch", "abc"], cwd=workdir)
    assert_bad_input(r, "--arch", "'abc'")
    assert snapshot(workdir / "build") == before
    # an arch-specific target below sm_90 (nvcc has no compute_80a): refused before nvcc runs, nothing written
    r = run_cli(["build", "--arch", "80a"], cwd=workdir)
    assert_bad_input(r, "--arch 80a", "no arch-specific ('a') target", "--arch 80")
    assert snapshot(workdir / "build") == before


def test_a_full_disk_is_one_line_and_leaves_no_incomplete_object(tmp_path, monkeypatch):
    """A write that fails (ENOSPC, a full disk) names its file (atomic_write; the CLI then says it in one line) and the
    object being written is removed whole: no objects/<key>/ of a PTX and a log without its cubin and meta.json."""
    import errno
    import os as _os

    from generator import compile as gcompile
    real = _os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(gcompile.os, "fdopen", lambda fd, mode: Full(real(fd, mode)))
    with pytest.raises(OSError) as exc:
        gcompile.atomic_write(tmp_path / "a" / "meta.json", "{}")
    assert exc.value.errno == errno.ENOSPC and exc.value.filename == str(tmp_path / "a" / "meta.json")
    assert list((tmp_path / "a").iterdir()) == []  # (its temporary file removed)
    monkeypatch.undo()
    writes = []

    def fail_second(path, data):  # the PTX and the log written, then the disk is full
        writes.append(Path(path).name)
        if len(writes) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        Path(path).write_text(data if isinstance(data, str) else data.decode(errors="replace"))
    monkeypatch.setattr(gcompile, "atomic_write", fail_second)
    monkeypatch.setattr(gcompile, "_compile_object", lambda source, arch, obj: (
        gcompile.atomic_write(obj / "ptxas.log", "log"), gcompile.atomic_write(obj / "kernel.ptx", "ptx")))
    with pytest.raises(OSError, match="No space left"):
        gcompile.compiled_object("src", "k0", "90", tmp_path / "b")
    assert not (tmp_path / "b" / "objects" / "k0").exists()


def test_only_matching_nothing(workdir, capsys):
    (workdir / "variants.yaml").write_text(GOOD_TEXT)
    before = snapshot(workdir / "build")
    r = run_cli(["build", "--only", "nothing*"], cwd=workdir)
    assert_bad_input(r, "no variant matches", "nothing*")
    r = run_cli(["build", "--exclude", "*"], cwd=workdir)
    assert "--only" not in assert_bad_input(r, "--exclude * leaves no variant (it excludes all")  # (no --only given)
    r = run_cli(["build", "--only", "*b1*", "--exclude", "*"], cwd=workdir)
    assert_bad_input(r, "--exclude * leaves no variant (it excludes all", "that --only *b1* selects")
    r = run_cli(["list", "--only", "nothing*"], cwd=workdir)
    assert_bad_input(r, "no variant matches")
    assert snapshot(workdir / "build") == before
    # one of several globs matching nothing (a typo) is said, the others still listed
    r = run_cli(["list", "--only", "tiny*", "--only", "tyni*"], cwd=workdir)
    assert r.returncode == 0 and "tiny" in r.stdout, r.stderr
    assert r.stderr.count("\n") == 1 and "warning" in r.stderr and "--only tyni* matches no variant" in r.stderr
    # so is an --exclude that excludes nothing (session 67's trial: it was silent)
    from generator import cli as gcli
    assert [v.name for v in gcli.load_selected(str(workdir / "variants.yaml"), exclude=("zzz*",))] == \
        [v.name for v in gcli.load_selected(str(workdir / "variants.yaml"))]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning" in err and "--exclude zzz* matches no variant" in err, err


# ---------------------------------------------------------------- list, render

def test_list_default_variants(tmp_path):
    r = run_cli(["list", "--variants", ROOT / "variants.yaml"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "build").exists()
    for name in DEFAULT_NAMES:
        assert name in r.stdout
    assert len(DEFAULT_NAMES) == 67
    # a narrow terminal: whole names, the model's columns dropped and named; --wide keeps them all
    r = run_cli(["list", "--variants", ROOT / "variants.yaml"], cwd=tmp_path, env={"COLUMNS": "72"})
    assert r.returncode == 0 and all(n in r.stdout for n in DEFAULT_NAMES), r.stdout
    assert max(map(len, r.stdout.splitlines())) <= 72 and "not shown at this width: inter, head_dim" in r.stdout
    r = run_cli(["list", "--variants", ROOT / "variants.yaml", "--wide"], cwd=tmp_path, env={"COLUMNS": "72"})
    assert r.returncode == 0 and "head_dim" in r.stdout and "not shown" not in r.stdout
    # a COLUMNS that is no width (0, text) is the piped default, not a table squeezed to nothing
    for cols in ("0", "abc"):
        r = run_cli(["list", "--variants", ROOT / "variants.yaml"], cwd=tmp_path, env={"COLUMNS": cols})
        assert r.returncode == 0 and all(n in r.stdout for n in DEFAULT_NAMES) and "not shown" not in r.stdout, cols


def build_status(table: str) -> dict[str, str]:
    """variant -> its last column in `megakernel list`'s table."""
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("│┃").split("│")]
        if len(cells) > 2 and cells[0].startswith("tiny-"):
            out[cells[0]] = cells[-1]
    return out


def test_list_shows_build_status(tiny_build, copy_build, tmp_path):
    d = copy_build()
    r = run_cli(["list", "--variants", tiny_build["variants"], "--build-dir", d], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    status = build_status(r.stdout)
    assert status == {n: "built" for n in TINY_NAMES}, r.stdout
    m = json.loads((d / "manifest.json").read_text())
    m["variants"][TINY_NAMES[0]]["sources_sha256"] = "0" * 64  # as if the templates had changed since
    (d / "manifest.json").write_text(json.dumps(m))
    r = run_cli(["list", "--variants", tiny_build["variants"], "--build-dir", d, "--only", "tiny-a*"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert build_status(r.stdout) == {TINY_NAMES[0]: "stale (templates)"}, r.stdout
    # a built variant whose cubin was deleted is not "built"
    cubin = d / m["variants"][TINY_NAMES[1]]["cubin"]
    cubin.unlink()
    r = run_cli(["list", "--variants", tiny_build["variants"], "--build-dir", d], cwd=tmp_path)
    assert build_status(r.stdout)[TINY_NAMES[1]] == "cubin missing", r.stdout
    # a build with plan overrides (the tuner's candidates) says so
    m["variants"][TINY_NAMES[2]]["plan_source"] = "override"
    (d / "manifest.json").write_text(json.dumps(m))
    r = run_cli(["list", "--variants", tiny_build["variants"], "--build-dir", d], cwd=tmp_path)
    assert build_status(r.stdout)[TINY_NAMES[2]] == "built (plan override)", r.stdout
    # the report flags the same stale build, so `report --strict` fails on it
    r = run_cli(["report", "--variants", tiny_build["variants"], "--build-dir", d, "--no-gpu", "--strict"],
                cwd=tmp_path)
    assert r.returncode == 1 and "stale (templates)" in r.stdout, r.stdout + r.stderr
    rep = {row["name"]: row for row in json.loads((d / "report.json").read_text())["rows"]}
    assert "cubin-missing" in rep[TINY_NAMES[1]]["flags"]  # flagged too (fails --strict), as `list` says
    r = run_cli(["list", "--variants", tiny_build["variants"], "--build-dir", tmp_path / "none"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert build_status(r.stdout) == {n: "not built" for n in TINY_NAMES}, r.stdout
    assert not (tmp_path / "none").exists()


def test_render_prints_the_cuda_source(tmp_path):
    name = "llama3.2-1b_decode_b1_s4096_bf16"
    # (a build directory of its own: the checkout's build/, which the README's main command leaves, may hold the
    # tuned plan, and render then notes that it prints another: test_render_shows_the_plan_build_compiles)
    r = run_cli(["render", name, "--no-tuned", "--build-dir", tmp_path / "build"], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "decoder_layer" in r.stdout and 'extern "C" __global__' in r.stdout
    assert re.search(r"\bHIDDEN\s*=\s*2048\b", r.stdout) and re.search(r"\bSEQ_LEN\s*=\s*4096\b", r.stdout)
    v = next(v for v in gvariants.load(ROOT / "variants.yaml") if v.name == name)
    assert r.stdout == grender.render(v)
    assert r.stderr == ""


def test_render_shows_the_plan_build_compiles(tmp_path):
    v = next(v for v in gvariants.load(ROOT / "variants.yaml") if v.name == "llama3.2-1b_decode_b4_s4096_bf16")
    tf = tmp_path / "gpu.json"
    tf.write_text(json.dumps({v.name: {"overrides": {"GU_NWG": 8}}}))
    r = run_cli(["render", v.name, "--tuned-for", tf], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == grender.render(v, grender.plan(v, overrides={"GU_NWG": 8})) != grender.render(v)
    assert "note: tuned" in r.stderr and "GU_NWG" in r.stderr


def test_render_knobs_prints_the_plans_knobs(tmp_path):
    """render --knobs: one `KNOB value` line per tunable knob of the plan build would compile (a tuning entry's
    override shows), nothing else on stdout."""
    from generator.tune import knob_dict
    v = next(v for v in gvariants.load(ROOT / "variants.yaml") if v.name == "llama3.2-1b_decode_b4_s4096_bf16")
    tf = tmp_path / "gpu.json"
    tf.write_text(json.dumps({v.name: {"overrides": {"GU_NWG": 8}}}))
    r = run_cli(["render", v.name, "--tuned-for", tf, "--knobs"], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    want = knob_dict(grender.plan(v, overrides={"GU_NWG": 8}))
    assert r.stdout == "".join(f"{k} {val}\n" for k, val in want.items()) and "GU_NWG 8\n" in r.stdout


def test_render_unknown_name(tmp_path):
    r = run_cli(["render", "no-such-model_decode_b1_s1_bf16", "--variants", ROOT / "variants.yaml"], cwd=tmp_path)
    assert_bad_input(r, "no variant named 'no-such-model_decode_b1_s1_bf16'", "megakernel list")
    assert r.stdout == ""


# ---------------------------------------------------------------- report, clean

def test_report_before_any_build(tmp_path):
    r = run_cli(["report"], cwd=tmp_path)
    assert_bad_input(r, "nothing built yet", "(run `megakernel build`)", "and no variants.yaml here to build from")
    assert not (tmp_path / "build").exists()
    r = run_cli(["report", "--build-dir", "other"], cwd=tmp_path)
    assert_bad_input(r, "nothing built yet", "(run `megakernel build --build-dir other`)")
    (tmp_path / "mine.yaml").write_text((ROOT / "variants.yaml").read_text())
    r = run_cli(["report", "--build-dir", "other", "--variants", "mine.yaml"], cwd=tmp_path)
    assert_bad_input(r, "nothing built yet", "(run `megakernel build --variants mine.yaml --build-dir other`)")
    (tmp_path / "build").mkdir()
    r = run_cli(["report"], cwd=tmp_path)
    assert_bad_input(r, "nothing built yet")
    assert list((tmp_path / "build").iterdir()) == []


def test_report_of_a_previous_build(copy_build, tmp_path):
    d = copy_build(tmp_path / "build")
    (d / "report.json").unlink()
    (d / "report.csv").unlink()
    r = run_cli(["report", "--no-gpu"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for name in TINY_NAMES:
        assert name in r.stdout
    assert "2 distinct binaries" in r.stdout and "load time: no GPU" in r.stdout
    rep = json.loads((d / "report.json").read_text())
    assert {row["name"] for row in rep["rows"]} == set(TINY_NAMES)
    assert (d / "report.csv").read_text().startswith("name,status,cubin_bytes,")
    # without --no-gpu on a machine without one: the same, no load times
    r = run_cli(["report"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((d / "report.json").read_text())["totals"]["load_ms"] is None


def test_a_build_directory_the_file_system_refuses_is_one_line(copy_build, tmp_path):
    """A build directory that cannot be made (under a regular file; a read-only mount is the same OSError) is one
    `error:` line naming it, exit 2; `report` on a build whose report.json cannot be written (a read-only shared
    build) still shows the report, with one warning line."""
    (tmp_path / "file").write_text("")
    r = run_cli(ONE_SMALL + ["--build-dir", tmp_path / "file" / "b"], cwd=tmp_path)
    assert_bad_input(r, str(tmp_path / "file"))
    d = copy_build(tmp_path / "build")
    (d / "report.json").unlink()
    (d / "report.json").mkdir()  # os.replace onto it fails as onto a read-only file system
    r = run_cli(["report", "--no-gpu"], cwd=tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert all(name in r.stdout for name in TINY_NAMES)
    warn = [ln for ln in r.stderr.splitlines() if "report.json and report.csv not written" in ln]
    assert len(warn) == 1 and warn[0].startswith("warning: "), r.stderr


def test_generate_on_the_cpu_refuses_a_fused_variant_in_one_line(tmp_path):
    """`generate --device cpu --variant X`: the fused kernels run on CUDA only; one line says the CPU serves the
    unfused layers (a new user's trial: the message named a --device they had not given)."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4,
                                               "num_key_value_heads": 2, "intermediate_size": 512,
                                               "num_hidden_layers": 1, "vocab_size": 100}))
    assert_bad_input(run_cli(["generate", d, "--ids", "1,2", "--variant", "x", "--device", "cpu"], cwd=tmp_path),
                     "--variant: fused variants run on CUDA", "drop --variant")


def test_clean_that_the_file_system_refuses_names_the_build_directory(copy_build, tmp_path, monkeypatch):
    """Session 67's trial: `clean` of a build on a read-only file system said `error: kernel.cu: Read-only file
    system` (rmtree's name relative to its directory); it names the build directory."""
    import errno

    from click.testing import CliRunner

    from generator import cli as gcli
    copy_build(tmp_path / "build")

    def refused(path, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", "kernel.cu")
    monkeypatch.setattr(gcli.shutil, "rmtree", refused)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(gcli.main, ["clean"])
    assert r.exit_code == 2 and "error: build: could not remove all of it (Read-only file system: kernel.cu)" in r.output, \
        r.output


def test_clean(copy_build, tmp_path):
    copy_build(tmp_path / "build")
    r = run_cli(["clean"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "build").exists()
    r = run_cli(["clean"], cwd=tmp_path)  # nothing to clean: said, not an error
    assert r.returncode == 0 and r.stderr.strip() == "nothing to remove: build does not exist", r.stderr
    # a directory that is not a build is not removed
    other = tmp_path / "precious"
    other.mkdir()
    (other / "thesis.tex").write_text("do not delete")
    before = snapshot(other)
    r = run_cli(["clean", "--build-dir", other], cwd=tmp_path)
    assert_bad_input(r, "does not look like a megakernel build directory")
    assert snapshot(other) == before
    # a manifest.json of something else (a web app's) is not a build's: nothing removed
    (other / "manifest.json").write_text('{"name": "my-webapp"}')
    before = snapshot(other)
    r = run_cli(["clean", "--build-dir", other], cwd=tmp_path)
    assert_bad_input(r, "its manifest.json is not a megakernel build's")
    assert snapshot(other) == before
    # no manifest: a directory holding what only looks like a build's (reports, objects/ with a user's file, a
    # directory named like a variant) is not one
    for i, (rel, body) in enumerate((("report.csv", "my,data"), ("objects/thesis.tex", "mine"),
                                     ("photos_decode_b1_s2_x/a.jpg", "jpg"))):
        mine = tmp_path / f"mydata{i}"
        (mine / rel).parent.mkdir(parents=True, exist_ok=True)
        (mine / rel).write_text(body)
        before = snapshot(mine)
        assert_bad_input(run_cli(["clean", "--build-dir", mine], cwd=tmp_path),
                         "does not look like a megakernel build directory")
        assert snapshot(mine) == before
    # a build with a file of the user's in it: refused, naming it; the build's own temporary files are its own
    b = tmp_path / "b2"
    copy_build(b)
    (b / "notes.txt").write_text("mine")
    before = snapshot(b)
    r = run_cli(["clean", "--build-dir", b], cwd=tmp_path)
    assert_bad_input(r, "it holds notes.txt, which a build does not write")
    assert snapshot(b) == before
    (b / "notes.txt").unlink()
    # a user's hidden directory that merely looks temporary, a manifest of another tool's that has "variants" and
    # names the user's directory: not the build's
    (b / ".tmp").mkdir()
    r = run_cli(["clean", "--build-dir", b], cwd=tmp_path)
    assert_bad_input(r, "it holds .tmp, which a build does not write")
    (b / ".tmp").rmdir()
    # a build's file name on a user's directory (a trial's report.json/ holding a file): refused
    (b / "report.json").unlink(missing_ok=True)
    (b / "report.json").mkdir()
    (b / "report.json" / "x").write_text("precious")
    r = run_cli(["clean", "--build-dir", b], cwd=tmp_path)
    assert_bad_input(r, "it holds report.json, which a build does not write")
    shutil.rmtree(b / "report.json")
    real = (b / "manifest.json").read_text()
    (b / "manifest.json").write_text('{"variants": {"src": 1}}')
    (b / "src").mkdir()
    r = run_cli(["clean", "--build-dir", b], cwd=tmp_path)
    assert_bad_input(r, "its manifest.json is not a megakernel build's")
    (b / "src").rmdir()
    (b / "manifest.json").write_text(real)
    # a symbolic link to the build, the directory the command runs in, an empty --build-dir: refused, one line
    (tmp_path / "link").symlink_to(b)
    assert_bad_input(run_cli(["clean", "--build-dir", tmp_path / "link"], cwd=tmp_path), "a symbolic link")
    assert_bad_input(run_cli(["clean", "--build-dir", "."], cwd=b), "this command runs inside it")
    assert_bad_input(run_cli(["clean", "--build-dir", ".."], cwd=b / "objects"), "this command runs inside it")
    assert_bad_input(run_cli(["clean", "--build-dir", ""], cwd=tmp_path), "--build-dir: empty")
    assert (b / "manifest.json").exists() and (tmp_path / "link").is_symlink()
    # a build using it (its shared lock on .busy, held for the whole build; or an object's lock, as a compile holds
    # it, or the manifest's): refused, nothing removed
    import fcntl
    for lock, how in ((b / ".busy", fcntl.LOCK_SH), (next(b.glob("objects/*")) / ".lock", fcntl.LOCK_EX),
                      (b / ".lock", fcntl.LOCK_EX)):
        existed = lock.exists()
        with open(lock, "a") as f:
            fcntl.flock(f, how)
            before = snapshot(b)
            assert_bad_input(run_cli(["clean", "--build-dir", b], cwd=tmp_path), "a build is using it")
            assert snapshot(b) == before
        if not existed:
            lock.unlink()
    (b / ".manifest.json.123.tmp").write_text("")  # the build's own temporary file
    (b / "manifest.json").write_text("{corrupt")  # a corrupt manifest (its error says to clean): still the build's
    r = run_cli(["clean", "--build-dir", b], cwd=tmp_path)
    assert r.returncode == 0 and not b.exists(), r.stderr


# ---------------------------------------------------------------- entry point, README, CI

def test_console_script_and_help():
    exe = Path(sys.executable).parent / "megakernel"
    exe = str(exe) if exe.exists() else shutil.which("megakernel")
    assert exe, "the `megakernel` console script is not installed (pip install -e .)"
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, env=cli_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    for cmd in ("list", "render", "build", "report", "clean"):
        assert re.search(rf"^\s+{cmd}\s", r.stdout, re.M), f"{cmd} missing from --help"
    r = run_cli(["build", "--help"], cwd=ROOT)
    for opt in ("--variants", "--only", "--exclude", "--jobs", "--arch", "--strict", "--build-dir"):
        assert opt in r.stdout


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(?:bash|sh)?\n(.*?)\n```", section, re.S)


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    cmds = readme_commands()
    assert len(cmds) == 2, cmds
    main_cmd, test_cmd = cmds
    assert "\n" not in main_cmd and "\n" not in test_cmd
    assert "megakernel build" in main_cmd and "nvidia-smi" in main_cmd and "bench/gpu_check.py" in main_cmd
    assert "pytest" in test_cmd
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci, ".ci/run must run the README's test command"
    assert ci.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in ci
    assert (ROOT / ".ci" / "run").stat().st_mode & 0o111


@pytest.mark.parametrize("objects", [True, False, "foreign"])
@pytest.mark.parametrize("cmd", [["list"], ["report", "--no-gpu"], ["build", "--only", "qwen2.5-0.5b_decode_b1_s1024_bf16"]])
def test_corrupt_manifest_is_one_line_exit_2(cmd, objects, tmp_path):
    """The line's advice works: `clean` where it removes the directory (a build's objects/ beside the manifest),
    else removing the file by hand (clean refuses a directory not known to be a build's)."""
    d = tmp_path / "b"
    d.mkdir()
    (d / "manifest.json").write_text("{not json")
    if objects:
        (d / "objects").mkdir()
    if objects == "foreign":  # beside a build's objects/, a file a build does not write: clean refuses it
        (d / "mine.txt").write_text("x")
    r = run_cli(cmd + ["--build-dir", str(d)], cwd=ROOT)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in r.stderr
    if objects is True:
        assert f"`megakernel clean --build-dir {d}`" in lines[0]  # a bare `clean` would remove ./build instead
        assert run_cli(["clean", "--build-dir", str(d)], cwd=ROOT).returncode == 0 and not d.exists()
    else:
        assert lines[0].endswith("corrupt manifest (not the JSON a build writes); remove it and build again")
        assert run_cli(["clean", "--build-dir", str(d)], cwd=ROOT).returncode == 2  # (what clean says)


@pytest.mark.parametrize("entry", [None, "x", {"status": "ok", "resources": "x", "cubin": "a", "object": "o"},
                                   {"status": "ok", "resources": {}, "object": "o"}, {"resources": {}}])
def test_a_hand_damaged_manifest_entry_is_the_corrupt_manifest_line(entry, tmp_path):
    """An entry a hand edit broke (null, a string, resources not an object, an ok entry without its cubin, no status)
    is the corrupt-manifest line in `report` and `list`, not a traceback from deep inside the reader."""
    d = tmp_path / "b"
    (d / "objects").mkdir(parents=True)
    name = "qwen2.5-0.5b_decode_b1_s1024_bf16"
    (d / "manifest.json").write_text(json.dumps({"package_version": "0", "variants": {name: entry}}))
    for cmd in (["report", "--no-gpu"], ["list"]):
        r = run_cli(cmd + ["--build-dir", str(d)], cwd=ROOT)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "corrupt manifest" in lines[0], (cmd, r.stderr[-500:])


@pytest.mark.parametrize("args", [["build", "-j", "0"], ["build", "--nope"], ["nosuchcmd"], ["render"]])
def test_click_usage_errors_are_one_line(args):
    r = run_cli(args, cwd=ROOT)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), r.stderr


# ---------------------------------------------------------------- a new user's first hour

def run_cli_env(args, cwd, **env) -> subprocess.CompletedProcess:
    """run_cli with extra environment variables (None removes one)."""
    e = cli_env()
    for k, v in env.items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = str(v)
    return subprocess.run([sys.executable, "-m", "generator.cli", *map(str, args)], cwd=str(cwd), env=e,
                          capture_output=True, text=True, timeout=300)


ONE_SMALL = ["build", "--variants", ROOT / "variants.yaml", "--only", "qwen2.5-0.5b_decode_b1_s1024*"]


def test_broken_nvcc_env_is_one_line(tmp_path):
    r = run_cli_env(ONE_SMALL + ["--build-dir", tmp_path / "b"], tmp_path, NVCC=tmp_path / "no" / "nvcc")
    assert_bad_input(r, "NVCC=", "not an executable")
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'nvcc: broken install' >&2\nexit 1\n")
    fake.chmod(0o755)
    r = run_cli_env(ONE_SMALL + ["--build-dir", tmp_path / "b"], tmp_path, NVCC=fake)
    assert_bad_input(r, "nvcc --version", "broken install", "install the CUDA toolkit")
    r = run_cli_env(ONE_SMALL + ["--build-dir", tmp_path / "b"], tmp_path, NVCC="")
    assert_bad_input(r, "NVCC is set but empty")
    assert not (tmp_path / "b").exists()


def test_nvcc_given_as_a_command_line(tiny_build, copy_build, tmp_path):
    """NVCC="env /path/to/nvcc" (a wrapper, as "ccache nvcc"): the build runs it as CuPy does, split on spaces."""
    from generator import toolchain
    d = copy_build()
    r = run_cli_env(["build", "--variants", tiny_build["variants"], "--build-dir", d], tmp_path,
                    NVCC=f"env {toolchain.find_nvcc()}")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr


def test_build_dir_that_is_a_file_is_one_line(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    for args in (["list", "--build-dir", f], ONE_SMALL + ["--build-dir", f / "sub"], ["report", "--build-dir", f]):
        assert_bad_input(run_cli_env(args, tmp_path), "afile", "not a directory")
    assert f.read_text() == "x"


def _dying_nvcc(tmp_path, signal: int):
    """An NVCC that answers --version as the real one and dies by `signal` (nvcc's own message) when compiling."""
    from generator import toolchain
    fake = tmp_path / f"nvcc-sig{signal}"
    fake.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then exec {toolchain.find_nvcc()} --version; fi\n"
                    f"echo \"nvcc error   : 'ptxas' died due to signal {signal}\" >&2\nexit 1\n")
    fake.chmod(0o755)
    return fake


def test_an_interrupted_build_stops_and_records_nothing(tmp_path):
    """A compiler killed by SIGINT (Ctrl-C reaches nvcc too) stops the build: one line, exit 130, no manifest, no
    cubin, no object directory; a compiler that crashed (signal 11) is a compile error of its variant, recorded, exit 1."""
    d = tmp_path / "b"
    r = run_cli_env(ONE_SMALL + ["--build-dir", d, "-j", "1"], tmp_path, NVCC=_dying_nvcc(tmp_path, 2))
    assert r.returncode == 130, r.stderr
    assert r.stderr.startswith("error: interrupted") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (d / "manifest.json").exists() and not list(d.glob("*/kernel.cubin"))
    assert not list(d.glob("objects/*")), list(d.glob("objects/*/*"))  # the compile's object directory went too
    r = run_cli_env(ONE_SMALL + ["--build-dir", d], tmp_path, NVCC=_dying_nvcc(tmp_path, 11))
    assert r.returncode == 1 and "the compiler crashed (signal 11)" in r.stderr, r.stderr
    assert json.loads((d / "manifest.json").read_text())["variants"]
    assert gcompile.compiler_killed("nvcc error   : 'cicc' died due to signal 9 (Kill signal)").startswith(
        "the compiler was killed (signal 9)")
    assert gcompile.compiler_killed("kernel.cu(3): error: identifier \"x\" is undefined") is None
    assert gcompile.compiler_killed("'ptxas' died due to signal 15") == "interrupted"


def _alive(pid: int) -> bool:
    """The process runs (a zombie, exited and awaiting its reaper, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_sigterm_stops_the_compilers_and_leaves_no_temporary_files(tmp_path):
    """A SIGTERM to the build alone (not its process group, as Ctrl-C is): exit 130 with one line, the running
    compiler is sent the SIGINT Ctrl-C would have sent (not left running, orphaned), and the compilers' temporary
    files (the build's own directory under TMPDIR) are gone."""
    import signal
    from generator import toolchain
    fake = tmp_path / "nvcc-slow"
    fake.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then exec {toolchain.find_nvcc()} --version; fi\n"
                    f"touch \"$TMPDIR/compiling-$$\"\necho $$ > {tmp_path}/compiler.pid\nexec sleep 60\n")
    fake.chmod(0o755)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**cli_env(), "NVCC": str(fake), "TMPDIR": str(tmp)}
    p = subprocess.Popen([sys.executable, "-m", "generator.cli", *map(str, ONE_SMALL + ["--build-dir", tmp_path / "b",
                                                                                        "-j", "1"])],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (tmp_path / "compiler.pid").exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)
    time.sleep(0.2)  # (the pid written whole)
    assert (tmp_path / "compiler.pid").exists(), p.communicate()[1]
    pid = int((tmp_path / "compiler.pid").read_text())
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130 and err.startswith("error: interrupted (SIGTERM)"), err
    assert not _alive(pid) and list(tmp.iterdir()) == [] and not (tmp_path / "b" / "manifest.json").exists()
    assert not list((tmp_path / "b").glob("objects/*"))  # nor an object directory holding only its lock


def test_no_nvcc_is_one_line(tmp_path):
    """No nvcc anywhere: CuPy's search (PATH, CUDA_PATH, /usr/local/cuda) finds none. That search cannot be emptied
    from the environment on a machine with CUDA installed, so the subprocess stubs it and runs the real CLI."""
    code = ("import sys, cupy.cuda; cupy.cuda.get_nvcc_path = lambda: None; from generator import cli; "
            "sys.argv = ['megakernel', *sys.argv[1:]]; cli.run()")
    e = cli_env()
    e.pop("NVCC", None)
    e["PATH"] = "/usr/bin:/bin"
    r = subprocess.run([sys.executable, "-c", code, *map(str, ONE_SMALL), "--build-dir", str(tmp_path / "b")],
                       cwd=tmp_path, env=e, capture_output=True, text=True, timeout=300)
    assert_bad_input(r, "nvcc not found", "install the CUDA toolkit", "NVCC=")
    assert not (tmp_path / "b").exists()


def test_find_nvcc_here():
    from generator import toolchain
    path = toolchain.find_nvcc()
    assert "nvcc" in path


def test_report_without_cuda_says_one_line(copy_build, tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    copy_build(tmp_path / "build")
    r = run_cli(["report"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("note: no CUDA GPU") and "Traceback" not in r.stderr, r.stderr
    r = run_cli(["report", "--no-gpu"], cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def _fake_bench_rows(rows):
    for i, r in enumerate(rows):
        r.update(fused_us=123.4 + i, pct_bw=91.8, speedup_torch_graph=1.98, speedup_eager=7.9, speedup_compile=1.37,
                 speedup_best=1.37, best_baseline="compile", load_ms=1.23)
    return rows


LONG_NAMES = ["qwen2.5-0.5b_decode_b1_s32768_bf16", "llama3.2-1b_decode_b8_s32768_bf16"]


@pytest.mark.parametrize("width", [80, 120])
def test_report_table_fits_80_and_120_columns(tiny_build, width):
    from rich.console import Console
    from generator import report as greport
    rep = greport.build_report(tiny_build["dir"], gpu=False, write=False)
    rows = _fake_bench_rows(rep["rows"])
    long = [dict(rows[0], name=n) for n in LONG_NAMES]          # the default variants' longest names
    flagged = dict(rows[1], name="tiny-z_decode_b1_s64_bf16", flags="spills,smem>227KB")
    refused = {"name": "tiny-r_decode_b1_s64_bf16", "status": "refused", "flags": "refused", "error": "too big"}
    rows = rows + long + [flagged, refused]
    rep = {"rows": rows, "totals": greport.totals_of(rows, loads_measured=True)}
    con = Console(width=width, record=True, color_system=None)
    greport.print_report(rep, con)
    text = con.export_text()
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= width
    for r in rows:
        assert r["name"] in text
    for must in ("fused", "best", "flags", "123.4", "1.37", "spills, smem>227KB", "refused"):
        assert must in text, (must, text)
    # a legend line for each kind of flag shown, none for the others
    for must in ("spills: registers spilled", "smem>NKB: over the block's shared-memory limit", "refused: the planner"):
        assert must in " ".join(text.split()), (must, text)
    assert "L1<NKB:" not in text and "mem>NGB:" not in text
    if width == 120:
        for must in ("regs", "smem", "spill"):
            assert must in text, (must, text)
    wide = Console(width=width, record=True, color_system=None)
    greport.print_report(rep, wide, wide=True)
    wtext = wide.export_text()
    assert "…" not in wtext
    for must in ("PTX", "stack", "compile", "graph", "eager", "% of", "baseline", "L1"):
        assert must in wtext, must


def test_build_prints_progress_lines_when_stdout_is_not_a_tty(tiny_build, copy_build, tmp_path):
    d = copy_build()
    r = run_cli(["build", "--variants", tiny_build["variants"], "--build-dir", d], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # a copied build is up to date: one line per binary, naming its variants (tiny-a and tiny-b share one)
    progress = [ln for ln in r.stdout.splitlines() if ln.startswith(("compiled ", "up to date: "))]
    assert progress and f"({len(TINY_NAMES)}/{len(TINY_NAMES)} variants done" in progress[-1], r.stdout
    assert len(progress) == 2 and all(ln.startswith("up to date: ") for ln in progress), progress
    assert all(any(n in ln for ln in progress) for n in TINY_NAMES), progress


def test_build_footer_counts_the_selection(tiny_build, copy_build, tmp_path):
    d = copy_build()
    r = run_cli(["build", "--variants", tiny_build["variants"], "--build-dir", d, "--only", "tiny-a*"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "1/1 built, 1 distinct binary," in r.stdout, r.stdout
    assert TINY_NAMES[2] not in r.stdout
    rows = json.loads((d / "report.json").read_text())["rows"]  # report.json: every declared variant built
    assert {row["name"] for row in rows} == set(TINY_NAMES)


def test_report_considers_only_declared_variants(tiny_build, copy_build, tmp_path):
    """A refused entry whose variant was removed from the variants file no longer fails `report --strict`."""
    d = copy_build(tmp_path / "build")
    m = json.loads((d / "manifest.json").read_text())
    m["variants"]["gone_decode_b1_s64_bf16"] = {"name": "gone_decode_b1_s64_bf16", "status": "refused",
                                                "error": "gone_decode_b1_s64_bf16: shared memory over budget"}
    (d / "manifest.json").write_text(json.dumps(m))
    shutil.copy(tiny_build["variants"], tmp_path / "variants.yaml")
    r = run_cli(["report", "--no-gpu", "--strict"], cwd=tmp_path)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "gone_decode" not in r.stdout and f"{len(TINY_NAMES)}/{len(TINY_NAMES)} built" in r.stdout
    lines = [ln for ln in r.stderr.splitlines() if "not declared" in ln]
    assert len(lines) == 1 and "gone_decode_b1_s64_bf16" in lines[0] and "variants.yaml" in lines[0], r.stderr
    # a variants file declaring fewer: the footer counts what is shown
    text = (tmp_path / "variants.yaml").read_text()
    (tmp_path / "only_c.yaml").write_text(text.split("  tiny-a:")[0] + "  tiny-c:" + text.split("  tiny-c:")[1])
    r = run_cli(["report", "--no-gpu", "--variants", "only_c.yaml"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "1/1 built, 1 distinct binary," in r.stdout and TINY_NAMES[0] not in r.stdout, r.stdout
    rep = json.loads((d / "report.json").read_text())
    assert [row["name"] for row in rep["rows"]] == [TINY_NAMES[2]]
    assert rep["not_declared"] == sorted([TINY_NAMES[0], TINY_NAMES[1], "gone_decode_b1_s64_bf16"])
    # still declared and refused: flagged as before
    r = run_cli(["report", "--no-gpu", "--strict", "--variants", "nope.yaml"], cwd=tmp_path)
    assert_bad_input(r, "nope.yaml")


def test_version():
    from generator import __version__
    for flag in ("--version", "-V"):
        r = run_cli([flag], cwd=ROOT)
        assert r.returncode == 0 and r.stdout.strip() == f"megakernel {__version__}", (r.stdout, r.stderr)


def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)\n```", section, re.S)


def test_readme_python_example_compiles():
    blocks = readme_python_blocks()
    assert len(blocks) >= 1
    for src in blocks:
        compile(src, "README", "exec")
    first = blocks[0]
    for must in ("import torch", "import generator", "random_weights", "generator.load(", "variants.load("):
        assert must in first, must
    name = re.search(r'name = "([^"]+)"', first).group(1)
    assert name in DEFAULT_NAMES
    before = (ROOT / "README.md").read_text().split("\n## Python\n", 1)[1].split("```python")[0]
    globs = re.findall(r"megakernel build --only '([^']+)'", before)  # the build it needs is stated first
    assert any(fnmatch.fnmatchcase(name, g) for g in globs), before


@pytest.mark.gpu
def test_readme_python_example_runs(tmp_path):
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    src = readme_python_blocks()[0]
    name = re.search(r'name = "([^"]+)"', src).group(1)
    shutil.copy(ROOT / "variants.yaml", tmp_path / "variants.yaml")
    r = run_cli(["build", "--only", name], cwd=tmp_path, timeout=900)
    assert r.returncode == 0, r.stderr
    (tmp_path / "example.py").write_text(src)
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "torch.Size" in r.stdout and "bfloat16" in r.stdout


@pytest.mark.parametrize("cmd", ["bench", "tune"])
def test_delegated_commands_usage_errors_are_one_line(cmd, tmp_path):
    r = run_cli([cmd, "--bogus"], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith(f"error: megakernel {cmd}: No such option")
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    r = run_cli([cmd, "-h"], cwd=tmp_path)
    assert r.returncode == 0 and f"Usage: megakernel {cmd}" in r.stdout


def test_report_names_refusals_unbuilt_variants_and_a_missing_bench_dir(tiny_build, copy_build, tmp_path):
    """A refused variant's reason is one line (the table says only `refused`); a declared variant never built is
    named with the command that builds it; a --bench-dir that does not exist is an error, not silently empty."""
    d = copy_build(tmp_path / "build")
    m = json.loads((d / "manifest.json").read_text())
    e = m["variants"][TINY_NAMES[0]]  # as a build writes a refusal: the entry without its plan and object
    for k in ("key", "plan", "resources", "source", "cubin", "object", "source_sha256"):
        e.pop(k, None)
    e.update(status="refused", error=f"{TINY_NAMES[0]}: shared memory over budget")
    del m["variants"][TINY_NAMES[1]]
    (d / "manifest.json").write_text(json.dumps(m))
    shutil.copy(tiny_build["variants"], tmp_path / "variants.yaml")
    r = run_cli(["report", "--no-gpu"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"refused: {TINY_NAMES[0]}: shared memory over budget" in r.stderr.splitlines(), r.stderr
    assert any(ln.startswith("declared in variants.yaml, not built: " + TINY_NAMES[1]) and "megakernel build" in ln
               for ln in r.stderr.splitlines()), r.stderr
    assert json.loads((d / "report.json").read_text())["not_built"] == [TINY_NAMES[1]]
    assert_bad_input(run_cli(["report", "--no-gpu", "--bench-dir", "nowhere"], cwd=tmp_path), "--bench-dir nowhere")
    # many unbuilt (after an --only build): counted, the first few named, not a wall of names
    (tmp_path / "variants.yaml").write_text(Path(tiny_build["variants"]).read_text().replace(
        "models:", "models:\n  many: {hidden: 256, heads: 4, kv_heads: 2, head_dim: 64, intermediate: 512, layers: 1, "
        "norm: rmsnorm, norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, "
        "dtype: bf16, matrix: {mode: [decode], batch: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], seq_len: [64]}}", 1))
    r = run_cli(["report", "--no-gpu"], cwd=tmp_path)
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("declared in variants.yaml, not built: "))
    assert line.startswith("declared in variants.yaml, not built: 11 variants (") and "`megakernel list`" in line
    assert "many_decode_b10_" not in line, line


def test_render_says_when_the_build_compiled_a_replanned_plan(tiny_build, copy_build, tmp_path):
    d = copy_build(tmp_path / "build")
    m = json.loads((d / "manifest.json").read_text())
    m["variants"][TINY_NAMES[0]].update(plan_source="default (re-planned)",
                                        replanned={"overrides": {"X_FRAG": 0}, "default_spills": 8})
    (d / "manifest.json").write_text(json.dumps(m))
    shutil.copy(tiny_build["variants"], tmp_path / "variants.yaml")
    r = run_cli(["render", TINY_NAMES[0], "--no-tuned"], cwd=tmp_path)
    assert r.returncode == 0 and "extern \"C\" __global__" in r.stdout, r.stderr
    assert "re-planned this variant" in r.stderr and "X_FRAG=0" in r.stderr, r.stderr
    r = run_cli(["render", TINY_NAMES[2], "--no-tuned"], cwd=tmp_path)
    assert r.returncode == 0 and "re-planned" not in r.stderr


def test_build_counts_refusals_survives_a_closed_stdout_and_can_skip_the_table(tiny_variants_file, tmp_path):
    """A refused variant is a progress line of its own, so the count reaches every variant; `--no-report` leaves the
    table to `megakernel report`; a reader that closes the pipe (`| head -1`, also with stderr on it) does not stop the
    build or fail it."""
    text = Path(tiny_variants_file).read_text()
    big = ("  big:\n    {hidden: 8192, heads: 64, kv_heads: 8, head_dim: 128, intermediate: 28672, layers: 1, "
           "norm: rmsnorm,\n     norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, "
           "qk_norm: false, dtype: bf16,\n     matrix: {mode: [decode], batch: [256], seq_len: [64]}}\n")
    vfile = tmp_path / "v.yaml"
    vfile.write_text(text.split("  tiny-b:")[0] + big)
    args = ["-m", "generator.cli", "build", "--variants", str(vfile), "--build-dir", str(tmp_path / "b")]
    p = subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    first = p.stdout.readline()
    p.stdout.close()  # as `| head -1` does
    err = p.stderr.read()
    assert p.wait(timeout=600) == 0, err
    assert first.startswith("refused: big_decode_b256_s64_bf16 (1/2 variants done"), first
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())["variants"]
    assert m[TINY_NAMES[0]]["status"] == "ok" and m["big_decode_b256_s64_bf16"]["status"] == "refused"
    r = run_cli(["build", "--variants", vfile, "--build-dir", tmp_path / "b", "--no-report"], cwd=tmp_path)
    assert r.returncode == 0 and "up to date: " + TINY_NAMES[0] + " (2/2 variants done" in r.stdout, r.stdout
    assert "cost per variant" not in r.stdout and "1 distinct binary" in r.stderr
    # stdout and stderr one pipe (`2>&1 | head -1`): what comes after the reader left (the warnings, the summary, the
    # table) is dropped, the build still exits 0 with its report written (it exited 1 without writing it)
    shutil.rmtree(tmp_path / "b")
    p = subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    first = p.stdout.readline()
    p.stdout.close()
    assert p.wait(timeout=600) == 0 and first.startswith("refused: big_decode_b256_s64_bf16"), first
    assert (tmp_path / "b" / "report.json").is_file() and (tmp_path / "b" / "report.csv").is_file()


def test_a_build_refused_for_another_arch_leaves_the_good_build_and_report_suggests_the_arch(tmp_path):
    """A variant built for sm_90 and then refused for sm_86 (head_dim 128's prefill tiles over sm_86's shared memory)
    keeps its sm_90 entry (`list`: built; the manifest's arch stays 90): an attempt at another --arch does not damage
    the build directory; a directory built for sm_80 gets `report`'s suggested build command with `--arch 80`."""
    vfile = tmp_path / "v.yaml"
    vfile.write_text("models:\n  sm86:\n    {hidden: 256, heads: 4, kv_heads: 1, head_dim: 128, intermediate: 512, "
                     "layers: 1, norm: rmsnorm, norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, "
                     "qkv_bias: false, qk_norm: false, dtype: bf16,\n     matrix: [{mode: [prefill], batch: [1], "
                     "seq_len: [64]}, {mode: [decode], batch: [1], seq_len: [64]}]}\n")
    name = "sm86_prefill_b1_s64_bf16"
    b = tmp_path / "b"
    r = run_cli(["build", "--variants", vfile, "--build-dir", b, "--only", name, "--no-report"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    before = json.loads((b / "manifest.json").read_text())
    r = run_cli(["build", "--variants", vfile, "--build-dir", b, "--only", name, "--arch", "86"], cwd=tmp_path)
    assert r.returncode == 1 and f"refused {name}" in r.stderr and "over sm_86's limit" in r.stderr, r.stderr
    assert f"{name} (sm_90)" in r.stdout, r.stdout  # (the table shows the kept sm_90 row as such, not as sm_86's)
    after = json.loads((b / "manifest.json").read_text())
    assert after["arch"] == "90" and after["variants"][name] == before["variants"][name]
    r = run_cli(["list", "--variants", vfile, "--build-dir", b], cwd=tmp_path)
    assert re.search(rf"{name}.*built", r.stdout), r.stdout
    assert gcompile.hashlib.sha256((b / name / "kernel.cu").read_bytes()).hexdigest() == \
        before["variants"][name]["source_sha256"]  # its source as its cubin's, not the refused plan's
    # a build for sm_86 of both (the decode one fits): exit 0, but --strict counts the refusal the kept row hides
    r = run_cli(["build", "--variants", vfile, "--build-dir", b, "--arch", "86", "--no-report"], cwd=tmp_path)
    assert r.returncode == 0 and f"refused {name}" in r.stderr, r.stderr
    r = run_cli(["build", "--variants", vfile, "--build-dir", b, "--arch", "86", "--no-report", "--strict"],
                cwd=tmp_path)
    assert r.returncode == 1 and "1 refused for sm_86, an earlier build kept" in r.stderr, r.stderr
    # the directory now holds an sm_90 and an sm_86 kernel: `list` and `report` say which row is which
    r = run_cli(["list", "--variants", vfile, "--build-dir", b], cwd=tmp_path)
    assert re.search(rf"{name}.*built \(sm_90\)", r.stdout) and \
        re.search(r"sm86_decode_b1_s64_bf16.*built \(sm_86\)", r.stdout), r.stdout
    r = run_cli(["report", "--variants", vfile, "--build-dir", b, "--no-gpu", "--strict"], cwd=tmp_path)
    rows = {x["name"]: x for x in json.loads((b / "report.json").read_text())["rows"]}
    assert rows[name]["arch"] == "sm_90" and rows["sm86_decode_b1_s64_bf16"]["arch"] == "sm_86", rows
    assert "(sm_N): the architecture" in r.stdout, r.stdout
    assert r.returncode == 0, r.stdout + r.stderr  # two architectures are not a fault: --strict passes
    c = tmp_path / "c"
    r = run_cli(["build", "--variants", vfile, "--build-dir", c, "--only", "sm86_decode*", "--arch", "80",
                 "--no-report"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli(["report", "--variants", vfile, "--build-dir", c, "--no-gpu"], cwd=tmp_path)
    assert f"--build-dir {c} --arch 80`" in r.stderr + r.stdout, r.stderr + r.stdout
    assert "1/1 built for sm_80, " in r.stdout, r.stdout  # a directory of one other architecture names it
    # sm_100 and sm_100a are different objects: each labelled as built (it said sm_100 for both)
    r = run_cli(["build", "--variants", vfile, "--build-dir", c, "--only", "sm86_prefill*", "--arch", "100a",
                 "--no-report"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli(["list", "--variants", vfile, "--build-dir", c], cwd=tmp_path)
    assert re.search(r"sm86_prefill_b1_s64_bf16.*built \(sm_100a\)", r.stdout), r.stdout


def test_a_damaged_cubin_and_a_missing_tuning_dir_are_said(copy_build, tiny_build, tmp_path):
    """A cubin cut short (not the size compiled) is `cubin damaged` in `list` and flagged `cubin-damaged` in
    `report` (both said `built`); MEGAKERNEL_TUNING_DIR naming no directory is one warning where a tuning file is
    picked (every tuned plan was dropped unseen), none elsewhere; an on/off variable with a value that is neither
    is one error naming it."""
    b = copy_build(tmp_path / "build")
    doc = json.loads((b / "manifest.json").read_text())
    name, e = next((n, e) for n, e in sorted(doc["variants"].items()) if e["status"] == "ok")
    cubin = b / e["cubin"]
    data = cubin.read_bytes()
    cubin.unlink()  # (a hard link into objects/: a fresh file, so only this variant's cubin is cut)
    cubin.write_bytes(data[:1000])
    r = run_cli(["list", "--variants", tiny_build["variants"], "--build-dir", b, "--wide"], cwd=tmp_path)
    assert r.returncode == 0 and "cubin damaged" in next(ln for ln in r.stdout.splitlines() if name in ln), r.stdout
    r = run_cli(["report", "--variants", tiny_build["variants"], "--build-dir", b, "--no-gpu", "--wide"],
                cwd=tmp_path)
    assert "cubin-damaged" in next(ln for ln in r.stdout.splitlines() if name in ln), r.stdout
    r = run_cli_env(["render", name, "--variants", tiny_build["variants"], "--build-dir", b], tmp_path,
                    MEGAKERNEL_TUNING_DIR=str(tmp_path / "nope"))
    assert r.stderr.startswith(f"warning: MEGAKERNEL_TUNING_DIR={tmp_path / 'nope'}: not a directory") \
        and r.stderr.count("\n") == 1, r.stderr
    r = run_cli_env(["list", "--variants", tiny_build["variants"], "--build-dir", b], tmp_path,
                    MEGAKERNEL_TUNING_DIR=str(tmp_path / "nope"))
    assert r.returncode == 0 and "MEGAKERNEL_TUNING_DIR" not in r.stderr, r.stderr
    import os

    from generator import loader
    for raw, want in (("", True), ("off", False), ("0", False), ("No", False), ("1", True), ("yes", True)):
        os.environ["MEGAKERNEL_TEST_FLAG"] = raw
        try:
            assert loader.env_flag("MEGAKERNEL_TEST_FLAG", True) is want, raw
        finally:
            del os.environ["MEGAKERNEL_TEST_FLAG"]
    os.environ["MEGAKERNEL_TEST_FLAG"] = "maybe"
    try:
        with pytest.raises(loader.LoadError, match="^MEGAKERNEL_TEST_FLAG: 0/off/false/no or 1/on/true/yes, got "):
            loader.env_flag("MEGAKERNEL_TEST_FLAG", True)
    finally:
        del os.environ["MEGAKERNEL_TEST_FLAG"]


def test_render_says_when_the_build_compiled_another_plan(copy_build, tiny_build, tmp_path):
    """A build made with --tuned-for FILE compiled another plan than a plain `render` prints: a note says which
    file, and where the compiled source is; with the same --tuned-for no such note; a default-plan build against a
    tuned render: the note says the default plan."""
    b = copy_build(tmp_path / "build")
    name = next(n for n, e in sorted(json.loads((b / "manifest.json").read_text())["variants"].items())
                if e["status"] == "ok" and "_decode_" in n)
    tfile = tmp_path / "t.json"
    tfile.write_text(json.dumps({name: {"overrides": {"GU_NWG": 4}}}))
    r = run_cli(["build", "--variants", tiny_build["variants"], "--build-dir", b, "--only", name, "--tuned-for",
                 tfile, "--no-report"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli(["render", name, "--variants", tiny_build["variants"], "--build-dir", b], cwd=tmp_path)
    assert r.returncode == 0 and f"note: {b / name / 'kernel.cu'} was compiled from another plan (tuning file " \
        f"{tfile})" in r.stderr, r.stderr
    # --knobs prints the plan's knobs: the same note (the built plan is not these knobs)
    r = run_cli(["render", name, "--variants", tiny_build["variants"], "--build-dir", b, "--knobs"], cwd=tmp_path)
    assert r.returncode == 0 and "was compiled from another plan" in r.stderr and "GU_NWG " in r.stdout, r.stderr
    r = run_cli(["render", name, "--variants", tiny_build["variants"], "--build-dir", b, "--tuned-for", tfile],
                cwd=tmp_path)
    assert r.returncode == 0 and "another plan" not in r.stderr and r.stdout == (b / name / "kernel.cu").read_text()
    # the default plan built, another rendered: the note says the default plan (not the tuning file it consulted)
    r = run_cli(["build", "--variants", tiny_build["variants"], "--build-dir", b, "--only", name, "--no-tuned",
                 "--no-report"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli(["render", name, "--variants", tiny_build["variants"], "--build-dir", b, "--tuned-for", tfile],
                cwd=tmp_path)
    assert r.returncode == 0 and "was compiled from another plan (the default plan): " in r.stderr, r.stderr
