"""`megakernel` command line: a thin shell over the library. Bad input: one line on stderr, exit 2."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import time
import warnings
from pathlib import Path

import click
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import __version__, compile as gcompile, manifest as gmanifest, report as greport, toolchain
from . import variants as gvariants
from .render import PlanError, plan, render
from .targets import DEFAULT_ARCH, TargetError, arch as get_arch


def console_width(stream, piped: int = 240) -> int | None:
    """A rich Console's width for `stream`: the terminal's (None: rich asks it, or reads COLUMNS where that is a
    positive number), else `piped`: a pipe or CI log is not a terminal, and rich would squeeze the tables into 80 columns."""
    cols = os.environ.get("COLUMNS", "").strip()
    return None if stream.isatty() or cols.isdigit() and int(cols) > 0 else piped


console = Console(width=console_width(sys.stdout))
err_console = Console(stderr=True, width=console_width(sys.stderr))


class _PipeSafe:
    """sys.stdout / sys.stderr while a command runs: once the reader of a pipe goes away (`| head`), the stream's
    file descriptor is pointed at /dev/null and the write is dropped instead of raising BrokenPipeError, so the
    command finishes its work and its files (a build's report included) and exits with its own status."""

    def __init__(self, stream):
        self._stream = stream

    def _gone(self) -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._stream.fileno())
        os.close(null)

    def write(self, s: str) -> int:
        try:
            return self._stream.write(s)
        except BrokenPipeError:
            self._gone()
            return len(s)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self._stream, name)


def fail(msg: str, code: int = 2):
    import os
    rank = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ \
        else ""  # under torchrun every process says its own error
    err_console.print(f"error: {rank}{msg}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(code)


def build_report_warned(build_dir, **kw) -> dict:
    """greport.build_report with its warnings (report.json not written, a results file skipped) as one `warning:`
    line each, said once (a results file is read once per architecture)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rep = greport.build_report(build_dir, **kw)
    for msg in dict.fromkeys(str(w.message) for w in caught):
        err_console.print(f"warning: {msg}", markup=False, highlight=False, soft_wrap=True)
    return rep


def load_all(variants_file: str) -> list:
    """Every variant the file declares (a bad file: one `error:` line, exit 2)."""
    try:
        return gvariants.load(variants_file)
    except gvariants.VariantError as exc:
        fail(str(exc))


def load_selected(variants_file: str, only=(), exclude=(), vs: list | None = None) -> list:
    """The variants --only / --exclude select from the file's (`vs`: those already read from it)."""
    vs = load_all(variants_file) if vs is None else vs
    selected = gvariants.select(vs, tuple(only), tuple(exclude))
    if not selected:
        kept = gvariants.select(vs, tuple(only), ()) if exclude else []
        if kept:  # --only (or every variant) matched: --exclude took them all
            fail(f"{variants_file}: --exclude {' '.join(exclude)} leaves no variant (it excludes all "
                 f"{len(kept)}{' that --only ' + ' '.join(only) + ' selects' if only else ''})")
        fail(f"{variants_file}: no variant matches"
             + (f" --only {' '.join(only)}" if only else "") + (f" --exclude {' '.join(exclude)}" if exclude else ""))
    unmatched = [g for g in only if not gvariants.select(vs, (g,))]
    if unmatched:  # one of several globs matches nothing: likely a typo, said rather than silently dropped
        err_console.print(f"warning: {variants_file}: --only {' '.join(unmatched)} matches no variant", markup=False,
                          highlight=False, soft_wrap=True)
    # (an --exclude that matches nothing excludes nothing: likely a typo too)
    if unmatched := [g for g in exclude if not gvariants.select(vs, (g,))]:
        err_console.print(f"warning: {variants_file}: --exclude {' '.join(unmatched)} matches no variant",
                          markup=False, highlight=False, soft_wrap=True)
    return selected


variants_opt = click.option("--variants", "variants_file", default="variants.yaml", show_default=True,
                            help="variants file")
def _a_directory(ctx, param, value):
    """--build-dir: refused in one line where it is empty, or it or a folder above it exists as something else than a
    folder."""
    if not str(value).strip():
        fail("--build-dir: empty (give a directory; '.' for this one)")
    for p in (Path(value), *Path(value).parents):
        if p.exists():
            if not p.is_dir():
                raise click.BadParameter(f"{p}: exists and is not a directory")
            break
    return value


build_dir_opt = click.option("--build-dir", default="build", show_default=True, help="build directory",
                             callback=_a_directory)


def tuned_opts(f):
    """--tuned-for / --no-tuned: which tuning file's plans (pick_tuning_file)."""
    f = click.option("--no-tuned", is_flag=True, help="default plans for every variant, whatever tuning/ holds")(f)
    return click.option("--tuned-for", "tuned_for", default=None, metavar="GPU",
                        help="use the tuned plans of tuning/GPU.json (a GPU slug, e.g. nvidia-h200, or a .json "
                             "path) [the only file in tuning/, if exactly one]")(f)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="megakernel", message="%(prog)s %(version)s")
def main():
    """Fused decoder-layer kernel generator: one CUDA kernel per layer shape, built ahead of time."""


@main.command("list")
@variants_opt
@build_dir_opt
@click.option("--only", multiple=True, help="glob over variant names (repeatable)")
@click.option("--wide", is_flag=True, help="every column, however narrow the terminal")
def list_cmd(variants_file, build_dir, only, wide):
    """List the declared variants and their build status."""
    vs = load_selected(variants_file, only)
    built = gcompile.read_manifest(Path(build_dir))["variants"]
    digest = gmanifest.kernel_sources_digest()
    # builds for two architectures in the directory: each row says its own
    archs = {str(e.get("arch", DEFAULT_ARCH)) for e in built.values() if e.get("status") == "ok"}  # (100 != 100a)
    rows = []
    for v in vs:
        m, e = v.model, built.get(v.name)
        status = gmanifest.status(e, v, digest)
        if status == "built" and (bad := gmanifest.cubin_problem(e, build_dir)):
            status = f"cubin {bad}"  # `megakernel build` writes it again
        elif status == "built" and e.get("plan_source") == "override":
            status = "built (plan override)"  # the tuner's candidates: not the plan `megakernel build` takes
        if e and e.get("status") == "ok" and len(archs) > 1:
            status += f" (sm_{e.get('arch', DEFAULT_ARCH)})"
        rows.append((v.name, v.mode, str(m.hidden), f"{m.heads}/{m.kv_heads}", str(m.head_dim), str(m.intermediate),
                     str(v.batch), str(v.seq_len), str(v.tp), status))

    def table(cols):
        t = Table(header_style="bold")
        for _, head, i in cols:
            t.add_column(head, no_wrap=True)
        for r in rows:
            t.add_row(*(r[i] for _, _, i in cols))
        return t
    cols = [(h, h, i) for i, h in enumerate(LIST_COLUMNS)]
    greport.print_fitted(console, table, cols, LIST_DROP_ORDER, wide)


# `list`'s columns, and those dropped first to last where the terminal is too narrow (variant and build stay: a name
# cut to "llam…" says nothing, and the name holds the batch and seq_len)
LIST_COLUMNS = ("variant", "mode", "hidden", "heads/kv", "head_dim", "inter", "batch", "seq_len", "GPUs", "build")
LIST_DROP_ORDER = ["inter", "head_dim", "heads/kv", "hidden", "GPUs", "mode", "batch", "seq_len"]


def variants_flag(variants_file) -> str:
    """` --variants FILE` (shell-quoted) for a command this one suggests, where the user's file is not the default."""
    return f" --variants {shlex.quote(str(variants_file))}" if str(variants_file) != "variants.yaml" else ""


@main.command("render")
@click.argument("name")
@variants_opt
@click.option("--arch", default="90", show_default=True, help="SM architecture, digits (90 = sm_90)")
@build_dir_opt
@tuned_opts
@click.option("--knobs", "knobs_only", is_flag=True, help="print the plan's knobs (one `KNOB value` a line: what "
              "a tuning entry records and may override; README: the knobs), not the source")
