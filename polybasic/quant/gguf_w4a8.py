"""A GGUF model's linears on the CPU kernel 'w4a8', over the file's own codes: the target computed as
llama.cpp computes it (the weights' codes times int8 activations), every row by the same code.

A Q4_K row is 4-bit codes c, value d * sc * c - dmin * m per group of 32 (sc, m 6-bit, d, dmin fp16 per 256
columns): the kernel's 4-bit tiles hold it exactly (ds = d, s8 = sc, do = -dmin, o8 = m). A Q6_K row is 6-bit
codes q, value d * sc * (q - 32) per group of 16 (sc int8, d fp16 per 256 columns): the 6-bit tiles hold it
exactly as u = q, s = d * sc, o = -32 * d * sc (do = -32 d, o8 = sc). So the kernel multiplies the file's
weights, bit for bit in fp32; only the activations are rounded, to 8 bits per group of 32 (16 for Q6_K rows),
as llama.cpp rounds them (per 256 in its Q8_K). The kernel is row-invariant, so a target's one-token steps
and its verifications agree bit for bit and a chain over it stays lossless. Linears with rows of any other
block type (Q5_K, Q8_0, F16, ...) keep their dense weights and kernels.

`bind(model, gguf)` finds each linear's rows among the file's by content, as models.gguf_codes.attach_codes
does (the weight rows in the model's dtype against the file's rows expanded and rounded to it, then every
row checked whole), and swaps the linears it can hold for GGUFLinear. Reached as `--model NAME@w4a8`
(quant.api.load_any_model). Binding a 1.5B model takes ~35 s on 2 cores, so its result (every swapped linear's
tiles) is cached per GGUF file, model and code version under $POLYBASIC_CACHE/w4a8 (`cache_file`); later loads
read it back in seconds.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from polybasic.artifacts import atomic_path
from polybasic.errors import ConfigError
from polybasic.models.args import ModelArgs
from polybasic.models.decoder import Transformer
from polybasic.models.gguf_codes import k_factors, q4k_codes, q6k_factors, rows_by_tensor
from polybasic.models.gguf_index import read_tensor_infos
from polybasic.models.registry import cache_root
import polybasic.quant.w4a8 as w4a8

log = logging.getLogger(__name__)

BITS = {"Q4_K": 4, "Q6_K": 6}  # the block types the kernel holds exactly -> the width of its codes there
TILE = w4a8.TILE


@dataclass
class Factors:
    """Rows of a GGUF tensor as the kernel's factors: w = s * u + o per group (GROUPS[bits] columns), with
    s = ds * s8 and o = do * o8 (ds, do fp16 per 256 columns)."""
    bits: int
    u: Tensor  # [N, K] uint8 codes
    ds: Tensor  # [N, K/256] fp16
    s8: Tensor  # [N, groups] int8
    do: Tensor  # [N, K/256] fp16
    o8: Tensor  # [N, groups] int8

    def expand(self) -> Tensor:
        """[N, K] fp32: the values the kernel multiplies, gguf's own dequantized values bit for bit. 4-bit codes
        in fp32 (s * u is exact, 21 bits, so adding o rounds once, as gguf's d * sc * q - dmin * m does); 6-bit
        codes through float64 (s * u may need 25 bits), rounded once."""
        n, k = self.u.shape
        group = w4a8.GROUPS[self.bits]
        dt = torch.float32 if self.bits == 4 else torch.float64
        per = lambda d, q: d.to(dt).repeat_interleave(256 // group, 1) * q.to(dt)  # noqa: E731  [N, groups]
        s, o = per(self.ds, self.s8), per(self.do, self.o8)
        return torch.addcmul(o[..., None], self.u.to(dt).view(n, -1, group), s[..., None]).view(n, k).float()

    def rows(self, index: Tensor) -> "Factors":
        return Factors(self.bits, *(t[index] for t in (self.u, self.ds, self.s8, self.do, self.o8)))

    def pack(self) -> Tensor:
        return w4a8.pack_factors(self.u, self.ds, self.s8, self.do, self.o8, self.bits)


def factors(kind: str, raw: np.ndarray, n: int, k: int) -> Factors:
    """The raw super-blocks [n * k / 256, bytes] of an [n, k] Q4_K or Q6_K tensor -> its Factors."""
    t = lambda a, dtype: torch.from_numpy(np.ascontiguousarray(a)).reshape(n, -1).to(dtype)  # noqa: E731
    if kind == "Q4_K":
        d, dmin, sc, m = k_factors(raw)
        return Factors(4, t(q4k_codes(raw), torch.uint8), t(d, torch.float16), t(sc, torch.int8),
                       t(-dmin, torch.float16), t(m, torch.int8))
    if kind == "Q6_K":
        q, d, sc = q6k_factors(raw)
        do = t(-32 * d, torch.float16)
        if not torch.isfinite(do).all():
            raise ValueError("a Q6_K block's d is too large for the kernel's fp16 offset factor (-32 d)")
        return Factors(6, t(q, torch.uint8), t(d, torch.float16), t(sc, torch.int8), do, t(sc, torch.int8))
    raise ValueError(f"GGUF block type {kind}: the kernel holds only {', '.join(BITS)} exactly")


def read_factors(path: str | Path) -> list[Factors]:
    """Every 2-D Q4_K or Q6_K tensor of a GGUF file as Factors."""
    out = []
    for info in read_tensor_infos(path):
        if info.kind in BITS and len(info.shape) == 2:
            k, n = info.shape  # GGUF lists the contiguous dim first
            out.append(factors(info.kind, info.data.reshape(-1, info.block_bytes), n, k))
    return out


class GGUFLinear(nn.Module):
    """A linear over a GGUF's own codes on the kernel 'w4a8': its output rows as runs of 4-bit (Q4_K) and 6-bit
    (Q6_K) tiles (a fused [q; k; v] may mix them), each run one kernel call; computed in x's dtype."""

    def __init__(self, in_features: int, out_features: int, parts: list[tuple[int, Tensor]], bias: Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits = tuple(bits for bits, _ in parts)
        for i, (_, tiles) in enumerate(parts):  # buffers: a compiled step takes them as inputs, unguarded
            self.register_buffer(f"tiles{i}", tiles, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:  # x [..., in] -> [..., out]
        x2 = x.reshape(-1, self.in_features)
        ys = [w4a8.mm(x2, getattr(self, f"tiles{i}"), bits) for i, bits in enumerate(self.bits)]  # [rows, part]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, -1)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def dequantized_weight(self, dtype: torch.dtype = torch.float32, chunk: int = 256,
                           rows: Tensor | None = None) -> Tensor:
        """The weight [out, in] in `dtype`, as the kernel multiplies it up to float rounding: the kernel run on
        rows of the identity (their int8 activations are exact), `chunk` rows a call. For a drafter head's start
        and its draft rows (models.eagle_head), where a weight's last bit does not matter. rows: only these output
        rows [R] -> [R, in]; only the tiles of 16 rows that hold them run (a draft vocabulary's rows of an LM head)."""
        dev = self.tiles0.device
        parts, made, lo = [], [], 0  # (tiles, bits) to run; the output rows they make
        for i, bits in enumerate(self.bits):
            tiles = getattr(self, f"tiles{i}")  # [n / 16, bytes]: each tile of 16 rows stands alone
            n = tiles.shape[0] * w4a8.TILE
            ids = torch.arange(tiles.shape[0], device=dev) if rows is None else torch.unique(
                (rows[(rows >= lo) & (rows < lo + n)] - lo) // w4a8.TILE)
            parts.append((tiles if rows is None else tiles.index_select(0, ids), bits))
            made.append(lo + (ids[:, None] * w4a8.TILE + torch.arange(w4a8.TILE, device=dev)).flatten())
            lo += n
        eye = torch.eye(self.in_features, dtype=torch.float32, device=dev)  # [in, in]
        out = torch.empty(self.in_features, sum(len(m) for m in made), dtype=dtype, device=dev)  # [in, made] = W^T
        for a in range(0, self.in_features, chunk):
            out[a:a + chunk] = torch.cat([w4a8.mm(eye[a:a + chunk], t, bits) for t, bits in parts], -1).to(dtype)
        if rows is None:
            return out.T.contiguous()
        at = torch.empty(self.out_features, dtype=torch.long, device=dev)
        made_rows = torch.cat(made)
        at[made_rows] = torch.arange(len(made_rows), device=dev)  # output row -> its column of `out`
        return out.T[at[rows]].contiguous()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"

    def kernel_path(self) -> str:
        """Which code computes this linear here (models.prepare.kernel_paths); row-invariant at any row count."""
        return f"w4a8 {'/'.join(map(str, sorted(set(self.bits))))}-bit tiles (AVX-512 VNNI)"


def _keys(w: Tensor) -> list[int]:
    """A hash of every row's values (-0.0 as 0.0: gguf's d * sc * (q - 32) is -0.0 where the kernel's s * q + o
    is 0.0, the same weight), by their bytes (numpy has no bf16, so rows are hashed as integers)."""
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[w.element_size()]
    return [hash(row.tobytes()) for row in (w.detach() + 0.0).contiguous().view(as_int).numpy()]


def _runs(hits: list[tuple[int, int]], tensors: list[Factors]) -> list[tuple[int, int, int]]:
    """[(start, end, bits)]: the maximal runs of output rows whose source tensors have one code width."""
    runs: list[tuple[int, int, int]] = []
    for i, (ti, _) in enumerate(hits):
        bits = tensors[ti].bits
        if runs and runs[-1][2] == bits:
            runs[-1] = (runs[-1][0], i + 1, bits)
        else:
            runs.append((i, i + 1, bits))
    return runs


def _gather(tensors: list[Factors], hits: list[tuple[int, int]], bits: int) -> Factors:
    """The rows hits [(tensor, row)] (all of one width) as one Factors, gathered per source tensor."""
    groups = rows_by_tensor(hits)
    first = tensors[next(iter(groups))]
    out = Factors(bits, *(t.new_empty(len(hits), *t.shape[1:]) for t in (first.u, first.ds, first.s8, first.do,
                                                                           first.o8)))
    for ti, (mine, theirs) in groups.items():
        part = tensors[ti].rows(torch.tensor(theirs))
        for name in ("u", "ds", "s8", "do", "o8"):
            getattr(out, name)[torch.tensor(mine)] = getattr(part, name)
    return out


def _coded(lin: nn.Linear, tensors: list[Factors], where: dict[int, tuple[int, int]]) -> GGUFLinear | None:
    """lin as a GGUFLinear if every row is found in a Q4_K/Q6_K tensor and expands to its weight exactly."""
    hits = [where.get(key) for key in _keys(lin.weight)]
    if not hits or None in hits:
        return None
    parts = []
    for start, end, bits in _runs(hits, tensors):
        if (end - start) % TILE or lin.in_features % 256:  # whole tiles of rows, whole super-blocks of columns
            return None
        f = _gather(tensors, hits[start:end], bits)
        if not torch.equal(f.expand().to(lin.weight.dtype), lin.weight[start:end]):
            return None
        parts.append((bits, f.pack()))
    bias = None if lin.bias is None else lin.bias.detach().clone()
    return GGUFLinear(lin.in_features, lin.out_features, parts, bias)


def check(device: str | torch.device) -> None:
    """Raise a ConfigError unless the kernel runs here, on `device` (cheap after its first build)."""
    if torch.device(device).type != "cpu":
        raise ConfigError(f"model: '@w4a8' runs on a CPU, not {torch.device(device).type}; use --device cpu or "
                          "drop '@w4a8'")
    ok, why = w4a8.status()
    if not ok:
        raise ConfigError(f"model: '@w4a8' runs the GGUF's codes on the CPU kernel w4a8, which cannot run here "
                          f"({why}); drop '@w4a8'")


def bind(model: nn.Module, gguf: str | Path) -> tuple[int, int]:
    """Swap every nn.Linear of `model` (on a CPU) whose rows a GGUF file holds as Q4_K or Q6_K for a GGUFLinear
    over those codes; returns (swapped, linears). Raises ConfigError where the kernel cannot run here. The swaps
    are read from `cache_file` when it is there, else found and written to it with the rest of the model's
    weights (what `load_bound` needs to build the bound model from the cache alone)."""
    linears = _linears(model)
    check(linears[0][1].weight.device if linears else "cpu")
    path, cached = _cached(gguf, linears)
    coded = cached[0] if cached else _find(linears, gguf)
    _swap(model, coded)
    if cached is None:
        _write_cache(path, coded, model.state_dict())
    log.info("%d of %d linears run the GGUF's codes on the kernel w4a8", len(coded), len(linears))
    return len(coded), len(linears)


def load_bound(gguf: str | Path, args: ModelArgs, dtype: torch.dtype) -> Transformer | None:
    """The lean decoder of `args` in `dtype` on the CPU, bound to the GGUF's codes (as `bind` leaves it), built from
    bind's cache alone: its tiles and the rest of its weights, without reading the model's dense weights (a 1.5B
    model's 7 GB in fp32); None where there is no usable cache (then load the model and `bind` it)."""
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
    path, cached = _cached(gguf, _linears(model))
    if cached is None or not cached[1]:
        return None
    _swap(model, cached[0])
    model.load_state_dict(cached[1], strict=False, assign=True)
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        log.warning("ignoring the cached w4a8 binding %s: it lacks some of the model's weights", path)
        return None
    return model.eval().requires_grad_(False)


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]


def _cached(gguf: str | Path, linears: list[tuple[str, nn.Linear]]) -> tuple[Path, tuple | None]:
    """(bind's cache file for these linears, what _read_cache reads from it, or None where there is none)."""
    path = cache_file(gguf, linears)
    return path, _read_cache(path, linears) if path.is_file() else None


def _swap(model: nn.Module, coded: dict[str, "GGUFLinear"]) -> None:
    for name, new in coded.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)


def _find(linears: list[tuple[str, nn.Linear]], gguf: str | Path) -> dict[str, GGUFLinear]:
    """{name: its GGUFLinear} for the linears whose rows the file holds as Q4_K/Q6_K codes (matched by content)."""
    tensors = read_factors(gguf)
    dtypes = {m.weight.dtype for _, m in linears}
    where: dict[int, tuple[int, int]] = {}  # hash of a row rounded to the model's dtype -> (tensor, row)
    for ti, f in enumerate(tensors):
        values = f.expand()
        for dtype in dtypes:
            for ri, key in enumerate(_keys(values.to(dtype))):
                where.setdefault(key, (ti, ri))
    coded = {}
    for name, lin in linears:
        new = _coded(lin, tensors, where)
        if new is None:
            log.info("%s keeps its dense weight (not all of its rows are Q4_K/Q6_K rows of %s)", name, gguf)
        else:
            coded[name] = new
    return coded


def cache_file(gguf: str | Path, linears: list[tuple[str, nn.Linear]]) -> Path:
    """Where bind keeps the swaps of these linears: keyed by the GGUF file (path, size, mtime), the linears (names,
    shapes, dtypes) and the code that packs and runs the tiles (this module and the kernel's source), so that
    another file, model, dtype or layout never reads a stale one. No weight is read: the model's weights are the
    file's own (its HF folder is converted from it), so a load can find its cache before loading them."""
    p = Path(gguf).resolve()
    st = p.stat()
    h = hashlib.sha256(b"\0".join([str(p).encode(), str(st.st_size).encode(), str(st.st_mtime_ns).encode(),
                                    Path(__file__).read_bytes(), w4a8.SOURCE.read_bytes()]))
    for name, lin in linears:
        h.update(f"{name}{tuple(lin.weight.shape)}{lin.weight.dtype}".encode())
    return cache_root() / "w4a8" / f"{p.stem}-{h.hexdigest()[:16]}.safetensors"


def _write_cache(path: Path, coded: dict[str, GGUFLinear], rest: dict[str, Tensor]) -> None:
    """The swaps as one safetensors file (tensors NAME.tiles0.., NAME.bias; shapes and widths in its metadata), and
    the bound model's other weights `rest` (its state dict: every tensor but the swapped linears', under "rest."),
    written atomically; a failure only costs the next load the search."""
    tensors, meta = {f"rest.{k}": v.contiguous() for k, v in rest.items()}, {}
    for name, lin in coded.items():
        for i in range(len(lin.bits)):
            tensors[f"{name}.tiles{i}"] = getattr(lin, f"tiles{i}")
        if lin.bias is not None:
            tensors[f"{name}.bias"] = lin.bias
        meta[name] = [lin.in_features, lin.out_features, list(lin.bits)]
    try:
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"linears": json.dumps(meta)})
        log.info("the w4a8 binding cached in %s for the next load", path)
    except (OSError, SafetensorError) as e:  # a full disk, say
        log.warning("could not cache the w4a8 binding in %s (%s); the next load binds again", path, e)


def _read_cache(path: Path, linears: list[tuple[str, nn.Linear]]) -> tuple[dict[str, GGUFLinear], dict] | None:
    """bind's swaps from `path` and the rest of the model's weights, or None (logged) when it cannot be read or does
    not fit the model's linears."""
    shapes = {name: (lin.in_features, lin.out_features) for name, lin in linears}
    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["linears"])
            misfit = next((name for name, (k, n, _) in meta.items() if shapes.get(name) != (k, n)), None)
            if misfit is not None:
                log.warning("ignoring the cached w4a8 binding %s: it does not fit this model's %s; binding again",
                            path, misfit)
                return None
            coded = {name: GGUFLinear(k, n, [(b, f.get_tensor(f"{name}.tiles{i}")) for i, b in enumerate(bits)],
                                      f.get_tensor(f"{name}.bias") if f"{name}.bias" in f.keys() else None)
                     for name, (k, n, bits) in meta.items()}
            rest = {k.removeprefix("rest."): f.get_tensor(k) for k in f.keys() if k.startswith("rest.")}
    except (OSError, SafetensorError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the cached w4a8 binding %s (%s): binding again", path, e)
        return None
    log.info("the w4a8 binding read from %s", path)
    return coded, rest
