"""Typed chain specs: the levels below the target as data, parsed and checked without loading.

A `ChainSpec` is a tuple of `LevelSpec`s (the target itself is implicit, on top); `to_dict` /
`from_dict` give its JSON form (what a bundle manifest stores), `parse_chain_spec` reads the
`--chain` spelling, `check_chain_files` checks every file and name a spec refers to by its header.
None of them imports torch or loads a model; `runtime.chain_builder.build_chain` turns a spec into levels.

The spelling is '+'-separated levels, top to bottom, optionally after 'target+'; each level kind
(LEVEL_KINDS: eagle:PATH[@KERNEL], ngram[:N][/W], PATH.safetensors[@KERNEL], target@DTYPE, SOURCE[@DTYPE], tried in this order)
parses its own form, and CHAIN_FORMS lists them for help texts. Example: 'target@bfloat16+ngram'. A drafting level
(every kind but ngram) spelled LEVEL#W drafts token trees of W candidates per depth as the chain's bottom level, and
spelled LEVEL|ngram[:N] drafts trees that also hold prompt lookup's continuation (runtime.with_lookup).
"""
from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from polybasic.config import KERNELS, check_dtype
from polybasic.errors import ConfigError, PolybasicError, check
from polybasic.models.preflight import FIX_HEAD, HEAD_CONFIG_KEY, check_source, safetensors_metadata

CHAIN_SPEC_VERSION = 1


@dataclass(frozen=True)
class LevelSpec:
    """One level below the target. kind: a key of LEVEL_KINDS; the other fields are the kind's (see
    LevelKind.fields); name: its spelling, also the level's name in statistics."""

    kind: str
    source: str = ""  # model: any model source load_model accepts
    dtype: str = "float32"  # model, target: the dtype the weights run in
    path: str = ""  # quantized: the copy's .safetensors; eagle: the head's .safetensors
    kernel: str = ""  # quantized: run with this kernel (config.KERNELS) instead of the recorded ones (''); eagle:
    # the head's decoder block rounded to 4-bit weights (groups of 32) on this kernel at load ('': as trained)
    max_ngram: int = 3  # ngram: longest n-gram looked up in the context
    tree_width: int = 1  # as the bottom level, draft token trees (1: paths; runtime.tree_verify): ngram, of this
    # many leaves (its best matches); a drafting model or head, of this many candidates per depth (spelled LEVEL#W)
    lookup: int = 0  # as the bottom level, a drafting level (every kind but ngram) whose trees also hold prompt
    # lookup's continuation, n-grams of 2 to this many tokens (runtime.with_lookup; 0: none), spelled LEVEL|ngram[:N]
    name: str = ""  # default: the canonical spelling

    def __post_init__(self) -> None:
        if self.kind not in LEVEL_KINDS:
            raise ConfigError(f"kind: unknown level kind '{self.kind}'; use one of {', '.join(LEVEL_KINDS)}")
        check_tree_width(self.tree_width, f"'{self.kind}': tree_width", "e.g. ngram:3/4 or runs/copy/model.safetensors#2")
        LEVEL_KINDS[self.kind].validate(self)
        _check_lookup(self)
        if not self.name:
            object.__setattr__(self, "name", LEVEL_KINDS[self.kind].spell(self) + _width_suffix(self)
                               + (f"|ngram:{self.lookup}" if self.lookup else ""))

    def to_dict(self) -> dict:
        """{'kind', the kind's own fields (and a tree width above 1), 'name'}: JSON-able."""
        d = asdict(self)
        width = {"tree_width": self.tree_width} if _width_suffix(self) else {}
        lookup = {"lookup": self.lookup} if self.lookup else {}
        return {"kind": self.kind, **{f: d[f] for f in LEVEL_KINDS[self.kind].fields}, **width, **lookup,
                "name": self.name}

    @classmethod
    def from_dict(cls, d: dict) -> "LevelSpec":
        if not isinstance(d, dict):
            raise ConfigError(f"a level must be an object like {{'kind': 'ngram', 'max_ngram': 3}}, got {d!r}")
        kind = d.get("kind")
        if kind not in LEVEL_KINDS:
            raise ConfigError(f"kind: unknown level kind {kind!r}; use one of {', '.join(LEVEL_KINDS)}")
        unknown = set(d) - {"kind", "name", "tree_width", "lookup", *LEVEL_KINDS[kind].fields}
        if unknown:
            raise ConfigError(f"'{kind}' level: unknown fields {sorted(unknown)}; a '{kind}' level has "
                              f"{', '.join(LEVEL_KINDS[kind].fields) or 'no fields'}")
        return cls(**d)


