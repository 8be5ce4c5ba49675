"""The kernel's interface, written once as data: the C parameter list, the weights it takes (HF names, how they are
packed), and the workspace buffers (element type, shape, alignment). The renderer prints the parameter list from
ARGS, the build records every buffer's offset in the manifest (workspace_layout), and the loader builds the
launch's argument tuple and carves its workspace from that same record. Adding a buffer is one line in WORKSPACE.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from .variants import Model

ALIGN = 256  # bytes: every workspace buffer starts on a 256-byte boundary (16-byte vector loads, cp.async)


@dataclasses.dataclass(frozen=True)
class Arg:
    """One kernel parameter. ctype uses T for the activation dtype's element type."""
    name: str
    ctype: str
    role: str              # input | output | weight | param | cache | workspace
    optional: bool = False  # passed as a null pointer where the model has no such tensor


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A workspace buffer: ctype elements, shape from the plan's constants (so one line serves every mode)."""
    name: str
    ctype: str
    shape: Callable[[dict], tuple[int, ...]]
    doc: str


CTYPE_BYTES = {"T": 2, "float": 4, "unsigned": 4, "long long": 8}
CLOCK_SLOTS = 16  # SM-clock stamps in the clock buffer (plan.kernels places them); two global-timer ones follow
TIMELINE_SLOTS = 24  # decode TIMELINE: a block's stamps (entry, after the launch's wait, each step's end and barrier,
TIMELINE_ATT = 16    # then from here attention's phases in its last task that walks rows: TIMELINE_ATT_PHASES)
TIMELINE_ATT_PHASES = ("task start", "position loaded", "qkv in", "queries ready", "walk end", "warp states",
                       "warps combined", "task end")

# Every buffer is sized from the plan's constants and ROWS (the plan's token rows per launch: batch for decode):
# QKV_DIM, Q_DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, ATT_NSPLIT, COUNTERS, XN_ROWS (decode: 0 unless NORM_GLOBAL), Q_ROWS
# and SPLIT_FLOATS (0 in decode where no GEMV splits K), XF_ROWS (decode: rows of a fragment-ordered buffer; prefill:
# the GEMM inputs' rows, whole token tiles), the decode-only HB_ROWS and HSQ_TILES, and on sm_90a prefill
# (GEMM_WGMMA; decode: GEMM_PROJ, then GEMM_XROWS too) the GEMM inputs' columns padded to 64 (their tiled layout,
# from_tiles).


def on_engine(c: dict, prefix: str) -> bool:
    """Whether a decode plan's constants `c` run projection `prefix` ("QKV", "O", "GU", "DOWN") on the GEMM engine:
    under GEMM_PROJ gate_up always, qkv_proj, o_proj and down_proj by <P>_GEMM (a plan from before those knobs: qkv,
    o and gate_up on it, down_proj a GEMV; generator.modes.decode GEMM_PROJECTIONS, GEMM_OPTIONAL)."""
    return bool(c.get("GEMM_PROJ")) and bool(c.get(f"{prefix}_GEMM", int(prefix != "DOWN")))