def render_cmd(name, variants_file, arch, build_dir, tuned_for, no_tuned, knobs_only):
    """Print the rendered CUDA source of one variant, with the plan `build` would compile (tuned where tuning/ has
    it: a note on stderr says so; where the build directory holds a build that re-planned its spilling default, a
    note says where that source is); with --knobs, that plan's knobs instead."""
    from . import tune as gtune
    try:
        get_arch(arch)
    except TargetError as exc:
        fail(str(exc))
    tfile = pick_tuning_file(tuned_for, no_tuned)
    vs = {v.name: v for v in load_selected(variants_file)}
    if name not in vs:
        fail(f"{variants_file}: no variant named '{name}' (see `megakernel list{variants_flag(variants_file)}`)")
    v = vs[name]
    ov, source, _, warning = gtune.resolve(v, arch, tfile)
    knobs = " ".join(f"{k}={val}" for k, val in sorted(ov.items()))  # as the report's plan column writes them
    tuned = [f"note: {source} plan: {knobs}"] if source != "default" else []  # (the default's own: "default")
    try:  # a build of it that re-planned this plan (it spilled): what it compiled is not what is printed here
        built = gmanifest.read_manifest(Path(build_dir))["variants"].get(name) or {}
    except (OSError, ValueError):
        built = {}
    replanned = source == "default" and built.get("plan_source") == "default (re-planned)"
    if replanned:
        rp = " ".join(f"{k}={val}" for k, val in sorted((built.get("replanned") or {}).get("overrides", {}).items()))
        tuned.append(f"note: `megakernel build` re-planned this variant (its default plan spilled): it compiled "
                     f"{Path(build_dir) / name / 'kernel.cu'} ({rp}), not the default plan printed here")
    for note in ([warning] if warning else []) + tuned:
        err_console.print(note, markup=False, highlight=False, soft_wrap=True)
    try:
        p = plan(v, arch, overrides=ov or None)
    except PlanError as exc:
        # a current build of it from a tuning file other than the one read here: name that file
        def same_arch(a) -> bool:
            try:
                return get_arch(str(a)).number == get_arch(arch).number
            except TargetError:
                return False
        used = (built.get("tuning") or {}).get("file") if built.get("status") == "ok" and str(
            built.get("plan_source", "")).startswith("tuned") and same_arch(built.get("arch")) and built.get(
            "identity") == gmanifest.identity(v.params(), str(built.get("arch"))) else None
        shown = str(gmanifest.tuning_path(used)) if used else ""
        if used and (tfile is None or Path(shown).resolve() != Path(tfile).resolve()):
            fail(f"{exc} (its build in {Path(build_dir) / name} used the overrides of {shown}: --tuned-for "
                 f"{shlex.quote(shown)} renders that plan)")
        fail(str(exc))
    src = render(v, p)
    # a current build of it (not stale: `list` says that) whose source is not this one: compiled from another plan
    if not replanned and built.get("status") == "ok" and str(built.get("arch", arch)) == str(arch) \
            and gmanifest.status(built, v, gmanifest.kernel_sources_digest()) == "built" \
            and built.get("source_sha256") != hashlib.sha256(src.encode()).hexdigest():
        # (the tuning file only where the build took its plan from it: e.g. a build made with --tuned-for FILE)
        used = (built.get("tuning") or {}).get("file") if str(built.get("plan_source", "")).startswith("tuned") \
            else None
        err_console.print(f"note: {Path(build_dir) / name / 'kernel.cu'} was compiled from another plan"
                          + (f" (tuning file {used})" if used else " (the default plan)")
                          + ": printed here is the plan a build now takes",
                          markup=False, highlight=False, soft_wrap=True)
    if knobs_only:
        click.echo("".join(f"{k} {val}\n" for k, val in gtune.knob_dict(p).items()), nl=False)
        return
    click.echo(src, nl=False)


@main.command("build")
@variants_opt
@build_dir_opt
@click.option("--only", multiple=True, help="glob over variant names (repeatable)")
@click.option("--exclude", multiple=True, help="glob over variant names to skip (repeatable)")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None, help="parallel compiles [all cores]")
@click.option("--arch", default="90", show_default=True, help="SM architecture, digits (90 = sm_90)")
@click.option("--strict", is_flag=True, help="exit 1 if any variant is flagged (the report's flags column: "
                                             "spills, refused, over budget, L1<60KB, memory, an unused tuned plan; "
                                             "README: the flags) or the tuning file gave a warning")
@click.option("--no-report", is_flag=True, help="print no report table (`megakernel report` prints it, with the "
                                                "benchmark's columns)")
