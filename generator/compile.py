"""Ahead-of-time build: rendered source -> cubin (CuPy's nvcc path, explicit arch) + ptxas resource figures.

Layout of build/:
  <name>/kernel.cu        rendered source (rewritten only when it changed)
  <name>/kernel.cubin     the variant's binary (a hard link to its object: identical sources share one)
  objects/<key>/          kernel.cubin, kernel.ptx, ptxas.log, meta.json for one cache key
  manifest.json           every variant built into this directory: parameters, key, paths, resources
Every file is written to a temporary name and renamed, so a killed or concurrent build never leaves a partial file
under a final name; the manifest is merged under a lock.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from . import __version__, toolchain
from .manifest import MANIFEST, ManifestError, identity, kernel_sources_digest, read_manifest  # noqa: F401
from .manifest import tuning_path
from .plan import l1_bytes
from .render import PlanError, plan, render
from .targets import DEFAULT_ARCH, TargetError, arch as get_arch
from .variants import Variant

NVCC_OPTIONS = ("-std=c++17", "-Xptxas=-v", "-lineinfo")  # line tables: compute-sanitizer and profilers name source lines
_UMASK = os.umask(0o022)  # read once (os.umask can only be read by setting it); restored on the next line
os.umask(_UMASK)


class CompileError(RuntimeError):
    """nvcc failed for a variant: the message names it and carries the compiler's output."""


class BuildInterrupted(KeyboardInterrupt):
    """The compiler was interrupted by SIGINT, SIGTERM or SIGHUP (Ctrl-C reaches nvcc too; compiler_killed): the
    build stops, nothing is recorded for the variants not compiled (a later build compiles them)."""


class RecordedInterrupt(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) that came while the build recorded its results (sources, cubins, manifest): held off until
    they were all written, so the build directory holds this build's, consistent, and the build stops after."""