def _gemm_cols(c: dict, k: int) -> int:
    """Columns of a GEMM engine's input buffer (prefill's; decode GEMM_PROJ's xn, and attn where O_GEMM): whole
    64-wide blocks where tiled (sm_90a, GEMM_WGMMA)."""
    return -(-k // 64) * 64 if c.get("GEMM_WGMMA") else k


WORKSPACE: tuple[Buffer, ...] = (
    Buffer("qkv", "float", lambda c: ((c["ROWS"], c["QKV_DIM"]) if c.get("QKV_FLOW") != 2  # QKV_FLOW 2: 64-bit words,
                                      else (c.get("QKV_KSPLIT", 1) * c["ROWS"], 2 * c["QKV_DIM"])),  # a set a split
           "raw q|k|v rows of every token (fp32, pre-RoPE; decode QKV_FLOW 2: each a 64-bit word, the value in its low "
           "half, the launch's epoch in the high, and with QKV_KSPLIT a set of rows a split, summed by attention)"),
    Buffer("part", "float", lambda c: (c["ROWS"] * c["HEADS"] * c["ATT_NSPLIT"],
                                       (c["HEAD_DIM"] + 2) * (1 + (c.get("ATT_COMBINE") == 4))),
           "attention split partials: acc[head_dim], max, sum (decode ATT_COMBINE 4: each a 64-bit word, the value "
           "in its low half, the launch's count in the high)"),
    Buffer("count", "unsigned", lambda c: (c["COUNTERS"],), "splits finished per (token, kv head) or GEMM tile"),
    Buffer("ready", "unsigned", lambda c: (c["KV_HEADS"] + c.get("ACT_CHUNKS", 0) * c.get("ACT_STRIDE", 1),),
           "decode QKV_FLOW: qkv tiles written per KV head (attention waits on its head's); DOWN_FLOW: then gate_up "
           "tiles written per chunk of act (down_proj waits on a chunk's); o_proj zeroes them (ATT_LL: QKV_FLOW's in "
           "gate_up)"),
    Buffer("attn", "T", lambda c: ((c["GEMM_XROWS"], _gemm_cols(c, c["Q_DIM"])) if on_engine(c, "O")
                                   else (c.get("XF_ROWS", c["ROWS"]),  # (decode GEMM_PROJ, O_GEMM 0: not tiled)
                                         (c["Q_DIM"] if c.get("GEMM_PROJ") else _gemm_cols(c, c["Q_DIM"]))
                                         * (1 + bool(c.get("ATT_LL"))))),
           "attention output (decode X_FRAG: in fragment order, from_frag; ATT_LL: each element a 32-bit word, its "
           "value in the low half, the launch's epoch in the high; sm_90a prefill and decode GEMM_PROJ's o_proj on the "
           "engine (O_GEMM): tiled, from_tiles)"),
    Buffer("h", "float", lambda c: (c["ROWS"], c["HIDDEN"]), "residual after o_proj (fp32)"),
    Buffer("hb", "T", lambda c: (c.get("HB_ROWS", 0), c["HIDDEN"] * (1 + bool(c.get("H_LL")))),
           "decode HB_COPY (tp = 1, bf16): h rounded to T, what the second norm reads (half the bytes, no registers); "
           "with H_STATS times the second norm's gain; H_LL: each a 32-bit word, the value in its low half, the "
           "launch's epoch in the high"),
    Buffer("act", "T", lambda c: ((c["GEMM_XROWS"], _gemm_cols(c, c["INTER"])) if on_engine(c, "DOWN")
                                  else (c.get("XF_ROWS", c["ROWS"]),  # (decode GEMM_PROJ, DOWN_GEMM 0: not tiled)
                                        (c["INTER"] if c.get("GEMM_PROJ") else _gemm_cols(c, c["INTER"]))
                                        * (1 + (c.get("DOWN_FLOW") == 2)))),
           "act(gate) * up (decode X_FRAG: in fragment order, from_frag; DOWN_FLOW 2: each element a 32-bit word, its "
           "value in the low half, the launch's epoch in the high; sm_90a prefill and decode GEMM_PROJ's down_proj on "
           "the engine (DOWN_GEMM): tiled, from_tiles)"),
    Buffer("xn", "T", lambda c: (c["XN_ROWS"], _gemm_cols(c, c["HIDDEN"])),
           "normalised token rows (prefill: the GEMMs read them; sm_90a: tiled, from_tiles; decode NORM_GLOBAL: in "
           "fragment order, from_frag; decode GEMM_PROJ: tiled, from_tiles: gate_up's rows, sharing the buffer with the "
           "first norm's, which are in qkv_proj's layout: tiled where QKV_GEMM, else fragment order)"),
    Buffer("q", "T", lambda c: (c.get("Q_ROWS", c["XN_ROWS"]), c["Q_DIM"]),
           "prepared queries (prefill: normed, RoPE, scaled)"),
    Buffer("split", "float", lambda c: (c["SPLIT_FLOATS"],),
           "split-K partial sums of the GEMMs (prefill) and GEMVs (decode)"),
    Buffer("clock", "long long", lambda c: (CLOCK_SLOTS + 2,),
           "block 0's SM clock at each step boundary (up to 15 steps), then the global timer (ns) at the last "
           "launch's first and last stamp"),
    Buffer("status", "unsigned", lambda c: (4,), "[0]: values that overflowed the dtype (inf) since reset"),
    Buffer("hsq", "float", lambda c: (c.get("HSQ_TILES", 0), c["ROWS"]),
           "decode H_STATS: per 16-row o_proj tile and row, the sum of squares of h (the second norm's statistics)"),
    Buffer("timeline", "long long", lambda c: (c.get("TL_BLOCKS", 0), TIMELINE_SLOTS),
           "decode TIMELINE: per block, the global timer (ns) at its entry, after the launch's wait, then at each "
           "step's end and after its grid barrier (0 where the step has none), then at attention's phases "
           "(TIMELINE_ATT_PHASES; 0 where the block walked no rows); bench/timeline.py reads it"),
    Buffer("epoch", "unsigned", lambda c: (1,),
           "decode ATT_LL, QKV_FLOW 2, H_LL, ATT_COMBINE 4: launches so far (block 0 advances it: gate_up, or with "
           "H_LL down_proj); the LL words carry (this + 1) mod 2^16, ATT_COMBINE 4's partials this + 1"),
    Buffer("gridbar", "unsigned", lambda c: (0 if c.get("COOP", 1) else 1,),
           "decode COOP 0: the grid barrier's word, arrivals in its low 31 bits (0 between barriers), its top bit "
           "flipped by each barrier (templates/common.cuh grid_barrier)"),
)

ARGS: tuple[Arg, ...] = (
    Arg("x", "const T*", "input"),
    Arg("pos", "const int*", "input"),
    Arg("out", "T*", "output"),
    Arg("w_qkv", "const T*", "weight"),
    Arg("b_qkv", "const T*", "weight", optional=True),
    Arg("q_norm_w", "const T*", "weight", optional=True),
    Arg("k_norm_w", "const T*", "weight", optional=True),
    Arg("ln1_w", "const T*", "weight"),
    Arg("ln1_b", "const T*", "weight", optional=True),
    Arg("w_o", "const T*", "weight"),
    Arg("ln2_w", "const T*", "weight"),
    Arg("ln2_b", "const T*", "weight", optional=True),
    Arg("w_gu", "const T*", "weight"),
    Arg("w_down", "const T*", "weight"),
    Arg("inv_freq", "const float*", "param"),
    Arg("k_cache", "T*", "cache"),
    Arg("v_cache", "T*", "cache"),
    Arg("cache_len", "int", "param"),  # rows per sequence of the caches (decode: SEQ_LEN, a constant there)
    Arg("tp_rank", "int", "param"),    # this GPU's rank in the tensor-parallel group (0 when TP = 1)
    *(Arg(f"ws_{b.name}", f"{b.ctype}*", "workspace") for b in WORKSPACE),
    # sm_90a prefill: a TMA tensor map (128 B, cuTensorMapEncodeTiled) of each weight in TENSOR_MAPS, in that order,
    # written by the loader (null where the plan's GEMM has none: decode, mma.sync)
    Arg("w_tmaps", "const unsigned char*", "param", optional=True),
    # decode attention with ATT_TMA: the TMA tensor maps of k_cache and v_cache (KV_TENSOR_MAPS), written by the loader
    Arg("kv_tmaps", "const unsigned char*", "param", optional=True),
)

# the weights the prefill GEMM reads by TMA tensor maps (w_tmaps), in order: config.cuh's TMAP_<NAME> is the index
TENSOR_MAPS = ("w_qkv", "w_o", "w_gu", "w_down")
TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap), 64-byte aligned
# decode attention's (ATT_TMA) cache maps in kv_tmaps, in order: each cache [batch x kv_heads x rows, head_dim] with a box
# of 16 rows x 64 dims in the 128-byte swizzle (templates/stages/attention.cuh; the loader's _cache_maps)
KV_TENSOR_MAPS = ("k_cache", "v_cache")


