"""Variant -> plan (the mode's planner: every compile-time constant, the shared-memory layout, the workspace)
-> rendered CUDA source (one self-contained file).

Jinja renders only the config (templates/config.cuh.j2: constants, types, flags) and the kernel's entry
(templates/kernel.cu.j2: the parameter list from generator.interface, the mode's steps and barriers). The stages are
plain CUDA headers (templates/stages/<stage>.cuh) that an editor and nvcc open alone; they are pasted in here, each
once, so build/<name>/kernel.cu is the whole kernel.
"""
from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import jinja2

from . import host, interface
from .modes import MODES
from .plan import PlanError  # noqa: F401  (re-exported: callers catch render.PlanError)
from .plan import kernels, open_barriers
from .targets import DEFAULT_ARCH, DTYPES, arch as get_arch
from .variants import INT_MAX, Variant

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.M)


def plan(v: Variant, arch: str = DEFAULT_ARCH, overrides: dict | None = None) -> dict:
    """The mode's plan for `v` on sm_`arch`, plus what every mode's plan holds: threads, smem_bytes, grid_syncs,
    the workspace layout (generator.interface) and the arch. `overrides` {knob: int} replace knobs the mode's
    planner would choose (generator.tune; only modes whose planner takes `overrides`); the planner validates them
    and derives every dependent constant. Raises PlanError or targets.TargetError (one line)."""
    mode = MODES[v.mode]
    a = get_arch(arch)
    if overrides:
        if "overrides" not in inspect.signature(mode.plan).parameters:
            raise PlanError(f"{v.name}: mode {mode.name} takes no plan overrides (got {', '.join(sorted(overrides))})")
        p = mode.plan(v, a, overrides=overrides)
    else:
        p = mode.plan(v, a)
    p.setdefault("overrides", {})
    ks = kernels(mode, v.tp)
    syncs = sum(open_barriers(mode.steps[k["first"]:k["first"] + len(k["steps"])], p["consts"]) for k in ks)
    p.update(mode=mode.name, arch=a.sm, grid_syncs=syncs, kernels=ks, tp=v.tp, steps=[s.stage for s in mode.steps],
             workspace=interface.workspace_layout({**p["consts"], "ROWS": p["rows"], **p["sizes"]}))
    # every constant is a C int in the kernel, and so is every buffer's element count: a larger shape would wrap
    elements = {f"workspace buffer '{k}' ({' x '.join(map(str, b['shape']))} elements)": math.prod(b["shape"])
                for k, b in p["workspace"]["buffers"].items()}
    for what, val in {**p["consts"], **p["sizes"], **elements}.items():
        if isinstance(val, int) and abs(val) > INT_MAX:
            raise PlanError(f"{v.name}: {what} = {val} is over a C int ({INT_MAX}), as every size in the kernel is: "
                            "a smaller shape (hidden, heads x head_dim, intermediate, batch x tokens a launch, or "
                            "seq_len)")
    return p


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, autoescape=False)


def _config_vars(v: Variant, p: dict) -> dict:
    m = v.shard
    dt = DTYPES[m.dtype]
    return dict(name=v.name, consts=p["consts"], tmaps=interface.TENSOR_MAPS, tmap_bytes=interface.TENSOR_MAP_BYTES,
                dtype=dt, t_max=f"{dt.max_finite!r}f",
                norm_eps=f"{m.norm_eps!r}f", score_scale=f"{math.log2(math.e) / math.sqrt(m.head_dim)!r}f",
                rope_attn=f"{host.rope_attention(m)!r}f",
                norm=m.norm, activation=m.activation, qkv_bias=m.qkv_bias, qk_norm=m.qk_norm,
                timeline_slots=interface.TIMELINE_SLOTS, timeline_att=interface.TIMELINE_ATT)


def render_config(v: Variant, p: dict) -> str:
    """templates/config.cuh.j2 for `v`: the constants, types and flags every header reads."""
    return _env().get_template("config.cuh.j2").render(**_config_vars(v, p))


# what a stage header includes when opened alone (an editor, nvcc): the config of one default variant per mode
EXAMPLES = {"decode": ("llama3.2-1b_decode_b1_s4096_bf16", "example_config.cuh"),
            "prefill": ("llama3.2-1b_prefill_b1_s64_bf16", "example_config_prefill.cuh")}


def write_example_configs(variants_file: str | Path = TEMPLATES.parent / "variants.yaml") -> list[Path]:
    """Rewrite the EXAMPLES configs from their renders:
    `python -c "import generator.render as r; r.write_example_configs()"`."""
    from .variants import load
    declared = {v.name: v for v in load(variants_file)}
    out = []
    for name, file in EXAMPLES.values():
        v = declared[name]
        text = render_config(v, plan(v)).replace(
            "// ---- config (generated", f"// ---- example config of {name} (for opening a header alone; generated", 1)
        (TEMPLATES / file).write_text(text)
        out.append(TEMPLATES / file)
    return out


def _inline(text: str, base: Path, seen: set) -> str:
    """Replace each quoted #include with the file's text, once per file (#pragma once), recursively."""
    def sub(mt):
        path = (base / mt.group(1)).resolve()
        if path in seen:
            return ""
        seen.add(path)
        body = path.read_text().replace("#pragma once\n", "")
        return _inline(body, path.parent, seen)
    return _INCLUDE.sub(sub, text)


def render(v: Variant, p: dict | None = None) -> str:
    """The whole CUDA source of variant `v` (plan `p`, or planned for sm_90)."""
    p = p or plan(v)
    mode = MODES[p["mode"]]
    top = _env().get_template("kernel.cu.j2").render(mode=mode, kernels=p["kernels"], params=interface.c_params(),
                                                     clock_slots=interface.CLOCK_SLOTS,
                                                     **_config_vars(v, p))
    # the config is already at the top: the example configs are never pasted in
    return _inline(top, TEMPLATES, {(TEMPLATES / file).resolve() for _, file in EXAMPLES.values()})
