"""The benchmark and device-check scripts (README.md, Benchmarks: which does what)."""
from __future__ import annotations

import argparse
import sys

HELP = {"help_option_names": ["-h", "--help"]}  # click's context settings: -h as megakernel's commands take it


def fail(msg: str) -> None:
    """Bad input or a missing GPU: one `error: msg` line on stderr and exit 2, as `megakernel` and gpu_check.py give
    it (a plan that fails to build or verify exits 1)."""
    sys.stderr.write(f"error: {msg}\n")
    sys.exit(2)


def find_decode(name: str, extra: list[str], flag: str):
    """(variant, overrides, source) for the decode variant `name` of one GPU declared in variants.yaml,
    bench/heldout.yaml or the `extra` variants files, with the overrides of the plan `megakernel build` gives it
    (its tuned plan where tuning/ holds one, as build picks the file; source "default" or "tuned (<file>)"). Exits
    with one `error:` line naming `flag` where there is no such variant or a file is bad; a tuning warning goes to
    stderr."""
    from pathlib import Path

    from generator import tune as gtune, variants as gvariants
    root = Path(__file__).resolve().parent.parent
    files = [root / "variants.yaml", root / "bench" / "heldout.yaml", *map(Path, extra)]
    declared = {}
    for f in files:
        try:
            declared.update({v.name: v for v in gvariants.load(f)})
        except gvariants.VariantError as exc:
            fail(str(exc))
    v = declared.get(name)
    if v is None:
        fail(f"{flag} {name}: no variant of that name in {', '.join(map(str, files))}")
    if v.mode != "decode" or v.tp > 1:
        what = f"a {v.mode} variant" if v.mode != "decode" else f"a tensor-parallel variant (tp {v.tp})"
        fail(f"{flag} {name}: {what}; this script times decode variants of one GPU")
    base, source, _, warn = gtune.resolve(v, "90", gtune.default_tuning_file())
    if warn:
        print(warn, file=sys.stderr)
    return v, base, source


def build_plans(pairs: list, build_dir: str) -> list[dict]:
    """Compile [(variant, overrides)] into `build_dir` (generator.compile.build, in parallel, no re-plan of spills:
    the plans as given); returns the build's entries. Exits with one `error:` line where `build_dir` is not a
    directory or no usable nvcc is found (generator.toolchain)."""
    import os
    from pathlib import Path

    from generator import compile as gcompile
    from generator.toolchain import ToolchainError, find_nvcc
    if Path(build_dir).exists() and not Path(build_dir).is_dir():
        fail(f"--build-dir {build_dir}: exists and is not a directory")
    try:
        find_nvcc()
    except ToolchainError as exc:
        fail(str(exc))
    return gcompile.build([c for c, _ in pairs], build_dir, jobs=os.cpu_count(),
                          overrides={c.name: ov for c, ov in pairs}, replan_spills=False)["entries"]


def run_click(command) -> None:
    """Run a click command as a script's entry: a usage error (an unknown option, a bad value) is one `error:` line
    and exit 2, as `megakernel`'s commands give it (click's own is a usage block)."""
    import click
    try:
        rv = command(standalone_mode=False)
    except click.UsageError as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)


class ScriptParser(argparse.ArgumentParser):
    """argparse for the scripts that take no click: a usage error is one `error:` line and exit 2, as `megakernel`'s
    commands give it (argparse's own is a usage block)."""

    def error(self, message):
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)
