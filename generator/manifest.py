"""build/manifest.json: what a build recorded about each variant, read without the renderer (no Jinja, no
templates needed), so a build directory can be loaded on its own.

A variant's build is current when (1) the parameters it was built from equal the ones declared now (every field,
rope_theta and rope_scaling included: the host computes some of them, so the source hash alone cannot tell), and
(2) the files that decide a kernel's source (KERNEL_SOURCES) hash to what they hashed at build time, where that
source tree is present.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from pathlib import Path

from .variants import Model, Variant

MANIFEST = "manifest.json"
ROOT = Path(__file__).resolve().parent.parent
# what decides a kernel's source besides its parameters
KERNEL_SOURCES = ("templates", "generator/render.py", "generator/plan.py", "generator/interface.py",
                  "generator/targets.py", "generator/modes")
# not a layer's: the served model's head and draw (generator.lm_head, generator.sampler), whose objects are keyed
# by their own source
NOT_KERNEL_SOURCES = ("templates/lm_head.cu", "templates/sample.cu", "templates/argmax.cuh")


class ManifestError(ValueError):
    """build/manifest.json exists but cannot be read: one line saying how to recover."""


class LoadError(RuntimeError):
    """The build for a variant is missing, stale, corrupt or for another GPU (the message says which command
    fixes it)."""


def build_dir_flag(build_dir) -> str:
    """" --build-dir DIR" for a suggested command, or "" for the CLI's default `build` (a bare command must not act
    on another directory than the one the message is about: `megakernel clean` removes ./build)."""
    return "" if Path(build_dir) == Path("build") else f" --build-dir {shlex.quote(str(build_dir))}"


# what a build writes at the top of its directory (besides the variants' directories and its temporary files), and
# bench/e2e.py's declaration of a checkpoint's own variants, which their manifest entries name (e2e.variants_for)
BUILD_FILES = {"manifest.json", "objects", "report.json", "report.csv", ".lock", ".busy", "e2e-variants.yaml"}
VARIANT_DIR = re.compile(r".+_(decode|prefill)_b\d+_s\d+_[a-z0-9]+(_tp\d+)?")  # a variant's name (variants.py)
BUILD_TEMP = re.compile(r"\.(manifest\.json|report\.json|report\.csv)\..+\.tmp")  # compile.atomic_write's
OBJECT_DIR = re.compile(r"[0-9a-f]{20}")  # an object's key (compile.cache_key)


def foreign_entries(build_dir: Path, variants: set[str] = frozenset()) -> list[str]:
    """The names in `build_dir` that a build does not write (its manifest, objects/ of object directories, reports,
    locks, temporary files, a directory per variant: one of `variants` or named as a variant is), sorted."""
    p = Path(build_dir)
    objects = [f"objects/{e.name}" for e in (p / "objects").iterdir() if not (e.is_dir() and OBJECT_DIR.fullmatch(
        e.name))] if (p / "objects").is_dir() else []
    return sorted(objects + [e.name for e in p.iterdir() if not (
        e.name in BUILD_FILES and (e.is_dir() if e.name == "objects" else e.is_file())  # (a kind a build makes)
        or e.is_dir() and (e.name in variants or VARIANT_DIR.fullmatch(e.name))
        or e.is_file() and BUILD_TEMP.fullmatch(e.name))])


def tuning_path(shown: str) -> Path:
    """A tuning file's path as a manifest records it (tune.display: relative to the source tree where under it)."""
    return Path(shown) if Path(shown).is_absolute() else ROOT / shown


def not_a_build(build_dir: Path) -> str | None:
    """Why `megakernel clean` would not remove the directory (it holds something a build does not write, or a
    manifest.json that is not a build's), or None where everything in it is a build's. A corrupt manifest counts as
    a build's only beside a build's objects/; no manifest, only with the objects/ a served model's head compiled."""
    p = Path(build_dir)
    try:
        doc = json.loads((p / MANIFEST).read_text())
    except FileNotFoundError:
        doc = {}
    except (OSError, ValueError, UnicodeDecodeError):
        doc = None  # unreadable or corrupt: a build's only with objects/ beside it
    if doc is None and not (p / "objects").is_dir() or doc is not None and doc != {} and not (
            isinstance(doc, dict) and isinstance(doc.get("variants"), dict) and "package_version" in doc):
        return "its manifest.json is not a megakernel build's"
    if (p / "objects").is_dir() and not all(e.is_dir() and OBJECT_DIR.fullmatch(e.name)
                                            for e in (p / "objects").iterdir()):
        return "does not look like a megakernel build directory (objects/ holds what a build does not write)"
    if doc == {} and not all(e.name in (".lock", ".busy", "objects") or e.is_file() and BUILD_TEMP.fullmatch(e.name)
                             for e in p.iterdir()):
        return ("does not look like a megakernel build directory (no build's manifest.json, and files a build does "
                "not write)")
    foreign = foreign_entries(p, set(doc["variants"]) if doc else set())
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        return f"does not look like a megakernel build directory (it holds {shown}, which a build does not write)"
    return None