@contextlib.contextmanager
def uninterrupted():
    """SIGINT and SIGTERM held off in the block (main thread only; elsewhere a no-op): each is recorded by a handler
    of this block's, and once the block has completed the handler that was in place runs for the first one, its
    KeyboardInterrupt raised as RecordedInterrupt (Ctrl-C's default handler, or the CLI's SIGTERM one; a default
    SIGTERM terminates). A block that raises raises its own error (the record is not whole: no RecordedInterrupt)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    was = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in was.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # (None: one set outside Python)
    if caught:  # (reached only when the block completed)
        s, handler = caught[0], was[caught[0]]
        try:
            if callable(handler):
                handler(s, None)
            elif handler in (signal.SIG_DFL, None):  # (SIGINT's default handler is callable: this is SIGTERM's)
                os.kill(os.getpid(), s)
        except RecordedInterrupt:
            raise
        except KeyboardInterrupt as exc:
            raise RecordedInterrupt(*exc.args) from None


def atomic_write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp creates 0600: give the final file a normal file's mode
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:  # (a write's own error, ENOSPC: the file named, so the
            raise OSError(exc.errno, exc.strerror, str(path)) from exc  # CLI says it in one line)
        raise


def write_if_changed(path: Path, text: str) -> bool:
    if path.exists() and path.read_text() == text:
        return False
    atomic_write(path, text)
    return True


def _link(src: Path, dst: Path) -> None:
    """Atomically make dst the same file as src (hard link; copy where links are not possible)."""
    try:
        if os.path.samefile(src, dst):  # already linked (an up-to-date rebuild): rename(tmp, dst) would leave tmp
            return
    except OSError:
        pass  # dst missing: link it
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        os.link(src, tmp)
    except OSError:
        atomic_write(dst, src.read_bytes())
        return
    os.replace(tmp, dst)


_compiler_version: str | None = None


def compiler_version() -> str:
    global _compiler_version
    if _compiler_version is None:
        from cupy.cuda import get_nvcc_path
        nvcc = get_nvcc_path() or "nvcc"  # NVCC may be a command line ("ccache nvcc"): CuPy splits it the same way
        out = subprocess.run(nvcc.split() + ["--version"], capture_output=True, text=True, check=True).stdout
        _compiler_version = out.strip().splitlines()[-1]
    return _compiler_version


def nvcc_arch(arch: str) -> str:
    """The arch nvcc is given for sm_`arch`: sm_90 as sm_90a (the prefill GEMM's wgmma is arch-specific; an sm_90
    cubin runs on sm_90 GPUs only either way)."""
    return "90a" if arch == "90" else arch


def cache_key(source: str, arch: str) -> str:
    h = hashlib.sha256()
    for part in (source, " ".join(NVCC_OPTIONS), nvcc_arch(arch), compiler_version(), __version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def parse_ptxas(log: str) -> dict:
    """Registers, stack, spills and static shared memory of the layer's kernel(s) from `ptxas -v` output: the
    largest over the kernels where a tensor-parallel layer has several."""
    def grab(pattern, default=0):
        found = [int(x) for x in re.findall(pattern, log)]
        return max(found) if found else default
    return {
        "registers": grab(r"Used (\d+) registers"),
        "stack_frame": grab(r"(\d+) bytes stack frame"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "static_smem": grab(r"(\d+) bytes smem"),
        "barriers": grab(r"used (\d+) barriers"),
        # ptxas's advisories (C7510, C7518, ...) that it made Hopper's asynchronous wgmma wait for each other
        "wgmma_serialized": len(re.findall(r"wgmma\.mma_async instructions are serialized", log)),
    }


def blocks_per_sm(registers: int, threads: int, smem: int, arch: str = DEFAULT_ARCH) -> int:
    """Resident blocks per SM that registers, threads and shared memory allow on sm_`arch` (1 KB of shared memory
    per block is reserved by the driver)."""
    a = get_arch(arch)
    regs = max(1, (registers + 7) // 8 * 8) * threads
    by_smem = a.smem_per_sm // (smem + 1024) if smem else 32
    return max(0, min(a.regs_per_sm // regs, a.threads_per_sm // threads, by_smem))


_SIGNAL = re.compile(r"(?:died due to|killed by|terminated by) signal (\d+)")


def compiler_killed(message: str) -> str | None:
    """What a compiler's failure message says about a signal that killed it: "interrupted" for SIGINT, SIGTERM or
    SIGHUP (Ctrl-C reaches nvcc too: the build stops), a hint for others (SIGKILL: most likely out of memory), None
    where no signal killed it (an ordinary compile error)."""
    m = _SIGNAL.search(message)
    if m is None:
        return None
    sig = int(m.group(1))
    if sig in (1, 2, 15):
        return "interrupted"
    if sig == 9:
        return "the compiler was killed (signal 9): most likely out of memory; fewer parallel compiles (-j) help"
    return f"the compiler crashed (signal {sig})"


def _compile_object(source: str, arch: str, obj: Path) -> dict:
    from cupy.cuda import compiler
    t0 = time.perf_counter()
    log = io.StringIO()
    nv_arch = nvcc_arch(arch)
    try:
        cubin = compiler.compile_using_nvcc(source, options=NVCC_OPTIONS, arch=nv_arch, code_type="cubin",
                                            log_stream=log)
        ptx = compiler.compile_using_nvcc(source, options=("-std=c++17",), arch=nv_arch, code_type="ptx")
    except Exception as exc:  # CuPy raises its own error type carrying nvcc's output
        why = compiler_killed(str(exc))
        if why == "interrupted":
            raise BuildInterrupted(str(exc).strip().splitlines()[-1]) from None
        raise CompileError(str(exc) + (f"\n({why})" if why else "")) from None
    seconds = time.perf_counter() - t0
    meta = {"cubin_sha256": hashlib.sha256(cubin).hexdigest(), "compile_s": round(seconds, 2),
            "cubin_bytes": len(cubin), "ptx_bytes": len(ptx), **parse_ptxas(log.getvalue())}
    atomic_write(obj / "ptxas.log", log.getvalue())
    atomic_write(obj / "kernel.ptx", ptx)
    atomic_write(obj / "kernel.cubin", cubin)
    meta["sass"] = toolchain.sass_counts(str(obj / "kernel.cubin"))  # tensor-core instructions in the SASS
    atomic_write(obj / "meta.json", json.dumps(meta, indent=1))  # last: its presence marks a complete object
    return meta


def object_meta(obj: Path) -> dict | None:
    """The object's figures if it is complete and its cubin is intact, else None (rebuild)."""
    try:
        meta = json.loads((obj / "meta.json").read_text())
        ok = hashlib.sha256((obj / "kernel.cubin").read_bytes()).hexdigest() == meta["cubin_sha256"]
    except (OSError, ValueError, KeyError):
        return None
    return meta if ok else None


