"""The `megakernel` command line as a user runs it (a subprocess): bad input is one `error:` line on stderr, exit 2,
no traceback, and build/ left exactly as it was; the other commands do what they say."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from generator import render as grender, variants as gvariants

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
    assert_bad_input(r, "nope.yaml", "cannot read variants file")
    assert snapshot(workdir / "build") == before


def test_bad_arch(workdir):
    (workdir / "variants.yaml").write_text(GOOD_TEXT)
    before = snapshot(workdir / "build")
    r = run_cli(["build", "--arch", "abc"], cwd=workdir)
    assert_bad_input(r, "--arch", "'abc'")
    assert snapshot(workdir / "build") == before


def test_only_matching_nothing(workdir):
    (workdir / "variants.yaml").write_text(GOOD_TEXT)
    before = snapshot(workdir / "build")
    r = run_cli(["build", "--only", "nothing*"], cwd=workdir)
    assert_bad_input(r, "no variant matches", "nothing*")
    r = run_cli(["build", "--exclude", "*"], cwd=workdir)
    assert_bad_input(r, "no variant matches", "--exclude *")
    r = run_cli(["list", "--only", "nothing*"], cwd=workdir)
    assert_bad_input(r, "no variant matches")
    assert snapshot(workdir / "build") == before


# ---------------------------------------------------------------- list, render

def test_list_default_variants(tmp_path):
    r = run_cli(["list", "--variants", ROOT / "variants.yaml"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "build").exists()
    for name in DEFAULT_NAMES:
        assert name in r.stdout
    assert len(DEFAULT_NAMES) == 45


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
    r = run_cli(["list", "--variants", tiny_build["variants"], "--build-dir", tmp_path / "none"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert build_status(r.stdout) == {n: "not built" for n in TINY_NAMES}, r.stdout
    assert not (tmp_path / "none").exists()


def test_render_prints_the_cuda_source():
    name = "llama3.2-1b_decode_b1_s4096_bf16"
    r = run_cli(["render", name], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "decoder_layer" in r.stdout and 'extern "C" __global__' in r.stdout
    assert re.search(r"\bHIDDEN\s*=\s*2048\b", r.stdout) and re.search(r"\bSEQ_LEN\s*=\s*4096\b", r.stdout)
    v = next(v for v in gvariants.load(ROOT / "variants.yaml") if v.name == name)
    assert r.stdout == grender.render(v)
    assert r.stderr == ""


def test_render_unknown_name(tmp_path):
    r = run_cli(["render", "no-such-model_decode_b1_s1_bf16", "--variants", ROOT / "variants.yaml"], cwd=tmp_path)
    assert_bad_input(r, "no variant named 'no-such-model_decode_b1_s1_bf16'", "megakernel list")
    assert r.stdout == ""


# ---------------------------------------------------------------- report, clean

def test_report_before_any_build(tmp_path):
    r = run_cli(["report"], cwd=tmp_path)
    assert_bad_input(r, "nothing built yet", "megakernel build")
    assert not (tmp_path / "build").exists()
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


def test_clean(copy_build, tmp_path):
    copy_build(tmp_path / "build")
    r = run_cli(["clean"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "build").exists()
    r = run_cli(["clean"], cwd=tmp_path)  # nothing to clean
    assert r.returncode == 0, r.stderr
    # a directory that is not a build is not removed
    other = tmp_path / "precious"
    other.mkdir()
    (other / "thesis.tex").write_text("do not delete")
    before = snapshot(other)
    r = run_cli(["clean", "--build-dir", other], cwd=tmp_path)
    assert_bad_input(r, "does not look like a megakernel build directory")
    assert snapshot(other) == before


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


@pytest.mark.parametrize("cmd", [["list"], ["report", "--no-gpu"], ["build", "--only", "qwen2.5-0.5b_decode_b1_s1024_bf16"]])
def test_corrupt_manifest_is_one_line_exit_2(cmd, tmp_path):
    d = tmp_path / "b"
    d.mkdir()
    (d / "manifest.json").write_text("{not json")
    r = run_cli(cmd + ["--build-dir", str(d)], cwd=ROOT)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [["build", "-j", "0"], ["build", "--nope"], ["nosuchcmd"], ["render"]])
def test_click_usage_errors_are_one_line(args):
    r = run_cli(args, cwd=ROOT)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), r.stderr