def c_params() -> str:
    """The kernel's C parameter list (ARGS in order); pointers that the kernel only reads are __restrict__."""
    def restrict(a):
        return "__restrict__ " if a.ctype.startswith("const") and "*" in a.ctype else ""
    return ",\n    ".join(f"{a.ctype} {restrict(a)}{a.name}" for a in ARGS)


def workspace_layout(consts: dict) -> dict:
    """{"buffers": {name: {"offset", "bytes", "ctype", "shape"}}, "bytes": total}: offsets ALIGN-aligned."""
    out, total = {}, 0
    for b in WORKSPACE:
        shape = tuple(int(s) for s in b.shape(consts))
        n = 1
        for s in shape:
            n *= s
        nbytes = n * CTYPE_BYTES[b.ctype]
        out[b.name] = {"offset": total, "bytes": nbytes, "ctype": b.ctype, "shape": list(shape)}
        total += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return {"buffers": out, "bytes": total}


# ---- weights: HF names in, packed kernel arguments out ----

def weight_shapes(m: Model) -> dict[str, tuple[int, ...]]:
    """Every tensor one layer of model `m` has, named as in HF transformers (LlamaDecoderLayer and kin), with its
    shape ([out_features, in_features] for projections)."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    shapes = {
        "input_layernorm.weight": (m.hidden,),
        "self_attn.q_proj.weight": (q, m.hidden),
        "self_attn.k_proj.weight": (kv, m.hidden),
        "self_attn.v_proj.weight": (kv, m.hidden),
        "self_attn.o_proj.weight": (m.hidden, q),
        "post_attention_layernorm.weight": (m.hidden,),
        "mlp.gate_proj.weight": (m.intermediate, m.hidden),
        "mlp.up_proj.weight": (m.intermediate, m.hidden),
        "mlp.down_proj.weight": (m.hidden, m.intermediate),
    }
    if m.norm == "layernorm":
        shapes["input_layernorm.bias"] = (m.hidden,)
        shapes["post_attention_layernorm.bias"] = (m.hidden,)
    if m.qkv_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if m.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (m.head_dim,), "self_attn.k_norm.weight": (m.head_dim,)})
    return shapes


# tensor parallel (Megatron-LM, arXiv:1909.08053): tensors split across the GPUs of a layer, and the dimension; the
# rest (norm weights, q/k norm) are replicated. Rows of q/k/v (and their biases) split by heads, gate/up by MLP
# columns; o_proj and down_proj split their input columns to match, so each GPU's product is a partial sum.
TP_SPLIT = {
    "self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0, "self_attn.v_proj.weight": 0,
    "self_attn.q_proj.bias": 0, "self_attn.k_proj.bias": 0, "self_attn.v_proj.bias": 0,
    "self_attn.o_proj.weight": 1,
    "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0, "mlp.down_proj.weight": 1,
}


def shard_weights(weights: dict, tp: int, rank: int) -> dict:
    """HF-named tensors of a whole layer -> the part GPU `rank` of `tp` holds (TP_SPLIT: contiguous blocks of heads
    and MLP columns; shapes as weight_shapes(variants.shard_model(m, tp))); others are passed through as they are."""
    if tp == 1:
        return dict(weights)
    out = {}
    for name, t in weights.items():
        dim = TP_SPLIT.get(name)
        out[name] = t if dim is None else t.chunk(tp, dim=dim)[rank].contiguous()
    return out


@dataclasses.dataclass(frozen=True)
class Packed:
    """A weight argument: HF tensors joined by `join` (cat: stacked rows; interleave: row i of each in turn), then
    stored in the variant's weight format if `matrix` (a projection), as is otherwise (norm weights, biases)."""
    arg: str
    sources: tuple[str, ...]
    join: str = "cat"
    matrix: bool = False
    when: Callable[[Model], bool] = lambda m: True