def compiled_object(source: str, key: str, arch: str, build_dir: Path) -> tuple[dict, bool]:
    """(meta, cached): the object build_dir/objects/`key` of `source` (key = cache_key(source, arch)), compiled
    unless complete. Raises CompileError, BuildInterrupted."""
    obj = build_dir / "objects" / key
    meta = object_meta(obj)
    if meta is not None:
        return meta, True
    # one compile per object across concurrent builds: two compiles of one source differ (-lineinfo records
    # CuPy's temporary path), so interleaved writes could pair one's cubin with the other's meta.json
    while True:
        obj.mkdir(parents=True, exist_ok=True)
        try:
            f = open(obj / ".lock", "w")
        except FileNotFoundError:
            continue  # remove_stale_temps took the empty directory between the two: make it again
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released by the kernel if this process dies
            try:
                current = os.fstat(f.fileno()).st_ino == os.stat(obj / ".lock").st_ino
            except FileNotFoundError:
                current = False
            if not current:
                continue  # remove_stale_temps unlinked this lock while we waited for it: lock the directory anew
            meta = object_meta(obj)
            cached = meta is not None
            if not cached:
                try:
                    meta = _compile_object(source, arch, obj)
                except BaseException:  # interrupted or failed (a full disk among its writes): no incomplete object
                    # left, its files without the meta.json written last, nor an empty directory
                    with contextlib.suppress(OSError):  # (under the lock: a waiter re-locks, as after the sweep)
                        for part in obj.iterdir():
                            if part.name != ".lock":
                                part.unlink()
                        (obj / ".lock").unlink()
                        obj.rmdir()
                    raise
        return meta, cached


BUSY = ".busy"  # a build holds a shared lock on BUILD_DIR/.busy from start to end (in_use); clean takes it exclusive


@contextlib.contextmanager
def in_use(build_dir: Path):
    """Held by `build` for its whole run: a shared flock on build_dir/.busy (several builds may share a directory),
    so that `megakernel clean` (an exclusive lock, not waited for) never removes a directory a build is writing.
    Creates the directory; where it did not exist and the build left nothing in it, removes it again."""
    fresh = not build_dir.exists()
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with open(build_dir / BUSY, "a") as f:  # ("a": an existing file is not rewritten)
            fcntl.flock(f, fcntl.LOCK_SH)
            yield
    finally:
        if fresh and {e.name for e in build_dir.iterdir()} <= {BUSY}:
            shutil.rmtree(build_dir, ignore_errors=True)


class InUse(RuntimeError):
    """claimed: a build is using the directory; .path is the lock another process holds."""
    def __init__(self, path: Path):
        super().__init__(f"{path} is locked")
        self.path = path


@contextlib.contextmanager
def claimed(build_dir: Path):
    """The directory held for its removal (`megakernel clean`): .busy's lock taken exclusive and kept (a build that
    starts meanwhile waits on it), after checking that no build holds it shared and no compile holds its own lock.
    Raises InUse without waiting. A directory without .busy (a build of an earlier version) is checked by its
    other locks only."""
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(open(build_dir / BUSY, "rb"))
        except FileNotFoundError:
            f = None
        if f is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise InUse(build_dir / BUSY) from None
        if (held := busy(build_dir)) is not None:
            raise InUse(held)
        yield


def busy(build_dir: Path) -> Path | None:
    """The first lock under `build_dir` that another process holds (the build's own .lock while it merges the
    manifest, an object's objects/KEY/.lock while it compiles), or None: `megakernel clean` refuses a directory a
    build is using. Each lock is tried without waiting (flock, non-blocking; read-only: a lock file of another user
    is still tested) and released at once."""
    for lock in [build_dir / ".lock", *sorted(build_dir.glob("objects/*/.lock"))]:
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue  # gone, or not ours to open: nothing a build holds here
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return lock
        finally:
            os.close(fd)  # (closing releases the lock)
    return None