def read_manifest(build_dir: Path) -> dict:
    """The manifest's JSON ({"variants": {}} where there is none). Raises ManifestError when unreadable."""
    path = Path(build_dir) / MANIFEST
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {"variants": {}}
    except (ValueError, UnicodeDecodeError):
        doc = None
    def entry_ok(e) -> bool:  # what readers take as given of an entry (a hand-edited one: corrupt, not a traceback)
        return isinstance(e, dict) and isinstance(e.get("status"), str) and isinstance(e.get("resources") or {}, dict) \
            and (e["status"] != "ok" or all(isinstance(e.get(k), t) for k, t in
                                            (("cubin", str), ("object", str), ("resources", dict))))
    if not isinstance(doc, dict) or not isinstance(doc.get("variants"), dict) \
            or not all(entry_ok(e) for e in doc["variants"].values()):
        fix = (f"run `megakernel clean{build_dir_flag(build_dir)}` and build again"
               if not not_a_build(build_dir) else "remove it and build again")  # (the advice that works)
        raise ManifestError(f"{path}: corrupt manifest (not the JSON a build writes); {fix}")
    return doc


def kernel_sources_digest(root: Path | None = None) -> str | None:
    """sha256 over every file of KERNEL_SOURCES under `root` (default: this package's tree); None where that
    source tree is absent (a build directory shipped without the generator)."""
    root = root or ROOT
    if not (root / "templates").is_dir():
        return None
    h = hashlib.sha256()
    for rel in KERNEL_SOURCES:
        p = root / rel
        files = sorted(f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts) if p.is_dir() else [p]
        for f in files:
            if str(f.relative_to(root)) in NOT_KERNEL_SOURCES:
                continue
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def identity(params: dict, arch: str) -> str:
    """sha256 of a variant's every parameter and its arch: equal identities build the same kernel from the same
    kernel sources."""
    return hashlib.sha256(json.dumps({"params": params, "arch": arch}, sort_keys=True).encode()).hexdigest()


def variant_from_entry(entry: dict) -> Variant:
    """The Variant a manifest entry was built from."""
    p = dict(entry["params"])
    mode, batch, seq_len, tp = p.pop("mode"), p.pop("batch"), p.pop("seq_len"), p.pop("tp", 1)
    rs = p.pop("rope_scaling")
    return Variant(Model(**p, rope_scaling=tuple(sorted(rs.items())) if rs else None), mode, batch, seq_len, tp)


def changed_fields(entry: dict, v: Variant) -> list[str]:
    """The parameters of `v` (as declared now) that differ from those its build recorded."""
    built, now = entry.get("params", {}), v.params()
    return sorted(k for k in set(built) | set(now) if built.get(k) != now.get(k))


def status(entry: dict | None, v: Variant | None = None, digest: str | None = None) -> str:
    """"not built", "refused", "error", "stale (<fields>)", "stale (templates)" or "built" for a manifest entry,
    against the variant as declared now (`v`) and the kernel sources' digest now (`digest`; None: not checked)."""
    if entry is None:
        return "not built"
    if entry["status"] != "ok":
        return entry["status"]
    if v is not None:
        fields = changed_fields(entry, v)
        if fields:
            return f"stale ({', '.join(fields)})"
    if digest is not None and entry.get("sources_sha256") != digest:
        return "stale (templates)"
    if digest is not None and tuning_changed(entry):
        return "stale (tuning)"
    return "built"


def cubin_problem(entry: dict, build_dir: str | Path) -> str | None:
    """"missing" or "damaged" (its size is not the one compiled: a cheap check, `build` compares the hash) for a
    built entry's cubin; None where it is there whole."""
    p = Path(build_dir) / entry.get("cubin", f"{entry.get('name')}/kernel.cubin")
    if not p.is_file():
        return "missing"
    want = (entry.get("resources") or {}).get("cubin_bytes")
    return "damaged" if isinstance(want, int) and p.stat().st_size != want else None