@tuned_opts
def build_cmd(variants_file, build_dir, only, exclude, jobs, arch, strict, no_report, tuned_for, no_tuned):
    """Render and compile the variants, then print the resource report."""
    try:
        get_arch(arch)
    except TargetError as exc:
        fail(str(exc))
    tfile = pick_tuning_file(tuned_for, no_tuned)
    everything = load_all(variants_file)  # (read once: the file may change, or be a pipe, while the build runs)
    vs = load_selected(variants_file, only, exclude, everything)
    bd = Path(build_dir)
    try:  # a directory of other files (a model's, a source tree) is not turned into a build; one that lost its
        # manifest (deleted, or an interrupted first build) holds only what a build writes and is built again
        if bd.is_dir() and not (bd / gmanifest.MANIFEST).exists() and (foreign := gmanifest.foreign_entries(bd)):
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            fail(f"--build-dir {build_dir}: not a megakernel build directory (no manifest.json, and it holds {shown}, "
                 "which a build does not write); give a new or empty directory, or a build's")
    except OSError:
        pass  # (unreadable: the build says so below)
    try:
        toolchain.find_nvcc()  # no nvcc, or a broken NVCC=: one line now, not a traceback from inside CuPy
    except toolchain.ToolchainError as exc:
        fail(str(exc))
    jobs = jobs or os.cpu_count() or 1
    import signal
    import tempfile

    # the compilers' temporary files (CuPy's directory a compile, nvcc's own) in one directory of this build's,
    # removed when it ends, interrupted too
    try:
        scratch = tempfile.mkdtemp(prefix="megakernel-build-")
    except OSError as exc:
        fail(f"cannot make a temporary directory for the compilers ({exc}); set TMPDIR to a writable directory")
    tmpdir_was, tempdir_was = os.environ.get("TMPDIR"), tempfile.tempdir
    tempfile.tempdir, os.environ["TMPDIR"] = scratch, scratch
    signalled: set[tuple[int, int]] = set()  # (pid, signal) sent

    def stop_compilers(sig) -> list[int]:
        """Send `sig` to this build's compilers (its descendant processes) not sent it yet; returns those left."""
        left = toolchain.descendants(os.getpid())
        for pid in left:
            if (pid, sig) not in signalled:
                signalled.add((pid, sig))
                try:
                    os.kill(pid, sig)
                except OSError:  # gone already, or not ours to signal
                    pass
        return left

    def terminated(signum, frame):
        # Ctrl-C reaches the compilers through the terminal's process group; a SIGTERM to this process alone is
        # passed on to them here as the SIGINT Ctrl-C sends, so none runs on orphaned
        stop_compilers(signal.SIGINT)
        raise KeyboardInterrupt("SIGTERM")
    sigterm_was = signal.signal(signal.SIGTERM, terminated)  # a SIGTERM stops the build the way Ctrl-C does

    def note(line: str) -> None:  # a phase of the build the progress count does not show (re-planning)
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)
        sys.stderr.flush()
    try:
        if sys.stdout.isatty():
            with Progress(TextColumn("compiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=err_console, transient=True) as bar:
                task = bar.add_task("build", total=len(vs))
                result = gcompile.build(vs, build_dir, jobs=jobs, arch=arch,
                                        progress=lambda n, ok, **_: bar.advance(task, n),
                                        variants_file=variants_file, tuning_file=tfile, notify=note)
        else:  # a log file or a pipe: one plain line per finished object (the variants that share it), flushed
            done, t0 = [0], time.perf_counter()

            def progress(n, ok, names=(), cached=False, refused=False):
                done[0] += n
                # ("compiled": the build is recorded (sources, cubins, manifest) only once every object is done)
                what = "refused:" if refused else "up to date:" if cached else "compiled" if ok else "failed to compile"
                shown = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
                # (a closed stdout, `| head`, does not stop the build: run() makes its writes no-ops)
                click.echo(f"{what} {shown or greport.counted(n, 'variant')} ({done[0]}/{len(vs)} variants "
                           f"done, {time.perf_counter() - t0:.0f} s)")
                sys.stdout.flush()
            result = gcompile.build(vs, build_dir, jobs=jobs, arch=arch, progress=progress,
                                    variants_file=variants_file, tuning_file=tfile, notify=note)
    except KeyboardInterrupt as exc:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C or SIGTERM: this one is already stopping
            signal.signal(sig, signal.SIG_IGN)
        why = f" ({exc})" if str(exc) else ""
        again = shlex.join(["megakernel", *sys.argv[1:]])  # the same build: its --variants, --build-dir, --only
        if isinstance(exc, gcompile.RecordedInterrupt):  # (it came while the results were written: held off)
            shown = "megakernel report" + variants_flag(variants_file) + gmanifest.build_dir_flag(build_dir)
            err_console.print(f"error: interrupted{why} as the build recorded its results: they are recorded whole "
                              f"(the manifest, every source and cubin written); `{shown}` shows them, each variant's "
                              "error among them", markup=False, highlight=False, soft_wrap=True)
        else:
            err_console.print(f"error: interrupted{why}: nothing recorded (the manifest and every variant's cubin are "
                              f"as before); the objects already compiled are kept, so `{again}` again reuses them",
                              markup=False, highlight=False, soft_wrap=True)
        sys.stdout.flush()
        sys.stderr.flush()
        # now: a normal exit would wait for the compile a worker thread is running (and let it write its object);
        # the build has written nothing that needs closing (every file is written whole or not at all). The
        # compilers were interrupted (Ctrl-C, or the SIGINT above): each one a worker starts meanwhile is too, one
        # still running after 3 s is killed, and then their temporary files go
        deadline = time.monotonic() + 3
        while stop_compilers(signal.SIGINT) and time.monotonic() < deadline:
            time.sleep(0.05)
        if stop_compilers(signal.SIGKILL):
            time.sleep(0.1)
        shutil.rmtree(scratch, ignore_errors=True)
        os._exit(130)
    finally:
        signal.signal(signal.SIGTERM, sigterm_was)
        tempfile.tempdir = tempdir_was
        if tmpdir_was is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = tmpdir_was
        shutil.rmtree(scratch, ignore_errors=True)
    for w in result.get("warnings", []) + result.get("replans", []):
        err_console.print(w, markup=False, highlight=False, soft_wrap=True)
    declared = {v.name for v in everything}  # report.json: every declared variant built so far
    if tfile is not None and tuned_for:  # a file asked for by name: entries that match no declared variant are typos
        from . import tune as gtune
        unknown = sorted(set(gtune.read_tuning(Path(tfile))) - declared)
        if unknown:
            err_console.print(f"warning: {gtune.display(Path(tfile))}: no declared variant named "
                              f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''} (entries unused)",
                              markup=False, highlight=False, soft_wrap=True)
        # entries tuned on another architecture's GPU are not this build's plans (gtune.resolve): said, once
        doc = gtune.read_tuning(Path(tfile))
        other = sorted({str(doc[v.name]["gpu"]) for v in vs if gtune.tuned_on_other_arch(doc.get(v.name), v, arch)})
        if other:
            err_console.print(f"note: {gtune.display(Path(tfile))}: its entries tuned on {', '.join(other)} (another "
                              f"architecture than sm_{get_arch(arch).sm}) are not used for this build (--arch builds "
                              "for theirs)", markup=False, highlight=False, soft_wrap=True)
    built = [e for e in result["entries"] if e["status"] == "ok"]
    compiled = {e["key"] for e in built if not e["resources"]["cached"]}
    fresh = sum(1 for e in built if e["resources"]["cached"])
    failed = f", {len(result['errors'])} failed to compile" if result["errors"] else ""
    refused = sum(1 for e in result["entries"] if e["status"] == "refused")
    failed += f", {refused} refused (below)" if refused else ""
    n = greport.counted
    err_console.print(f"{n(len(vs), 'variant')}: {n(len(compiled), 'binary', 'binaries')} compiled, {fresh} up to "
                      f"date, {n(result['distinct'], 'distinct binary', 'distinct binaries')}{failed}", highlight=False)
    for e in result["entries"]:
        if e["status"] == "refused":
            err_console.print(f"warning: refused {e['error']}", markup=False, highlight=False, soft_wrap=True)
    for w in result.get("replaced", []):  # (after the refusals they follow from)
        err_console.print(w, markup=False, highlight=False, soft_wrap=True)
    for e in result["errors"]:
        err_console.print(f"error: {e['error']}", markup=False, highlight=False, soft_wrap=True)
    names = {v.name for v in vs}
    rep = greport.select(build_report_warned(build_dir, gpu=False, declared=declared | names, arch=arch), names)
    if not no_report:
        greport.print_report(rep, console)
    replanned = " ".join(result.get("replans", []))  # already warned, with what was tried
    for r in rep["rows"]:
        if "spills" in r["flags"] and f"{r['name']}:" not in replanned:
            ov = r.get("overrides") or {}  # a tuned or hand plan is built as given (not re-planned): say which
            cause = (f" with its {r['plan']} plan overrides {ov} (only a default plan is re-planned; --no-tuned "
                     "builds the default)" if ov else "")
            err_console.print(f"warning: {r['name']} spills {r['spill_stores']} B / loads {r['spill_loads']} B "
                              f"to local memory{cause}", markup=False, highlight=False, soft_wrap=True)
    if result["errors"]:
        sys.exit(1)
    if not built:
        err_console.print("error: nothing built: every selected variant was refused (above)", markup=False,
                          highlight=False)
        sys.exit(1)
    # a tuning warning (a tuned plan refused, a broken file) fails --strict too; entries naming no declared variant
    # do not (a file tuned for another variants file is normal: test_a_broken_default_tuning_file_warns_once)
    nwarn = len(result.get("warnings", []))
    # a variant refused for another --arch keeps its earlier build's entry, a row the report shows unflagged: --strict
    # counts such refusals from this build's entries
    refused_now = {e["name"] for e in result["entries"] if e["status"] == "refused"}
    kept = sum(1 for r in rep["rows"] if r["name"] in refused_now and "refused" not in r["flags"])
    if strict and (rep["totals"]["flagged"] or nwarn or kept):
        why = [f"{rep['totals']['flagged']} flagged"] * bool(rep["totals"]["flagged"]) + \
            [f"{nwarn} tuning warning{'s' * (nwarn > 1)}"] * bool(nwarn) + \
            [f"{kept} refused for sm_{arch}, an earlier build kept"] * bool(kept)
        err_console.print(f"--strict: exit 1 ({', '.join(why)})", markup=False, highlight=False)
        sys.exit(1)


def pick_tuning_file(tuned_for: str | None, no_tuned: bool):
    """The tuning file a build uses: --tuned-for's (which must exist), none with --no-tuned, else the only file in
    tuning/ (none where there are several: a note says to choose)."""
    from . import tune as gtune
    if tuned_for is not None and not tuned_for.strip():  # (an unset "$VAR": not the default file unseen)
        fail("--tuned-for: empty (a GPU's name, e.g. 'NVIDIA H200', or a tuning file's path)")
    if no_tuned and tuned_for:
        fail("--tuned-for and --no-tuned exclude each other")
    if no_tuned:
        return None
    if tuned_for:  # a path (a "/" in it, or an existing file: a GPU's name is neither) as is, else a GPU's file
        path = Path(tuned_for) if "/" in tuned_for or Path(tuned_for).is_file() else gtune.tuning_file(tuned_for)
        if not path.is_file():
            have = sorted(p.stem for p in gtune.tuning_dir().glob("*.json")) if gtune.tuning_dir().is_dir() else []
            fail(f"--tuned-for {tuned_for}: no tuning file {gtune.display(path)} (have: {', '.join(have) or 'none'};"
                 " `megakernel tune` on that GPU writes it)")
        if (problem := gtune.tuning_problem(path, entries=True)) is not None:  # asked for by name: an error
            fail(f"--tuned-for {tuned_for}: {gtune.display(path)} is not a tuning file (a JSON object of entries): "
                 f"{problem}")
        return path
    path = gtune.default_tuning_file()
    tdir = os.environ.get("MEGAKERNEL_TUNING_DIR")
    if tdir and not Path(tdir).is_dir():  # every tuned plan would be dropped unseen (generator.tune.tuning_dir)
        err_console.print(f"warning: MEGAKERNEL_TUNING_DIR={tdir}: not a directory; no tuning file is read (default "
                          "plans)", markup=False, highlight=False, soft_wrap=True)
    if path is None and gtune.tuning_dir().is_dir() and len(list(gtune.tuning_dir().glob("*.json"))) > 1:
        err_console.print(f"note: several tuning files in {gtune.display(gtune.tuning_dir())}: default plans used "
                          "(--tuned-for GPU picks one)", markup=False, highlight=False, soft_wrap=True)
    return path


def cuda_unavailable() -> str | None:
    """None where torch sees a CUDA GPU, else one line saying why not (torch's own check, before any load)."""
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return f"no CUDA GPU visible to torch {torch.__version__} ({build})"


@main.command("report")
@variants_opt
@build_dir_opt
@click.option("--bench-dir", default="bench/results", show_default=True, help="where benchmark results live")
@click.option("--no-gpu", is_flag=True, help="do not measure module load times even where a GPU is present")
@click.option("--strict", is_flag=True, help="exit 1 if any declared variant is flagged")
@click.option("--wide", is_flag=True, help="every column (report.json and report.csv always have them all)")
def report_cmd(variants_file, build_dir, bench_dir, no_gpu, strict, wide):
    """Resource figures of the built variants still declared in the variants file, joined with the latest
    benchmark. Entries of the build directory no longer declared are named in one line, not reported."""
    if bench_dir != "bench/results" and not Path(bench_dir).is_dir():  # the default may be absent (outside the repo)
        fail(f"--bench-dir {bench_dir}: no such directory")
    declared = None
    if Path(variants_file).exists() or variants_file != "variants.yaml":
        declared = {v.name: v for v in load_selected(variants_file)}  # stale builds flagged against these
    why = None if no_gpu else cuda_unavailable()  # torch's check first: never a bare error from a load
    try:
        try:  # the architecture built here last, where not the default (a bare build would compile sm_90 into it)
            built_arch = str(gmanifest.read_manifest(Path(build_dir)).get("arch") or DEFAULT_ARCH)
        except gmanifest.ManifestError:
            built_arch = DEFAULT_ARCH  # (build_report says what is wrong with it)
        cmd = "megakernel build" + variants_flag(variants_file) + gmanifest.build_dir_flag(build_dir) + (
            f" --arch {built_arch}" if built_arch != DEFAULT_ARCH else "")
        rep = build_report_warned(build_dir, bench_dir=bench_dir, gpu=not no_gpu and why is None,
                                  declared=declared, build_cmd=cmd)
    except FileNotFoundError as exc:
        # (no variants.yaml here either: the build it suggests needs one first)
        fail(str(exc) if declared is not None else f"{exc}; and no {variants_file} here to build from (--variants "
             "FILE, or `megakernel from-hf MODEL_DIR --write variants.yaml`)")
    if why:
        err_console.print(f"note: {why}: module load times not measured (--no-gpu skips this check)",
                          markup=False, highlight=False, soft_wrap=True)
    greport.print_report(rep, console, wide=wide)
    if rep.get("not_declared"):  # a build dir shared by several variants files: the first few named
        nd = rep["not_declared"]
        names = ", ".join(nd) if len(nd) <= 8 else f"{len(nd)} built variants ({', '.join(nd[:5])}, ...)"
        err_console.print(f"not declared in {variants_file} (ignored): {names}",
                          markup=False, highlight=False, soft_wrap=True)
    for r in rep["rows"]:  # the flags column says refused/error; the reason is one line here
        if r["status"] != "ok":
            why = r.get("error", "")
            err_console.print(f"{r['status']}: " + (why if why.startswith(r["name"]) else f"{r['name']}: {why}"),
                              markup=False, highlight=False, soft_wrap=True)
    if rep.get("not_built"):  # (after an --only build most are: the first few named, `list` shows all)
        nb = rep["not_built"]
        listing = "megakernel list" + variants_flag(variants_file)
        names = ", ".join(nb) if len(nb) <= 8 else f"{len(nb)} variants ({', '.join(nb[:5])}, ...; `{listing}` names them)"
        err_console.print(f"declared in {variants_file}, not built: {names} (run `{cmd}`)",
                          markup=False, highlight=False, soft_wrap=True)
    if strict and rep["totals"]["flagged"]:
        err_console.print(f"--strict: exit 1 ({rep['totals']['flagged']} flagged)", markup=False, highlight=False)
        sys.exit(1)


@main.command("clean")
@build_dir_opt
def clean_cmd(build_dir):
    """Remove the build directory: only one that holds nothing but what a build writes (its manifest, objects/,
    the variants' directories, report.json/.csv, its lock and temporary files, and bench/e2e.py's
    e2e-variants.yaml); any other entry (or one of those names of another kind: a report.json directory), a
    manifest.json that is not a build's, a symbolic link, or the directory this command runs in (or one above it)
    refuses the whole removal in one line, and so does a build still using it (its shared lock on .busy, or a
    compile's lock).
    What a build's own subdirectories hold (objects/, a variant's) goes with them."""
    p = Path(build_dir)
    if p.is_symlink():
        fail(f"{build_dir}: a symbolic link (to {os.readlink(p)}); not removing it (clean the directory it points to, "
             "or remove the link)")
    if not p.exists():  # (a typo would otherwise look like a clean that worked)
        click.echo(f"nothing to remove: {build_dir} does not exist", err=True)
        return
    if not p.is_dir():
        fail(f"{build_dir}: not a directory; not removing it")
    here = Path.cwd().resolve()
    if p.resolve() == Path(p.resolve().anchor):
        fail(f"{build_dir}: the file system's root; not removing it")
    if here == p.resolve() or p.resolve() in here.parents:
        fail(f"{build_dir}: this command runs inside it ({here}); cd out of it first")
    why = gmanifest.not_a_build(p)
    if why:
        fail(f"{build_dir}: {why}; not removing it")
    from . import compile as gcompile
    try:
        with gcompile.claimed(p):
            shutil.rmtree(p)
    except gcompile.InUse as exc:
        fail(f"{build_dir}: a build is using it ({exc.path.relative_to(p)} is locked); not removing it (try again "
             "when the build ends)")
    except OSError as exc:  # (rmtree names the entry relative to its directory: the build directory named here)
        where = f": {exc.filename}" if exc.filename else ""
        fail(f"{build_dir}: could not remove all of it ({exc.strerror or exc}{where})")
    err_console.print(f"removed {p}/", highlight=False)




@main.command("bench", add_help_option=False,
              context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def bench_cmd(ctx):
    """Time the fused kernels against the unfused baselines on a GPU (details: megakernel bench --help)."""
    from bench.run import cli as bench_cli  # torch/CUDA imports only when benchmarking
    _delegate(bench_cli, ctx.args, "megakernel bench")


@main.command("tune", add_help_option=False,
              context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def tune_cmd(ctx):
    """Sweep plan candidates per variant (decode and prefill) on this GPU; write the winners to tuning/<gpu>.json
    (see `megakernel tune --help`)."""
    from bench.tune import cli as tune_cli  # torch/CUDA imports only when tuning
    _delegate(tune_cli, ctx.args, "megakernel tune")


def _delegate(command: click.Command, args: list, prog: str) -> None:
    """Run a command that lives in bench/ with this CLI's conventions: a usage error is one `error:` line (exit 2),
    `-h` is `--help`."""
    args = ["--help" if a == "-h" else a for a in args]
    try:
        rv = command.main(args=args, prog_name=prog, standalone_mode=False)
    except click.UsageError as exc:
        fail(f"{prog}: {exc.format_message()}")
    except click.exceptions.Abort:
        fail("interrupted", 130)  # (Ctrl-C: 130, as a shell reports SIGINT; build exits the same)
    if isinstance(rv, int) and rv:
        sys.exit(rv)


@main.command("from-hf")
@click.argument("path")
@click.option("--write", "write_file", default=None,
              help="append the entry to this variants file (started with a default matrix if it does not exist)")
@click.option("--name", default=None, help="the model's key in variants.yaml (variant names start with it) [from "
              "the directory / model_type]")
@click.option("--batch", "batches", default=None, help="the entry's own matrix: batch sizes, comma-separated [1,8]")
@click.option("--seq-len", "seq_lens", default=None,
              help="the entry's own matrix: decode variants' KV rows a sequence, comma-separated [4096, or the "
                   "model's max_position_embeddings where shorter]")
@click.option("--prefill-chunks", default=None,
              help="the entry's own matrix: prefill variants too, of these chunk lengths (comma-separated; they "
                   "use the decode variants' cache)")
def from_hf_cmd(path, write_file, name, batches, seq_lens, prefill_chunks):
    """Print (or append) the variants.yaml entry for a Hugging Face model directory or config.json. With --batch,
    --seq-len or --prefill-chunks the entry carries its own matrix (else the file's applies)."""
    from . import hf

    def ints(opt, text, default):
        if text is None:
            return default
        try:
            out = [int(t) for t in text.split(",")]
        except ValueError:
            fail(f"{opt}: comma-separated integers, got {text!r}")
        if min(out) < 1:
            fail(f"{opt}: positive integers, got {text!r}")
        return out
    try:  # (the default cache: 4096 rows, or max_position_embeddings where shorter)
        cfg = hf.read_config(path)[1]
        seq_len = hf.default_seq_len(cfg)
    except hf.HFConfigError as exc:
        fail(str(exc))
    matrix = None
    if batches is not None or seq_lens is not None or prefill_chunks is not None:
        b = ints("--batch", batches, [1, 8])
        matrix = [{"mode": ["decode"], "batch": b, "seq_len": ints("--seq-len", seq_lens, [seq_len])}]
        if prefill_chunks is not None:
            chunks = ints("--prefill-chunks", prefill_chunks, [])
            cache = max(matrix[0]["seq_len"])
            if any(c > cache for c in chunks):  # a prompt chunk lands in the decode variants' cache
                fail(f"--prefill-chunks: a chunk of {max(chunks)} tokens does not fit the decode variants' cache of "
                     f"{cache} rows (--seq-len{'' if seq_lens else f', default {seq_len}'}): chunks up to {cache}")
            matrix.append({"mode": ["prefill"], "batch": b, "seq_len": chunks})
    try:
        text = hf.variant_entry_yaml(path, name=name, matrix=matrix)
        for line in text.splitlines():
            if line.lstrip().startswith("# " + hf.WARNING_MARK):
                err_console.print(line.lstrip()[2:], markup=False, highlight=False, soft_wrap=True)
        def warn_refused(variants):  # say now which of the entry's variants `build` would refuse (a batch too large)
            from . import render
            for v in variants:
                try:
                    render.plan(v)
                except render.PlanError as exc:
                    err_console.print(f"warning: `megakernel build` will refuse {exc}", markup=False,
                                      highlight=False, soft_wrap=True)
        if matrix is not None:  # the entry's own matrix
            warn_refused(gvariants.parse("models:\n" + text, "the entry"))
        if write_file:
            try:
                started = not Path(write_file).read_text().strip()
            except FileNotFoundError:
                started = True
            except (OSError, UnicodeDecodeError):
                started = False  # append_entry says what is wrong with it
            hf.append_entry(write_file, text, seq_len=seq_len)
            err_console.print((f"started {write_file} (a default matrix) with the entry"
                               + (" (its own matrix)" if matrix is not None else "")) if started
                              else f"appended to {write_file}", highlight=False)
            if matrix is None:  # the file's matrix applies: its variants of this entry
                entry = next(iter(yaml.safe_load("models:\n" + text)["models"]))
                mine = [v for v in gvariants.load(write_file) if v.model.name == entry]
                warn_refused(mine)
                trained = hf.trained_positions(cfg, mine[0].model.rope_scaling if mine else None)
                longest = max((v.seq_len for v in mine if v.mode == "decode"), default=0)
                if trained is not None and longest > trained and ("# " + hf.WARNING_MARK) not in text:
                    err_console.print(f"warning: seq_len {longest} (the matrix of {write_file}) is longer than "
                                      f"{hf.context_words(cfg, trained)}: positions past it were never trained",
                                      markup=False, highlight=False, soft_wrap=True)
        else:
            click.echo(text, nl=False)
    except (hf.HFConfigError, gvariants.VariantError) as exc:
        hint = (f"; the entry's own matrix took the default --seq-len {seq_len}: pass --seq-len"
                if matrix is not None and seq_lens is None and f"seq_len {seq_len}" in str(exc) else "")
        fail(str(exc) + hint)


@main.command("generate")
@click.argument("model_dir")
@click.option("--prompt", "prompts", multiple=True, help="prompt text (needs a tokenizer in MODEL_DIR; repeatable: "
              "one sequence each)")
@click.option("--ids", "ids", multiple=True, help="prompt token ids, comma-separated (repeatable: one sequence each)")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="tokens to generate per sequence (its stop tokens may end it sooner)")
@click.option("--batch", type=click.IntRange(min=1), default=None, help="repeat the prompt(s) to this many sequences")
@click.option("--temperature", type=click.FloatRange(min=0, max=1e4), default=0.0, show_default=True,
              help="0: greedy")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0: off")
@click.option("--top-p", type=click.FloatRange(min=0, min_open=True, max=1), default=1.0, show_default=True,
              help="nucleus sampling's probability mass (1: off)")
@click.option("--seed", type=click.IntRange(min=0, max=2**62 - 1), default=0, show_default=True,
              help="sampling seed (sequence b draws with seed + 7919 x b)")
@click.option("--stop", "stops", default=None, help="stop token ids, comma-separated, or `none`: every sequence "
              "runs to --max-new-tokens [the checkpoint's eos_token_id as transformers reads it: generation_config.json's where there is one, else config.json's]")
@click.option("--variant", "variant_names", multiple=True, help="built variant to use (repeatable) [every built "
              "variant that fits the model]")
@click.option("--cache-len", type=click.IntRange(min=2), default=None, help="KV rows per sequence [the decode "
              "variants' seq_len where one is used, else the longest prompt + --max-new-tokens - 1; a value no decode "
              "variant has runs decode unfused, with a warning (an error with --variant)]")
@click.option("--device", default="auto", show_default=True,
              help="cuda, cuda:N, or cpu (the unfused layers); auto: cuda where torch sees a GPU, else cpu with a note")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="weights and caches [the fused variants', else on a GPU the config's bf16/fp16, on the CPU the "
                   "config's dtype (float32 for float64); fp32 only without fused variants]")
@click.option("--no-graph", is_flag=True, help="run decode steps eagerly instead of replaying a CUDA graph")
@build_dir_opt
def generate_cmd(model_dir, prompts, ids, max_new_tokens, batch, temperature, top_k, top_p, seed, stops,
                 variant_names, cache_len, device, dtype, no_graph, build_dir):
    """Generate from a Hugging Face model directory on its built variants (unfused PyTorch where none fits);
    prints the text (--prompt) or token ids (--ids), tokens/s, time to first token and the path that served each
    layer. One sequence streams as it grows; several print when the run ends, one line each. Under torchrun
    (WORLD_SIZE > 1) the model runs tensor parallel over the processes (one GPU each, NCCL; gloo on the CPU: --device
    cpu, or auto where torch sees no GPU) on the variants built with that tp; rank 0 prints."""
    import os

    import torch
    if bool(prompts) == bool(ids):
        fail("generate: give --prompt TEXT or --ids 1,2,3 (one of them, repeatable)")
    try:  # before the GPU check: the path is what the user typed (a symlink loop's own reason, not "no such")
        os.stat(model_dir)
    except FileNotFoundError:
        fail(f"{model_dir}: no such file or directory (a Hugging Face model directory: config.json and weights)")
    except OSError as exc:
        fail(f"{model_dir}: cannot read: {exc.strerror}")
    if Path(model_dir).is_dir() and not (Path(model_dir) / "config.json").exists():
        fail(f"{model_dir}: no config.json (a Hugging Face model directory: config.json and weights)")
    if device == "auto":  # the GPU where torch sees one; else the CPU's unfused layers, said (not a silent fallback)
        why = cuda_unavailable()
        device = "cpu" if why else "cuda"
        if why and os.environ.get("RANK", "0") == "0":  # (under torchrun: rank 0 says it)
            err_console.print(f"note: {why}: the unfused layers run on the CPU (--device auto found no GPU)",
                              markup=False, highlight=False, soft_wrap=True)
    try:
        dev = torch.device(device)
    except RuntimeError:
        fail(f"--device: not a torch device: {device!r} (auto, cuda, cuda:N or cpu)")
    if dev.type not in ("cuda", "cpu"):  # meta, mps, xpu ...: the model runs on CUDA (fused) or the CPU (unfused)
        fail(f"--device {device}: the model runs on cuda, cuda:N or cpu (or auto)")
    if dev.type == "cuda" and (why := cuda_unavailable()):
        fail(f"generate: {why} (--device cpu runs the unfused layers on the CPU)")
    given = click.get_current_context().get_parameter_source("build_dir") != click.core.ParameterSource.DEFAULT
    if os.environ.get("RANK", "0") == "0" and (given if dev.type == "cpu" else not Path(build_dir).is_dir()):
        # (a build directory mistyped, or one the CPU does not read: said, not silently unused)
        err_console.print(f"note: --build-dir {build_dir}: " + (
            "not read on the CPU (fused kernels run on CUDA)" if dev.type == "cpu" else
            "no such directory: no built variant is read from it"),
                          markup=False, highlight=False, soft_wrap=True)
    group, echo, info = None, click.echo, err_console.print
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: one process per GPU, tensor parallel
        import datetime

        import torch.distributed as dist
        if dev.type == "cuda":
            if dev.index is not None:
                fail(f"--device {device}: under torchrun each process takes the GPU of its LOCAL_RANK (--device cuda)")
            local, n = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
            if local >= n and n != 1:
                fail(f"LOCAL_RANK {local}: this process sees {n} GPUs")
            dev = torch.device("cuda", local if local < n else 0)  # one visible GPU a process: that one
            torch.cuda.set_device(dev)
            device = str(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10))
        group = dist.group.WORLD
        if dist.get_rank() != 0:  # rank 0 prints the tokens and figures; every rank its own errors (fail)
            echo = info = lambda *a, **k: None  # noqa: E731
    try:
        _generate(model_dir, prompts, ids, max_new_tokens, batch, temperature, top_k, top_p, seed, stops,
                  variant_names, cache_len, device, dev, no_graph, build_dir, group, echo, info, dtype)
    finally:
        if group is not None:
            import torch.distributed as dist
            dist.destroy_process_group()