PACKED: tuple[Packed, ...] = (
    Packed("w_qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), matrix=True),
    Packed("w_o", ("self_attn.o_proj.weight",), matrix=True),
    # gate and up rows interleaved (gate_i, up_i): a 16-row tile holds both halves of act(gate) * up
    Packed("w_gu", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), join="interleave", matrix=True),
    Packed("w_down", ("mlp.down_proj.weight",), matrix=True),
    Packed("ln1_w", ("input_layernorm.weight",)),
    Packed("ln2_w", ("post_attention_layernorm.weight",)),
    Packed("ln1_b", ("input_layernorm.bias",), when=lambda m: m.norm == "layernorm"),
    Packed("ln2_b", ("post_attention_layernorm.bias",), when=lambda m: m.norm == "layernorm"),
    Packed("b_qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
           when=lambda m: m.qkv_bias),
    Packed("q_norm_w", ("self_attn.q_norm.weight",), when=lambda m: m.qk_norm),
    Packed("k_norm_w", ("self_attn.k_norm.weight",), when=lambda m: m.qk_norm),
)


def _fragment_index():
    """(row, col) inside a 16x16 tile of each lane's 8 elements of an mma.m16n8k16 A fragment, in register order
    (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type")."""
    import torch
    lane = torch.arange(32)
    gid, tig = lane // 4, lane % 4
    rows = torch.stack([gid, gid, gid + 8, gid + 8, gid, gid, gid + 8, gid + 8], dim=1)
    cols = torch.stack([2 * tig, 2 * tig + 1, 2 * tig, 2 * tig + 1, 2 * tig + 8, 2 * tig + 9, 2 * tig + 8,
                        2 * tig + 9], dim=1)
    return rows, cols