def tuning_changed(entry: dict) -> bool:
    """Whether the tuning file the build consulted (entry["tuning"]: its path and what it held for the variant)
    holds something else for it now (a new, changed or removed entry: a build now would plan differently)."""
    t = entry.get("tuning")
    if not t:
        return False
    path = tuning_path(t["file"])
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = {}
    e = doc.get(entry["name"]) if isinstance(doc, dict) else None
    now = e.get("overrides") if isinstance(e, dict) else e
    return now != t.get("overrides")


def rebuild_advice(build_dir: Path, name: str, entry: dict) -> str:
    """"run `megakernel build ...`" that rebuilds variant `name` from the inputs its manifest `entry` records: its
    variants file (where not ./variants.yaml) and its tuning file (always, as an absolute path: which file a bare
    build picks depends on what tuning/ holds and on the directory it runs in)."""
    vf, tf = entry.get("variants_file"), (entry.get("tuning") or {}).get("file")
    return (f"run `megakernel build{build_dir_flag(build_dir)} --only '{name}'"
            + (f" --variants {shlex.quote(str(vf))}" if vf and Path(vf) != Path("variants.yaml").resolve() else "")
            + (f" --tuned-for {shlex.quote(str(tuning_path(tf)))}" if tf else "") + "`")


def find_entry(name: str, build_dir: str | Path, v: Variant | None = None) -> tuple[dict, Path]:
    """The manifest entry and cubin path of variant `name`, checked: present, built, current (against `v` if
    given, else the variants file the build recorded, where it exists; and against the kernel sources, where they
    exist) and intact. Raises LoadError naming the build command."""
    from . import variants as gvariants
    if not isinstance(build_dir, (str, os.PathLike)):
        raise LoadError(f"{name}: build_dir={build_dir!r}: a directory path (str or Path)")
    build_dir = Path(build_dir)
    fix = f"run `megakernel build{build_dir_flag(build_dir)} --only '{name}'`"
    if build_dir.exists() and not build_dir.is_dir():
        raise LoadError(f"{name}: build_dir {build_dir} is not a directory (a build directory holds manifest.json)")
    try:
        manifest = read_manifest(build_dir)
    except ManifestError:
        raise LoadError(f"{name}: {build_dir}/manifest.json is corrupt: {fix}") from None
    if not (build_dir / MANIFEST).exists():
        raise LoadError(f"{name}: no build in {build_dir}/ (no manifest.json): {fix} (with `--variants FILE` where "
                        "it is declared in a file of your own)")
    entry = manifest["variants"].get(name)
    if entry is not None:
        fix = rebuild_advice(build_dir, name, entry)
    if entry is None:
        raise LoadError(f"{name}: not in {build_dir}/manifest.json: declare it in variants.yaml and {fix} (or "
                        f"in a file of your own, built with `--variants FILE`)")
    if entry["status"] != "ok":
        why = (entry.get("error") or "no reason recorded").splitlines()[0]
        raise LoadError(f"{name}: its build {entry['status']}: {why}")
    if v is None and entry.get("variants_file"):
        try:  # the declaration the build came from, as it reads now (a removed or broken file: not checked)
            v = next((d for d in gvariants.load(entry["variants_file"]) if d.name == name), None)
        except gvariants.VariantError:
            v = None
    st = status(entry, v, kernel_sources_digest())
    if st == "stale (templates)":
        raise LoadError(f"{name}: build is stale (templates or generator changed since it was built): {fix}")
    if st == "stale (tuning)":
        raise LoadError(f"{name}: build is stale ({entry['tuning']['file']} changed its plan since it was built): "
                        f"{fix}")
    if st != "built":
        what = st[len("stale ("):-1]
        raise LoadError(f"{name}: build is stale ({what} changed in {entry.get('variants_file')} since it was "
                        f"built): {fix}")
    cubin = build_dir / entry["cubin"]
    meta_path = build_dir / entry["object"] / "meta.json"
    try:
        ok = hashlib.sha256(cubin.read_bytes()).hexdigest() == json.loads(meta_path.read_text())["cubin_sha256"]
    except (OSError, ValueError, KeyError):
        ok = False
    if not ok:
        raise LoadError(f"{name}: {cubin} is missing or corrupt: {fix}")
    return entry, cubin