# Model.generate's and Model.from_hf's argument names -> the generate command's options, so an error names what the
# user typed (`--stop 5000`: "--stop: integer token ids in [0, 127] ...", not "stop_tokens: ...")
_OPTION_OF = {"stop_tokens": "--stop", "max_new_tokens": "--max-new-tokens", "cache_len": "--cache-len",
              "variants": "--variant", "dtype": "--dtype", "temperature": "--temperature", "top_k": "--top-k",
              "top_p": "--top-p", "seed": "--seed", "device": "--device"}
_DTYPE_WORDS = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}
_FITS_ADVICE_UNFUSED = "fewer sequences or a lower --cache-len / --max-new-tokens"
_FITS_ADVICE = _FITS_ADVICE_UNFUSED + " (on a GPU also fewer --variant)"


def _as_options(msg: str, prompt_option: str, given: set[str]) -> str:
    """`msg` (a ServeError's one line) with its leading argument name as the generate option that set it, where the
    user gave that option (`given`: the options on the command line; a name the command filled in itself, e.g. the
    config's eos_token_id as stop_tokens or the build's variants, stays as it is), torch dtypes as --dtype names and
    the memory check's advice in options."""
    from .serve import FITS_ADVICE, FITS_ADVICE_UNFUSED, LARGER_CACHE  # (serve is loaded by then: its errors are
    # what this rewrites; the longer advice first, the shorter is its start)
    for api_words, cli_words in {FITS_ADVICE: _FITS_ADVICE, FITS_ADVICE_UNFUSED: _FITS_ADVICE_UNFUSED,
                                 LARGER_CACHE: "a larger --cache-len, or decode variants of a longer seq_len"}.items():
        msg = msg.replace(api_words, cli_words)
    # (a quoted one is a value from config.json, e.g. a refused dtype "torch.float16": quoted as it is written)
    msg = re.sub(r"(?<!['\"])torch\.(bfloat16|float16|float32)\b", lambda m: _DTYPE_WORDS[m.group(0)], msg)
    name, sep, rest = msg.partition(": ")
    if sep and _OPTION_OF.get(name) in given:
        return f"{_OPTION_OF[name]}: {rest}"
    if sep and name == "prompts":
        return f"{prompt_option}: {rest}"
    if sep and name.startswith("prompts[") and name.endswith("]"):
        return f"{prompt_option} (sequence {name[len('prompts['):-1]}, counting from 0): {rest}"
    return msg