@dataclass(frozen=True)
class ChainSpec:
    """The levels below the target, top to bottom. An eagle head must sit right below a model level
    (or the target), whose features it drafts on."""

    levels: tuple[LevelSpec, ...]
    version: int = CHAIN_SPEC_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        if self.version != CHAIN_SPEC_VERSION:
            raise ConfigError(f"version: chain spec version {self.version}, this polybasic reads "
                              f"version {CHAIN_SPEC_VERSION}; upgrade polybasic")
        if not self.levels:
            raise ConfigError("names no level below the target; e.g. 'target@bf16+ngram'")
        above = "target"
        for lv in self.levels:
            if LEVEL_KINDS[lv.kind].drafts_on_features and above not in FEATURE_LEVEL_KINDS:
                raise ConfigError(f"'{lv.name}' drafts on the features of the level above it, which is "
                                  f"not a model; put the head right below a model level, e.g. "
                                  f"'target@bf16+{lv.name}'")
            above = lv.kind

    @property
    def spelling(self) -> str:
        return "+".join(lv.name for lv in self.levels)

    def to_dict(self) -> dict:
        return {"version": self.version, "levels": [lv.to_dict() for lv in self.levels]}

    @classmethod
    def from_dict(cls, d: dict, field: str = "chain") -> "ChainSpec":
        with named(field):
            if not isinstance(d, dict) or not isinstance(d.get("levels"), list) or set(d) - {"version", "levels"}:
                raise ConfigError("expected {'version': int, 'levels': [{'kind': ..., ...}, ...]}")
            return cls(tuple(LevelSpec.from_dict(lv) for lv in d["levels"]), d.get("version", CHAIN_SPEC_VERSION))


@dataclass(frozen=True)
class LevelKind:
    """How one kind of level is spelled, checked and built."""

    name: str
    form: str  # the spelling, for help texts
    example: str
    summary: str
    fields: tuple[str, ...]  # the LevelSpec fields this kind uses
    parse: Callable[[str], LevelSpec | None]  # an item's spec, or None when the item is another kind
    spell: Callable[[LevelSpec], str]  # the canonical spelling of a spec
    validate: Callable[[LevelSpec], None] = lambda spec: None  # field values (pure)
    check_files: Callable[[LevelSpec], None] = lambda spec: None  # the files it names (cheap reads)
    builder: str = ""  # "module:function", build(spec, target, above, device) -> Level (runtime.chain_builder)
    drafts_on_features: bool = False  # reads the features of the level above it


def _with_dtype(text: str) -> tuple[str, str]:
    """'SOURCE@DTYPE' -> (SOURCE, DTYPE); no '@' (or a '/' after it, a path) -> (text, 'float32')."""
    source, at, dtype = text.rpartition("@")
    if not at or "/" in dtype:
        return text, "float32"
    return source, check_dtype(dtype, "dtype")


def check_tree_width(width, field: str = "tree_width", fix: str = "1 drafts paths") -> int:
    """A level's tree width (an int >= 1, not a bool), or a ConfigError naming `field`."""
    check(isinstance(width, int) and not isinstance(width, bool) and width >= 1, field,
          f"must be an integer >= 1, got {width!r}", fix)
    return width


def _width_suffix(spec: LevelSpec) -> str:
    """'#W' for a tree width above 1 of a kind that does not spell it itself (every kind but ngram), else ''."""
    return f"#{spec.tree_width}" if spec.tree_width > 1 and "tree_width" not in LEVEL_KINDS[spec.kind].fields else ""


def _check_lookup(spec: LevelSpec) -> None:
    check(isinstance(spec.lookup, int) and not isinstance(spec.lookup, bool) and spec.lookup >= 0,
          f"'{spec.kind}': lookup", f"must be an integer >= 0, got {spec.lookup!r}", "e.g. 3 (spelled LEVEL|ngram:3)")
    if spec.lookup and spec.kind == "ngram":
        raise ConfigError(f"'{spec.kind}': lookup joins prompt lookup to a drafting level's trees; an n-gram level "
                          "is prompt lookup already (use ngram:N/W for its trees)")


def _parse_ngram(item: str) -> LevelSpec | None:
    head, slash, width = item.partition("/")
    if head != "ngram" and not head.startswith("ngram:"):
        return None
    n = head.partition(":")[2] or "3"
    if not n.isdigit():
        raise ConfigError(f"'{item}' needs an integer n-gram size, e.g. ngram:3")
    if slash and not width.isdigit():
        raise ConfigError(f"'{item}' needs an integer tree width after '/', e.g. ngram:3/4 (trees of 4 leaves)")
    return LevelSpec("ngram", max_ngram=int(n), tree_width=int(width) if slash else 1, name=item)


def _validate_ngram(spec: LevelSpec) -> None:
    if not (isinstance(spec.max_ngram, int) and spec.max_ngram >= 1):
        raise ConfigError(f"'ngram': max_ngram must be an integer >= 1, got {spec.max_ngram!r}; e.g. ngram:3")