@contextlib.contextmanager
def locked(build_dir: Path):
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_stale_temps(build_dir: Path, max_age_s: float = 3600.0) -> int:
    """Delete temporary files a killed build left behind (never under a final name), then the object directories
    left holding nothing but their lock (a compile interrupted before its first file). Only old ones: a build
    running beside this one may be writing its own right now. Returns the files and directories removed."""
    removed = 0
    if Path(build_dir).is_dir():
        for p in Path(build_dir).rglob(".*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                if time.time() - p.stat().st_mtime > max_age_s:
                    p.unlink()
                    removed += 1
        for obj in (Path(build_dir) / "objects").glob("*/"):
            lock = obj / ".lock"
            try:  # (every open of the lock refreshes its time: a compile waiting or running makes it fresh)
                if {p.name for p in obj.iterdir()} != {".lock"} or time.time() - lock.stat().st_mtime <= max_age_s:
                    continue
                fd = os.open(lock, os.O_RDWR)
            except OSError:
                continue
            try:  # only under the object's own lock, never while a compile holds it (compiled_object)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if {p.name for p in obj.iterdir()} == {".lock"}:
                    lock.unlink()
                    obj.rmdir()
                    removed += 1
            except OSError:
                pass
            finally:
                os.close(fd)
    return removed


REPLAN_TRIES = 12  # candidates compiled for a default plan that spills (a spill in the templates: ~5 s each here)
# A default plan spilling less than this (bytes of spill stores plus loads) is built as planned, warned: such spills
# cost -1 ... +1 % a layer on the H200, where the untimed re-plan that replaced them cost up to 7 % (bench/NOTES.md
# session 28: four Qwen3-like shapes at 8-156 B, the Mistral-Nemo-like b18 in session 25)
REPLAN_MIN_SPILL = 256


def build(variants: list[Variant], build_dir: str | Path = "build", **kw) -> dict:
    """Render and compile every variant for sm_`arch`; returns {"entries": [...], "errors": [...], "distinct": n}.

    Over-budget variants are refused before compiling (entry status "refused"); compile errors are collected per
    variant (status "error") so one bad variant does not hide the others. `progress(n, ok, names=, cached=,
    [refused=True])`: the refused variants first (once, where any), then per object: n
    variants (`names`) that share one binary finished (ok False: its compile failed; cached: it was up to date).
    Ctrl-C (KeyboardInterrupt) or a compiler interrupted by a signal (BuildInterrupted: SIGINT, SIGTERM, SIGHUP;
    compiler_killed) stops the build: no queued compile starts, and
    neither the manifest nor any variant's cubin is touched (they change together, at the end). `variants_file`
    (where the variants were declared) is recorded so that loading can tell when a declaration changed since.
    `tuning_file` (tuning/<gpu>.json): a variant with a valid entry there is built with its tuned plan; a bad or
    stale entry falls back to the default plan with a warning (result["warnings"]). `overrides` {name: {knob: int}}:
    plan overrides given directly (the tuner's candidates; a bad one refuses that variant). Each entry records
    "plan_source" ("default", "tuned (<file>)" or "override") and, where a tuning file was consulted, what it held
    for the variant ("tuning"), so a later change of that entry makes the build stale. `replan_spills`: a variant
    whose default plan compiles with REPLAN_MIN_SPILL bytes of register spills or more is built with the first of
    the tuner's first REPLAN_TRIES candidates (generator.tune.candidates) that compiles without (where none does, the
    one that spills least, if less than the default), warned, with plan_source "default (re-planned)" and the
    entry's "replanned" {"overrides", "default_spills"}; where none spills less, or the spills are fewer than
    REPLAN_MIN_SPILL, as planned, warned (the tuner passes False: it measures plans as given), and so is one
    whose tuning entry kept the default plan (overrides {}); their warnings are result["replans"]; `notify(line)` is
    told before that second round of compiles starts (the progress count is complete by then). Raises TargetError for an
    architecture the kernel cannot target. Keywords: jobs, arch, progress, variants_file, tuning_file, overrides,
    replan_spills, notify (those of _build). The directory is held in use (in_use) for the whole build.
    """
    with in_use(Path(build_dir)):
        return _build(variants, build_dir, **kw)


def _build(variants: list[Variant], build_dir: str | Path = "build", *, jobs: int | None = None,
           arch: str = DEFAULT_ARCH, progress=None, variants_file: str | Path | None = None,
           tuning_file: str | Path | None = None, overrides: dict[str, dict] | None = None,
           replan_spills: bool = True, notify=None) -> dict:
    """build's work (its docstring), under in_use."""
    from . import tune as gtune
    build_dir = Path(build_dir)
    target = get_arch(arch)
    digest = kernel_sources_digest()
    vfile = str(Path(variants_file).resolve()) if variants_file else None
    read_manifest(build_dir)  # a corrupt manifest is reported before any compile, not after
    remove_stale_temps(build_dir)
    jobs = jobs or os.cpu_count() or 1
    entries: dict[str, dict] = {}
    by_key: dict[str, list[tuple[Variant, dict]]] = {}
    sources: dict[str, str] = {}
    warnings: list[str] = []  # the tuning file's (they fail `build --strict`)
    replans: list[str] = []  # default plans that spilled (replan_spills)
    replaced: list[str] = []  # good builds of a tuned or overridden plan this build's refusal replaced
    # (variant, source): written with the manifest, so an interrupted build leaves each kernel.cu matching its cubin
    rendered: list[tuple[str, str]] = []
    # a file that is no tuning file warns once for the build and flags no variant (none had an entry to use)
    file_broken = tuning_file is not None and Path(tuning_file).exists() and \
        gtune.tuning_problem(Path(tuning_file)) is not None

    def attach(v: Variant, entry: dict, p: dict, src: str | None = None) -> str:
        """The entry's plan and source (rendered here unless given); returns their object's key."""
        src = src if src is not None else render(v, p)
        key = cache_key(src, arch)
        sources[key] = src
        entry.update(key=key, plan=p, source_sha256=hashlib.sha256(src.encode()).hexdigest(),
                     source=f"{v.name}/kernel.cu", cubin=f"{v.name}/kernel.cubin", object=f"objects/{key}")
        return key

    for v in variants:
        entry = {"name": v.name, "params": v.params(), "status": "ok", "arch": target.sm,
                 "identity": identity(v.params(), target.sm), "sources_sha256": digest, "variants_file": vfile,
                 "plan_source": "default", "tuning": None, "tuned_figures": None}
        entries[v.name] = entry
        ov = (overrides or {}).get(v.name) or {}
        if ov:
            entry["plan_source"] = "override"
        elif tuning_file is not None:
            ov, entry["plan_source"], entry["tuned_figures"], warn = gtune.resolve(v, target.sm, Path(tuning_file))
            entry["tuning"] = {"file": gtune.display(Path(tuning_file)),
                               "overrides": gtune.raw_overrides(Path(tuning_file), v.name)}
            if warn:
                if warn not in warnings:  # a broken file says the same for every variant: once
                    warnings.append(warn)
                if not file_broken:  # this variant's entry was not used
                    entry["tuning_warning"] = warn  # the report flags it after the build's output has scrolled away
        try:
            p = plan(v, target.sm, overrides=ov)
        except PlanError as exc:
            entry.update(status="refused", error=str(exc))
            continue
        key = attach(v, entry, p)
        rendered.append((v.name, sources[key]))
        by_key.setdefault(key, []).append((v, entry))

    def one(key):
        return (key, *compiled_object(sources[key], key, arch, build_dir))

    def replan_spilled(v: Variant, entry: dict, pool: ThreadPoolExecutor) -> None:
        """A default plan that spills: the first of the tuner's first REPLAN_TRIES candidates that compiles without
        spills, in its place (compiled `jobs` at a time, in candidate order: the first few usually do)."""
        r = entry["resources"]
        spilled = f"{r['spill_stores']} B of spill stores, {r['spill_loads']} B of loads"
        cands = gtune.candidates(v, target.sm)[1:REPLAN_TRIES + 1]
        found = least = None  # least: the candidate that spills least, where none compiles without
        for i in range(0, len(cands), jobs):
            batch = []
            for ov in cands[i:i + jobs]:
                p = plan(v, target.sm, overrides=ov)  # the candidates are plans the planner accepts
                src = render(v, p)
                key = cache_key(src, arch)
                sources[key] = src
                batch.append((ov, p, src, key, pool.submit(one, key)))
            for ov, p, src, key, fut in batch:
                try:
                    _, meta, cached = fut.result()
                except CompileError:
                    continue
                if not (meta["spill_stores"] or meta["spill_loads"]):
                    found = (ov, p, src, key, meta, cached)
                    break
                if least is None or meta["spill_stores"] + meta["spill_loads"] < least[0]:
                    least = (meta["spill_stores"] + meta["spill_loads"], (ov, p, src, key, meta, cached))
            if found:
                break
        if found is None and least is not None and least[0] < r["spill_stores"] + r["spill_loads"]:
            found = least[1]  # none compiles without: the one that spills least, if less than the default
        if found is None:
            replans.append(f"warning: {v.name}: its default plan spills ({spilled}) and none of the tuner's first "
                           f"{REPLAN_TRIES} candidates spills less: built as planned")
            return
        ov, p, src, key, meta, cached = found
        links.remove((entry["key"], v.name))
        rendered.remove((v.name, sources[entry["key"]]))
        attach(v, entry, p, src)
        rendered.append((v.name, sources[key]))
        links.append((key, v.name))
        entry.update(resources=resources(p, meta, cached), plan_source="default (re-planned)",
                     replanned={"overrides": ov, "default_spills": [r["spill_stores"], r["spill_loads"]]})
        left = meta["spill_stores"] + meta["spill_loads"]
        replans.append(f"warning: {v.name}: its default plan spills ({spilled}); built with plan overrides {ov}, "
                       + ("which compile without spills" if not left else
                          f"the least spilling of the tuner's first {REPLAN_TRIES} candidates ({meta['spill_stores']} "
                          f"B of spill stores, {meta['spill_loads']} B of loads; none compiles without)")
                       + " (untimed: `megakernel tune` on a GPU times it against the default and records the fastest "
                       "plan that does not spill)")

    def resources(p: dict, meta: dict, cached: bool) -> dict:
        smem = p["smem_bytes"]
        out = {
            **{k: meta[k] for k in ("cubin_bytes", "ptx_bytes", "registers", "stack_frame", "spill_stores",
                                    "spill_loads", "static_smem", "compile_s")},
            "dynamic_smem": smem,
            "smem_total": smem + meta["static_smem"],
            "smem_limit": target.smem_per_block,
            "smem_pct": round(100 * (smem + meta["static_smem"]) / target.smem_per_block, 1),
            "blocks_per_sm": blocks_per_sm(meta["registers"], p["threads"], smem + meta["static_smem"], target.sm),
            "cached": cached,
            "sass": meta.get("sass"),
            "wgmma_serialized": meta.get("wgmma_serialized", 0),
        }
        # the L1 left beside the resident blocks (the GEMV's weight loads are staged there: plan.l1_bytes)
        out["l1_bytes"] = l1_bytes(target, out["smem_total"], out["blocks_per_sm"])
        return out

    refused = [e["name"] for e in entries.values() if e["status"] == "refused"]
    if progress and refused:  # counted too, so the progress count reaches every variant
        progress(len(refused), ok=False, names=refused, cached=False, refused=True)
    pool = ThreadPoolExecutor(max_workers=jobs)
    links: list[tuple[str, str]] = []  # (object key, variant): cubins linked with the manifest's write, not before
    try:
        futures = {pool.submit(one, key): key for key in by_key}
        for fut in as_completed(futures):
            key = futures[fut]
            try:
                _, meta, cached = fut.result()
            except CompileError as exc:
                for v, entry in by_key[key]:
                    entry.update(status="error", error=f"{v.name}: nvcc failed:\n{exc}")
                if progress:
                    progress(len(by_key[key]), ok=False, names=[v.name for v, _ in by_key[key]], cached=False)
                continue
            for v, entry in by_key[key]:
                links.append((key, v.name))
                entry["resources"] = resources(entry["plan"], meta, cached)
            if progress:
                progress(len(by_key[key]), ok=True, names=[v.name for v, _ in by_key[key]], cached=cached)
    except BaseException:  # Ctrl-C, a compiler interrupted, or a fault here: no queued compile starts, nothing written
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    def spilled_default(e: dict) -> bool:  # a default plan that compiled with spills: replan_spills re-plans it
        r = e.get("resources") or {}
        # (also a tuning entry that plans the default, gtune.resolve: measured before a template change made it spill)
        return e["status"] == "ok" and e["plan_source"] == "default" and bool(r.get("spill_stores") or
                                                                             r.get("spill_loads"))

    def small(e: dict) -> bool:  # spills the re-plan leaves alone (REPLAN_MIN_SPILL)
        r = e["resources"]
        return r["spill_stores"] + r["spill_loads"] < REPLAN_MIN_SPILL

    unique = {v.name: v for v in variants}.values()  # a variant given twice is re-planned once
    spilling = [v for v in unique if spilled_default(entries[v.name])] if replan_spills else []
    for v in [v for v in spilling if small(entries[v.name])]:
        r = entries[v.name]["resources"]
        replans.append(f"warning: {v.name}: its default plan spills ({r['spill_stores']} B of spill stores, "
                       f"{r['spill_loads']} B of loads): built as planned (spills under {REPLAN_MIN_SPILL} B cost "
                       "about 1 % at most on the H200, less than an untimed re-plan; `megakernel tune` on a GPU "
                       "times the alternatives)")
    spilling = [v for v in spilling if not small(entries[v.name])]
    if spilling:
        if notify:
            notify(f"re-planning {len(spilling)} variant(s) whose default plan spills "
                   f"({', '.join(v.name for v in spilling[:3])}{' ...' if len(spilling) > 3 else ''}): compiling up "
                   f"to {REPLAN_TRIES} candidate plans each, {jobs} at a time (those compiled before are reused)")
        pool = ThreadPoolExecutor(max_workers=jobs)
        try:
            for i, v in enumerate(spilling):
                t0 = time.perf_counter()
                replan_spilled(v, entries[v.name], pool)
                if notify:  # one line a variant: re-planning a large one takes minutes
                    e = entries[v.name]
                    how = (f"built with {e['replanned']['overrides']}" if e["plan_source"] == "default (re-planned)"
                           else "no candidate without spills: built as planned")
                    notify(f"re-planned {v.name} ({i + 1}/{len(spilling)}, {time.perf_counter() - t0:.0f} s): {how}")
        except BaseException:  # as above: nothing written, no queued compile starts
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)

    # (a Ctrl-C from here on waits until the sources, cubins and manifest are all written: they stay consistent)
    with locked(build_dir), uninterrupted():  # (waiting for the lock stays interruptible)
        manifest = read_manifest(build_dir)
        old = manifest["variants"]
        # a variant refused (or failed) for another architecture leaves that variant's good build of its own as it
        # was, entry and source: an attempt at another --arch must not damage the build directory (its cubin is
        # still there)
        def other_arch(entry: dict) -> bool:  # built for another architecture ("90a" plans as 90)
            try:
                return get_arch(str(entry.get("arch"))).number != target.number
            except TargetError:
                return True
        # and so does one whose plan failed to compile (nothing lost: its kernel.cu, cubin and entry stay together)
        kept = {n for n, e in entries.items() if e["status"] != "ok" and isinstance(old.get(n), dict)
                and old[n].get("status") == "ok" and (other_arch(old[n]) or e["status"] == "error")}
        for n in sorted(kept):
            if entries[n]["status"] == "error" and not other_arch(old[n]):
                replaced.append(f"warning: {n}: this build's plan failed to compile (below); its previous build "
                                f"(the {old[n].get('plan_source', 'default')} plan) is kept")
        for name, src in rendered:
            if name not in kept:
                write_if_changed(build_dir / name / "kernel.cu", src)
        for key, name in links:
            _link(build_dir / "objects" / key / "kernel.cubin", build_dir / name / "kernel.cubin")
        for n, e in entries.items():  # a good build of a tuned or overridden plan replaced by a refusal: said
            was = old.get(n) if isinstance(old.get(n), dict) else {}
            src = str(was.get("plan_source", "default"))
            if n not in kept and e["status"] == "refused" and was.get("status") == "ok" \
                    and was.get("identity") == e["identity"] and (src.startswith("tuned") or src == "override"):
                used = (was.get("tuning") or {}).get("file") if src.startswith("tuned") else None
                now = (e.get("tuning") or {}).get("file")
                keep = f" (build with --tuned-for {shlex.quote(str(tuning_path(used)))} to keep it)" \
                    if used and (now is None or tuning_path(now) != tuning_path(used)) else ""
                replaced.append(f"warning: {n}: refused with this build's plan; its build of the {src} plan is "
                                f"replaced{keep}")
        manifest["variants"].update({n: e for n, e in entries.items() if n not in kept})
        if any(e["status"] == "ok" for e in entries.values()) or "arch" not in manifest:
            manifest["arch"] = arch  # the last architecture built here (each entry records its own)
        manifest.update(compiler=compiler_version(), package_version=__version__)
        atomic_write(build_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    distinct = {e["key"] for e in entries.values() if e.get("key")}  # after re-planning: the objects in use
    return {"entries": list(entries.values()), "distinct": len(distinct), "warnings": warnings, "replans": replans,
            "replaced": replaced, "errors": [e for e in entries.values() if e["status"] == "error"]}