def has_tokenizer_files(model_dir) -> bool:
    """Whether `model_dir` holds a file a Hugging Face tokenizer may be read from (tokenizer.json / _config.json,
    vocab.json / .txt, a SentencePiece *.model or *.spm, a *.tiktoken, Mistral's tekken.json); a directory with none
    has no tokenizer."""
    return any(p.is_file() and (p.name.startswith(("tokenizer", "vocab")) or p.name == "tekken.json"
                                or p.suffix in (".model", ".spm", ".tiktoken")) for p in Path(model_dir).iterdir())


def _generate(model_dir, prompts, ids, max_new_tokens, batch, temperature, top_k, top_p, seed, stops, variant_names,
              cache_len, device, dev, no_graph, build_dir, group, echo, info, dtype=None):
    """generate_cmd's work once the device and any process group are set: echo prints tokens, info figures."""
    import warnings

    from . import hf, loader, serve
    tok = None
    if prompts:
        try:  # a config.json that is not one: said first (transformers' tokenizer loader reads it too, and its failure
            hf.read_config(model_dir)  # would read as a missing tokenizer)
        except hf.HFConfigError as exc:
            fail(str(exc))
        model_dir = str(hf.config_path(model_dir).parent)  # (config.json itself given: its directory's tokenizer)
        needs = f"{model_dir}: --prompt needs a tokenizer in the model directory (tokenizer.json, tokenizer.model ...)"
        if Path(model_dir).is_dir() and not has_tokenizer_files(model_dir):
            # (said before transformers is asked: it fails in a paragraph, or for some model types (Qwen2's) builds a
            # tokenizer of no vocabulary that encodes text to nothing)
            fail(f"{needs}, and it has none; give --ids instead")
        try:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(model_dir)
        except Exception as exc:  # noqa: BLE001 - no tokenizer files, or no transformers
            why = " ".join(str(exc).split()) or type(exc).__name__  # its lines joined: one line, cut at a word
            why = why if len(why) <= 200 else why[:200].rsplit(" ", 1)[0] + " ..."
            fail(f"{needs}, and transformers could not load one ({why.rstrip(': ')}); give --ids instead")
        seqs = []
        for p in prompts:
            try:
                seqs.append(tok(p)["input_ids"])
            except Exception as exc:  # noqa: BLE001 - the tokenizer's own failure (a WordLevel one with no unk token)
                why = " ".join(str(exc).split())[:200] or type(exc).__name__
                fail(f"--prompt {p!r}: the tokenizer of {model_dir} could not encode it ({why}); give --ids instead")
        if empty := [i for i, sq in enumerate(seqs) if not sq]:
            if not set(tok.get_vocab()) - set(tok.all_special_tokens):  # (transformers 5 builds one of special
                # tokens alone for some model types, Qwen2's, from a tokenizer_config.json: that is what is wrong)
                fail(f"{needs}, and transformers made one of special tokens alone ({len(tok.get_vocab())}) from it, "
                     "which encodes text to nothing; give --ids instead")
            fail(f"--prompt {prompts[empty[0]]!r}: the tokenizer encodes it to no tokens (and adds no start token); "
                 "give some text, or --ids")
    else:
        try:
            seqs = [[int(t) for t in s.split(",")] for s in ids]
        except ValueError:
            fail(f"--ids: comma-separated integers (no empty item), got {' '.join(ids)!r}")
    if batch and batch < len(seqs):
        fail(f"--batch {batch}: fewer sequences than the {len(seqs)} prompts given (--batch repeats the prompts up to "
             "that many sequences; leave it out to run each prompt once)")
    if batch:
        seqs = [seqs[i % len(seqs)] for i in range(batch)]
    try:
        stop_ids = (None if stops is None else [] if stops.strip().lower() == "none"
                    else [int(t) for t in stops.split(",")])
    except ValueError:
        fail(f"--stop: comma-separated integers (no empty item) or none, got {stops!r}")
    chosen = list(variant_names) or None
    if dev.type == "cpu":  # the fused kernels run on CUDA only: the CPU serves the unfused layers
        if chosen:
            fail("--variant: fused variants run on CUDA, and this run is on the CPU (--device cpu, or no GPU found): "
                 "the CPU serves the unfused layers (drop --variant)")
        chosen = []
    cfg = {}
    try:
        cfg = hf.read_config(model_dir)[1]
        cfg = cfg if isinstance(cfg, dict) else {}  # (Model.from_hf below refuses it in one line)
    except hf.HFConfigError:
        pass  # Model.from_hf below says what is wrong with the directory
    if tok is not None and type(vocab := cfg.get("vocab_size")) is int:  # (the text's ids, not ids given: said so)
        for p, sq in zip(prompts, seqs):
            if far := [t for t in sq if not 0 <= t < vocab]:
                fail(f"--prompt {p!r}: the tokenizer gives id {far[0]}, past config.json's vocab_size {vocab} (the "
                     "model directory's tokenizer and checkpoint disagree)")
    said = [0]  # the warnings of `caught` said so far

    def say(caught) -> None:
        """The recorded warnings not said yet, each a `warning:` line in the options' words (none of an error's run:
        it fails before its first token)."""
        for w in caught[said[0]:]:
            if dev.type == "cpu" and issubclass(w.category, serve.MissingVariantWarning):
                continue  # the CPU runs the unfused layers by design: declaring a variant would not change that
            if issubclass(w.category, hf.HFDowncastWarning):
                continue  # (the note below says it with the option's name)
            msg = str(w.message)  # (the API's words as the options')
            for api, cli in ((r"\bcache_len[= ](\d+)\b", r"--cache-len \1"),
                             (r"\bmax_new_tokens\b", "--max-new-tokens"),
                             (r"\bvariants=\[\.\.\.\] or ", "--variant or "),
                             (r"\bor (cache_len|dtype) to\b", lambda m: f"or --{m[1].replace('_', '-')} to")):
                msg = re.sub(api, cli, msg)
            info(f"warning: {msg}", markup=False, highlight=False, soft_wrap=True)
        said[0] = len(caught)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", serve.MissingVariantWarning)
            model = serve.Model.from_hf(model_dir, build_dir=build_dir, variants=chosen, device=device,
                                        cache_len=cache_len, max_batch=len(seqs), group=group, dtype=dtype,
                                        # (the last new token is never fed back: Model.generate's need)
                                        default_cache_len=max(2, max(len(s) for s in seqs) + max_new_tokens - 1))
            model.use_graphs = model.use_graphs and not no_graph

            stream = TextStream(tok, lambda text: echo(text, nl=False))  # one sequence: printed as it grows

            def show(b, t):
                say(caught)  # (the warnings of the call's checks and planning: said as the first token comes)
                if len(seqs) == 1:
                    stream.add(t)
                    sys.stdout.flush()
            out = model.generate(seqs, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                 seed=seed, stop_tokens=stop_ids, callback=show)
    except (serve.ServeError, hf.HFConfigError, loader.LoadError, gvariants.VariantError) as exc:
        given = {o for o, val in (("--stop", stops), ("--max-new-tokens", True), ("--cache-len", cache_len),
                                  ("--variant", variant_names), ("--dtype", dtype), ("--temperature", True),
                                  ("--top-k", True), ("--top-p", True), ("--seed", True), ("--device", True)) if val}
        msg = str(exc)
        if cache_len is None and ": cache_len" in msg and ": seq_len " in msg and ("sliding_window" in msg
                                                                                  or "dynamic RoPE" in msg):
            msg += (" (without --cache-len the cache holds the longest prompt + --max-new-tokens - 1 rows: "
                    "ask for fewer new tokens, or give a shorter prompt)")
        fail(_as_options(msg, "--ids" if tok is None else "--prompt", given))
    if len(seqs) == 1:
        stream.flush()
        echo()  # ends the streamed line
    say(caught)
    if len(seqs) > 1:
        for b, new in enumerate(out.tokens):
            # (as one sequence streams them: without special tokens and the clean-up of spaces, TextStream)
            echo(f"[{b}] " + (tok.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False) if tok
                              else " ".join(map(str, new))))
    n_new = sum(len(t) for t in out.tokens)
    if tok is not None and (unknown := sum(t >= len(tok) for new in out.tokens for t in new)):
        info(f"note: {greport.counted(unknown, 'generated token')} past the tokenizer's {len(tok)} ids (the "
             f"checkpoint's vocab_size is {model.vocab}) printed as nothing", markup=False, highlight=False,
             soft_wrap=True)
    info(f"{greport.counted(n_new, 'token')}, {greport.counted(len(seqs), 'sequence')}: time to first token "
         f"{out.ttft_s * 1e3:.1f} ms, " + (f"decode {out.tokens_per_s:,.1f} tokens/s "
         f"({'CUDA graph' if model.use_graphs else 'eager'})" if out.tokens_per_s > 0 else
         ("no decode step (--max-new-tokens 1)" if max_new_tokens == 1 else
          "no decode step (every sequence ended at its first token)")), highlight=False)
    pre = ", ".join(f"{p.start}..{p.start + p.length - 1}: {p.choice.variant or 'unfused'}"
                    for p in out.prefill_pieces)
    dec = out.decode_choice.variant or f"unfused (batch {out.decode_choice.batch})"
    info(f"every layer (0..{model.shape.layers - 1}): decode {dec} [{out.decode_choice.why}]; prefill by prompt "
                      f"positions {pre}; head (norm, lm_head, next token): decode {model.head_path(out.decode_choice.batch)}"
         + (f"; sampled draw: decode {model.draw_path(temperature, top_k, top_p)}"
            if temperature > 0 and out.tokens_per_s > 0 else ""),
         markup=False, highlight=False, soft_wrap=True)
    import torch
    if dtype is None and (raw := hf.config_dtype(cfg)[1]) in ("float32", "float64") and model.dtype != torch.float32:
        info(f"note: config.json's dtype {raw} ran as {str(model.dtype).removeprefix('torch.')} (the default "
             "without --dtype on a GPU: the fused kernels' dtype); --dtype fp32 runs it "
             + ("as transformers does (unfused)" if raw == "float32" else "unfused in fp32 (transformers: float64)"),
             markup=False, highlight=False, soft_wrap=True)
    if temperature == 0 and (asked := sampling_asked(model_dir)):
        opts = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in (a.split(" ") for a in asked.split(", ")))
        info(f"note: generation_config.json asks for sampling ({asked}, as transformers' generate() fills it); this "
             f"run is greedy: pass {opts} to sample with those settings", markup=False, highlight=False,
             soft_wrap=True)
    if ignored := processors_ignored(model_dir):
        info(f"note: {ignored}, which transformers' generate() applies to the logits "
             "and this command does not (it has no such option): its tokens may differ from transformers' from the "
             "first step where one would act", markup=False, highlight=False, soft_wrap=True)
    mem = model.memory()
    unit = "GPU" if model.device.type == "cuda" else "process"
    per = f" (per {unit}, tensor parallel over {group.size()})" if group is not None else ""
    info(f"memory{per}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in mem.items() if v),
         markup=False, highlight=False, soft_wrap=True)