def _path_and_kernel(text: str) -> tuple[str, str]:
    """'PATH.safetensors@KERNEL' -> (PATH.safetensors, KERNEL); any other text -> (text, '')."""
    path, at, kernel = text.rpartition("@")
    return (path, kernel) if at and path.endswith(".safetensors") and "/" not in kernel else (text, "")


def _parse_eagle(item: str) -> LevelSpec | None:
    if not item.startswith("eagle:"):
        return None
    path, kernel = _path_and_kernel(item[len("eagle:"):])
    return LevelSpec("eagle", path=path, kernel=kernel, name=item)


def _check_kernel(spec: LevelSpec, what: str) -> None:
    if spec.kernel and spec.kernel not in KERNELS:
        raise ConfigError(f"'{spec.path}@{spec.kernel}': unknown kernel '{spec.kernel}'. {what}: "
                          f"{', '.join(KERNELS[1:])}")


def _validate_eagle(spec: LevelSpec) -> None:
    _needs_path(spec)
    _check_kernel(spec, "'@' after a head's path runs its decoder block on 4-bit weights with a kernel")


def _needs_path(spec: LevelSpec) -> None:
    if not spec.path:
        raise ConfigError(f"'{spec.kind}' level needs a file path, e.g. {LEVEL_KINDS[spec.kind].example}")


def _check_head(spec: LevelSpec) -> None:
    p = Path(spec.path).expanduser()
    if not p.is_file():
        raise ConfigError(f"drafter head {p} does not exist; pass the head.safetensors written by "
                          "`polybasic distill`")
    if HEAD_CONFIG_KEY not in safetensors_metadata(p, FIX_HEAD):
        raise ConfigError(f"{p} has no {HEAD_CONFIG_KEY} metadata; it is not a polybasic drafter head "
                          "(written by `polybasic distill`)")


def _parse_quantized(item: str) -> LevelSpec | None:
    path, kernel = _path_and_kernel(item)
    return LevelSpec("quantized", path=path, kernel=kernel, name=item) if path.endswith(".safetensors") else None


def _validate_quantized(spec: LevelSpec) -> None:
    _needs_path(spec)
    _check_kernel(spec, "A quantized copy runs in the dtype it was saved with; '@' names a kernel to run it with")


def _parse_target(item: str) -> LevelSpec | None:
    if item != "target" and not item.startswith("target@"):
        return None
    source, dtype = _with_dtype(item)
    if source != "target":
        raise ConfigError(f"'{item}': spell the target's copy as target@DTYPE, e.g. target@bf16")
    return LevelSpec("target", dtype=dtype, name=item)


def _parse_model(item: str) -> LevelSpec:
    source, dtype = _with_dtype(item)
    if source.endswith(".safetensors"):
        raise ConfigError(f"'{item}': a quantized copy runs in the dtype it was saved with; drop '@{dtype}'")
    return LevelSpec("model", source=source, dtype=dtype, name=item)


def _validate_dtype(spec: LevelSpec) -> None:
    check_dtype(spec.dtype, f"'{spec.kind}' level dtype")


def _validate_model(spec: LevelSpec) -> None:
    _validate_dtype(spec)
    if not spec.source:
        raise ConfigError("'model' level needs a source, e.g. smollm2-135m@bf16")


LEVEL_KINDS: dict[str, LevelKind] = {k.name: k for k in [
    LevelKind("eagle", "eagle:PATH[@KERNEL]", "eagle:runs/smollm2-cpu/distill/target/head.safetensors",
              "an EAGLE drafter head (`polybasic distill`), drafting on the features of the model "
              "level right above it; @KERNEL (e.g. w4a8): its decoder block on 4-bit weights", ("path", "kernel"),
              _parse_eagle, lambda s: f"eagle:{s.path}" + (f"@{s.kernel}" if s.kernel else ""),
              _validate_eagle, _check_head, "polybasic.runtime.chain_builder:build_eagle", drafts_on_features=True),
    LevelKind("ngram", "ngram[:N][/W]", "ngram:3/4", "prompt lookup: proposes what followed the longest "
              "matching n-gram (N at most, default 3) of the context; /W: a token tree of what followed its "
              "W best matches", ("max_ngram", "tree_width"), _parse_ngram,
              lambda s: f"ngram:{s.max_ngram}" + (f"/{s.tree_width}" if s.tree_width > 1 else ""), _validate_ngram, builder="polybasic.runtime.chain_builder:build_ngram"),
    LevelKind("quantized", "PATH.safetensors[@KERNEL]", "runs/smollm2-cpu/model.safetensors@w4a8",
              "a quantized copy of the target written by `polybasic quantize`, in its recorded kernels or "
              "another (w4a8: int8 activations, CPUs with AVX-512 VNNI)", ("path", "kernel"), _parse_quantized,
              lambda s: f"{s.path}@{s.kernel}" if s.kernel else s.path, _validate_quantized,
              lambda s: check_source(s.path, "quantized copy"),
              "polybasic.runtime.chain_builder:build_quantized"),
    LevelKind("target", "target@DTYPE", "target@bfloat16", "the target's own weights in another dtype",
              ("dtype",), _parse_target, lambda s: f"target@{s.dtype}", _validate_dtype,
              builder="polybasic.runtime.chain_builder:build_target"),
    LevelKind("model", "SOURCE[@DTYPE]", "smollm2-135m@bf16", "any model source --model accepts (short "
              "name, .gguf file, Hugging Face folder, Hub id), in DTYPE (default float32)",
              ("source", "dtype"), _parse_model, lambda s: f"{s.source}@{s.dtype}", _validate_model,
              lambda s: check_source(s.source, "model source"), "polybasic.runtime.chain_builder:build_model"),
]}
FEATURE_LEVEL_KINDS = ("target", "model", "quantized")  # levels with features an eagle head can read