def to_fragments(w):
    """[N, K] -> [N/16, K/16, 32, 8]: one 16-byte load gives a lane its A fragment of a 16x16 tile."""
    n, k = w.shape
    rows, cols = _fragment_index()
    tiles = w.reshape(n // 16, 16, k // 16, 16).permute(0, 2, 1, 3)  # [mt, kt, 16, 16]
    return tiles[:, :, rows.to(w.device), cols.to(w.device)].contiguous()


def from_fragments(f):
    """Inverse of to_fragments: [N/16, K/16, 32, 8] -> [N, K]."""
    import torch
    mt, kt = f.shape[:2]
    rows, cols = _fragment_index()
    tiles = torch.empty(mt, kt, 16, 16, dtype=f.dtype, device=f.device)
    tiles[:, :, rows.to(f.device), cols.to(f.device)] = f
    return tiles.permute(0, 2, 1, 3).reshape(mt * 16, kt * 16)


def from_frag(raw, rows: int, k: int):
    """An activation stored in B-fragment order (decode X_FRAG, templates/gemv.cuh x_at: [k/16][ceil(rows/8)][32
    lanes][4], lane = 4 x (row % 8) + (col % 8) / 2, the lane's 4 elements cols 2t, 2t + 1, 2t + 8, 2t + 9 of its
    k-tile; PTX ISA, "Matrix Fragments for mma.m16n8k16", B) -> row-major [rows, k]. raw: the flat buffer."""
    import torch
    b = torch.arange(rows, device=raw.device)[:, None]
    c = torch.arange(k, device=raw.device)[None, :]
    ntile = (rows + 7) // 8
    idx = ((((c >> 4) * ntile + (b >> 3)) * 32 + (b & 7) * 4 + ((c & 7) >> 1)) << 2) + ((c >> 3) & 1) * 2 + (c & 1)
    return raw.reshape(-1)[idx]


def from_ll(raw, rows: int, k: int, frag: bool = True):
    """A buffer of decode's LL words (templates/gemv.cuh: each value in the low half of a word whose high half is the
    launch's epoch) -> row-major [rows, k]. Attention's output under ATT_LL or act under DOWN_FLOW 2 (ll_store:
    32-bit words at from_frag's indices; raw viewed as the 16-bit dtype), or with frag False o_proj's T copy of h under H_LL (ll_store, row-major;
    the 16-bit dtype) or qkv's under QKV_FLOW 2 (ll_store8: 64-bit words, row-major; raw viewed as float32).
    Little-endian: a word's value comes first."""
    vals = raw.reshape(-1)[0::2]
    return from_frag(vals, rows, k) if frag else vals[:rows * k].view(rows, k)


def from_tiles(raw, rows: int, k: int, xrows: int):
    """A GEMM engine input stored tiled (sm_90a prefill, decode GEMM_PROJ; templates/gemv.cuh gemm_x:
    [ceil(k/64)][xrows][64], row t's 16-byte chunk c of a block at c ^ (t % 8), the 128-byte swizzle) -> row-major
    [rows, k]. raw: the flat buffer."""
    import torch
    t = torch.arange(rows, device=raw.device)[:, None]
    c = torch.arange(k, device=raw.device)[None, :]
    idx = ((c >> 6) * xrows + t) * 64 + ((((c >> 3) & 7) ^ (t & 7)) << 3) + (c & 7)
    return raw.reshape(-1)[idx]


# weight format packing name (targets.WeightFormat.packing) -> (pack [N, K] tensor, unpack)
PACKINGS = {"fragments": (to_fragments, from_fragments)}


def pack_weights(weights: dict, m: Model, packing: str = "fragments") -> dict:
    """HF-named tensors (weight_shapes) -> {arg name: tensor in the kernel's layout}, per PACKED."""
    import torch
    pack = PACKINGS[packing][0]
    out = {}
    for p in PACKED:
        if not p.when(m):
            continue
        ts = [weights[s] for s in p.sources]
        if p.join == "interleave":
            t = torch.stack(ts, dim=1).reshape(-1, ts[0].shape[-1])
        else:
            t = torch.cat(ts) if len(ts) > 1 else ts[0]
        out[p.arg] = pack(t) if p.matrix else t.contiguous()
    return out


def packed_shapes(m: Model) -> dict[str, tuple[int, ...]]:
    """{arg name: shape} of pack_weights' output for model `m` (a matrix [N/16, K/16, 32, 8] in the fragments
    packing, the joined rows otherwise)."""
    shapes = weight_shapes(m)
    out = {}
    for p in PACKED:
        if not p.when(m):
            continue
        rows = sum(shapes[s][0] for s in p.sources)
        rest = shapes[p.sources[0]][1:]
        out[p.arg] = (rows // 16, rest[0] // 16, 32, 8) if p.matrix else (rows, *rest)
    return out


def unpack_weights(packed: dict, m: Model, packing: str = "fragments") -> dict:
    """Inverse of pack_weights: the HF-named tensors back from the kernel's layout."""
    unpack = PACKINGS[packing][1]
    shapes = weight_shapes(m)
    out = {}
    for p in PACKED:
        if not p.when(m):
            continue
        t = unpack(packed[p.arg]) if p.matrix else packed[p.arg]
        if p.join == "interleave":
            k = len(p.sources)
            t = t.view(-1, k, t.shape[-1])
            for i, s in enumerate(p.sources):
                out[s] = t[:, i]
        else:
            o = 0
            for s in p.sources:
                n = shapes[s][0]
                out[s] = t[o:o + n]
                o += n
    return out