class TextStream:
    """One sequence's new tokens printed as they come, through `write(text)`: token ids, space-separated, where there
    is no tokenizer; else the whole text decoded again at each token, special tokens skipped (an end of turn `</s>` is
    no text; a token alone loses its leading space in SentencePiece, or is half of a character spanning tokens: held
    back while the text ends in U+FFFD) and what was not yet printed written. Decoded without the tokenizer's
    clean-up of spaces (Llama-3's tokenizers set `clean_up_tokenization_spaces`), which may rewrite text already
    printed (" ' " to "'") so that nothing after it would print; so the streamed text is the tokens' own, as
    transformers' TextStreamer prints it with that option off."""

    def __init__(self, tok, write):
        self.tok, self.write, self.ids, self.shown = tok, write, [], ""

    def _text(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> None:
        """Prints what token id `token` adds to the text (or what it lets through that an earlier one held back)."""
        self.ids.append(token)
        if self.tok is None:
            self.write(f"{' ' if len(self.ids) > 1 else ''}{token}")
            return
        text = self._text()
        if not text.endswith("\ufffd") and text.startswith(self.shown):
            self.write(text[len(self.shown):])
            self.shown = text

    def flush(self) -> None:
        """Prints what a partial character at the end held back."""
        if self.tok is not None and (text := self._text()).startswith(self.shown):
            self.write(text[len(self.shown):])
            self.shown = text


def _generation_config(model_dir):
    """(GenerationConfig, the file it came from) as transformers' generate() takes it: generation_config.json, or
    where there is none the generation fields of config.json (GenerationConfig.from_model_config, as
    PreTrainedModel loads a checkpoint without the file); (None, "") where neither reads."""
    try:
        from transformers import GenerationConfig
        if (Path(model_dir) / "generation_config.json").is_file():
            return GenerationConfig.from_pretrained(str(model_dir)), "generation_config.json"
        if (cfg := Path(model_dir) / "config.json").is_file():  # (the raw dict: the config class drops these fields)
            return GenerationConfig.from_model_config(json.loads(cfg.read_text())), "config.json"
    except Exception:  # noqa: BLE001 - any file transformers would not read
        pass
    return None, ""


# generation_config.json fields that transformers' generate() turns into logits processors (greedy or sampled) and
# the value at which each does nothing; `megakernel generate` applies none of them
LOGITS_PROCESSOR_FIELDS = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                           "min_new_tokens": 0, "min_length": 0, "suppress_tokens": None,
                           "begin_suppress_tokens": None, "bad_words_ids": None, "sequence_bias": None,
                           "forced_bos_token_id": None, "forced_eos_token_id": None, "min_p": None, "typical_p": 1.0,
                           "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "exponential_decay_length_penalty": None}


def processors_ignored(model_dir) -> str:
    """The logits-processing fields of a checkpoint's generation config (_generation_config) that transformers'
    generate() would apply and `megakernel generate` does not (LOGITS_PROCESSOR_FIELDS, each at a value other than
    its no-op), as "generation_config.json sets repetition_penalty 1.05, no_repeat_ngram_size 3"; "" where none."""
    gen, source = _generation_config(model_dir)
    if gen is None:
        return ""
    out = []
    for k, noop in LOGITS_PROCESSOR_FIELDS.items():
        v = getattr(gen, k, None)
        if v is None or v == noop or v in ([], {}, ()):
            continue
        out.append(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}")
    return f"{source} sets {', '.join(out)}" if out else ""


def sampling_asked(model_dir) -> str:
    """What a checkpoint's generation_config.json asks of sampling, where it sets do_sample true, as transformers'
    generate() runs it: read by transformers' GenerationConfig, the fields it leaves unset filled with generate()'s
    defaults (Llama-3's file: "temperature 0.6, top_k 50, top_p 0.9": its top_k is transformers' default), else ""
    (no file, one transformers refuses, or greedy). `megakernel generate` samples only when told (--temperature)."""
    gen, _ = _generation_config(model_dir)
    if gen is None or gen.do_sample is not True:
        return ""
    from transformers import GenerationConfig
    defaults = getattr(GenerationConfig, "_get_default_generation_params", lambda: {})()  # (transformers >= 5)
    fields = {k: getattr(gen, k, None) if getattr(gen, k, None) is not None else defaults.get(k)
              for k in ("temperature", "top_k", "top_p")}
    return ", ".join(f"{k} {v:g}" for k, v in fields.items() if v is not None)


def run():
    """Console-script entry: every bad input is one line on stderr and exit 2, click's own usage errors included
    (an unknown option, `-j 0`), a corrupt build directory, and a file-system refusal (a read-only build
    directory). Output to a pipe whose reader has gone (`| head`) is dropped without stopping the command
    (_PipeSafe)."""
    sys.stdout, sys.stderr = _PipeSafe(sys.stdout), _PipeSafe(sys.stderr)
    try:
        rv = main(standalone_mode=False, prog_name="megakernel")  # (`python -m generator.cli` is the same command)
    except click.UsageError as exc:
        ctx = exc.ctx
        if isinstance(exc, getattr(click.exceptions, "NoArgsIsHelpError", ())) and ctx:  # bare `megakernel`
            click.echo(ctx.get_help())
            sys.exit(0)
        fail(f"{ctx.command_path + ': ' if ctx else ''}{exc.format_message()}")
    except click.exceptions.Abort:
        fail("interrupted", 130)  # (Ctrl-C: 130, as a shell reports SIGINT; build exits the same)
    except gcompile.ManifestError as exc:
        fail(str(exc))
    except OSError as exc:  # the file system refused (a read-only or missing build directory): one line, no traceback
        if exc.filename is None:
            raise
        fail(f"{exc.filename}: {exc.strerror or exc}")
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    run()