CHAIN_FORMS = "\n".join(textwrap.fill(f"{k.form:<17} {k.summary}; e.g. {k.example}", 96, initial_indent="  ",
                                      subsequent_indent=" " * 20) for k in LEVEL_KINDS.values())
CHAIN_HELP = ("A chain is the levels below the target, top to bottom, '+'-separated (optionally\n"
              "after 'target+'); each level is one of:\n" + CHAIN_FORMS +
              "\nA bottom level spelled LEVEL#W (any kind but ngram, whose /W counts leaves) drafts token trees of W\n"
              "candidates per depth, verified in one forward; LEVEL|ngram[:N] drafts trees that also hold prompt\n"
              "lookup's continuation (e.g. eagle:runs/x/head.safetensors@w4a8|ngram). "
              "Example: target@bfloat16+ngram (the target <- its bf16 copy <- prompt lookup)")


@contextmanager
def named(field: str) -> Iterator[None]:
    """Prefix the message of a polybasic error raised inside with `field: `."""
    try:
        yield
    except PolybasicError as e:
        raise type(e)(f"{field}: {e}") from None


def parse_level_spec(item: str) -> LevelSpec:
    """One level from its spelling (pure: no file is read)."""
    item = item.strip()
    if not item:
        raise ConfigError("empty level name (two '+' in a row?); spell levels like 'target@bf16+ngram'")
    drafter, bar, lookup = item.rpartition("|")
    if bar:  # LEVEL|ngram[:N]: a drafting level's trees with prompt lookup's continuation merged in
        look = parse_level_spec(lookup)
        if look.kind != "ngram" or look.tree_width > 1 or not drafter:
            raise ConfigError(f"'{item}': after '|' comes prompt lookup, ngram or ngram:N, after a drafting level, "
                              "e.g. eagle:runs/x/head.safetensors|ngram:3")
        return replace(parse_level_spec(drafter), lookup=look.max_ngram, name=item)
    base, hash_, width = item.rpartition("#")
    if hash_:  # LEVEL#W: a drafting level's token trees, W candidates per depth
        if not width.isdigit() or not base:
            raise ConfigError(f"'{item}' needs an integer tree width after '#', e.g. "
                              "runs/copy/model.safetensors#2 (its path and 1 more candidate per depth)")
        spec = parse_level_spec(base)
        if spec.kind == "ngram":
            raise ConfigError(f"'{item}': an n-gram level spells its tree width after '/', e.g. ngram:3/4")
        return replace(spec, tree_width=int(width), name=item)
    for kind in LEVEL_KINDS.values():
        spec = kind.parse(item)
        if spec is not None:
            return spec
    raise AssertionError("the 'model' kind parses every item")


def parse_chain_spec(text: str, flag: str = "chain") -> ChainSpec:
    """'[target+]LEVEL+LEVEL...' -> ChainSpec (pure: no file read, no torch). Errors name `flag`
    and the offending item."""
    items = text.split("+")
    if items[0].strip() == "target":
        items = items[1:]
    levels = []
    for item in items:
        with named(f"{flag}: level '{item.strip()}'" if item.strip() else f"{flag} '{text}'"):
            levels.append(parse_level_spec(item))
    with named(f"{flag} '{text}'"):
        return ChainSpec(tuple(levels))


def check_chain_files(spec: ChainSpec, flag: str = "chain") -> ChainSpec:
    """Check every file and model name the spec refers to, by headers only (no torch); returns spec."""
    for lv in spec.levels:
        with named(f"{flag}: level '{lv.name}'"):
            LEVEL_KINDS[lv.kind].check_files(lv)
    return spec

